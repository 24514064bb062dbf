"""scripts/gpu_check.sh: without CUDA it says so and exits non-zero, running nothing; it parses,
checks the fused MSAR stream kernel and runs the kernel benchmark as `python -m attnres_pp.cli`; and
its JSON writer (gpu_check_summary.py) on a fake OUT_DIR."""

import json
import subprocess
import sys

import pytest
import torch

from tests.run_helpers import REPO

pytestmark = pytest.mark.subprocess

SCRIPT = REPO / "scripts" / "gpu_check.sh"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the check would really run")
def test_gpu_check_without_cuda_refuses(tmp_path):
    result = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert result.returncode == 3
    assert "no CUDA device is visible" in result.stderr and "nothing was run" in result.stderr
    assert not (tmp_path / "out" / "summary.md").exists()


def test_gpu_check_needs_an_output_dir():
    result = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "usage: scripts/gpu_check.sh OUT_DIR" in result.stderr


def test_gpu_check_parses_and_checks_the_fused_stream_kernel():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, timeout=30).returncode == 0
    text = SCRIPT.read_text()
    assert 'check msar_streams_kernel 60 "$PYTHON" -m pytest' in text
    assert "tests/kernels/test_triton_msar_streams.py" in text and '--ignore="$STREAM_TESTS"' in text


def test_gpu_check_runs_the_kernel_benchmark_through_the_cli_module():
    """The GPU machine has no Ray and no installed package: the benchmark runs as a module of the
    checkout (PYTHONPATH), and its quick results are the JSON that gpu_check_summary.py reads."""
    text = SCRIPT.read_text()
    assert 'export PYTHONPATH="$PWD' in text
    command = ('check bench_kernels_quick 150 "$PYTHON" -m attnres_pp.cli bench kernels --quick '
               '--out "$OUT/bench_kernels"')
    assert command in text
    assert 'cp "$OUT"/bench_kernels/kernels_quick_*.json "$OUT/bench_kernels.json"' in text
    assert "benchmarks/" not in text.split("set -uo pipefail", 1)[1]


def test_summary_pulls_out_the_stream_kernel_rows(tmp_path):
    """gpu_check_summary.py on a fake OUT_DIR: the check rows, the variants, and the stream kernel's
    Triton rows with its speed-ups over the twin and the compiled twin."""
    (tmp_path / "rows.txt").write_text("| kernel_tests | pass | 40 | 90 passed |\n"
                                       "| msar_streams_kernel | fail (exit 1) | 12 | 1 failed / 10 passed |\n")
    (tmp_path / "variant_msar").mkdir()
    (tmp_path / "variant_msar" / "summary.json").write_text(json.dumps({"step_time_s": 0.5, "losses": [4.0, 3.5]}))
    shape = dict(name="quick msar m=4", n_sources=4, n_tokens=8192, width_d=1024, n_queries=2, seq_len=1024,
                 kernel_sizes=[4, 8, 12], gbps=None, frac_copy_bw=None, max_abs_err_vs_torch=0.0)
    bench_rows = [dict(op="phase1", impl="triton", mode="fwd", ms=1.0, speedup_of_triton=1.0, name="quick")]
    bench_rows += [dict(op="phase1_streams", impl=impl, mode=mode, ms=ms, speedup_of_triton=speedup, **shape)
                   for mode in ("fwd", "fwd+bwd")
                   for impl, ms, speedup in (("triton", 1.0, 1.0), ("torch", 6.0, 6.0), ("torch.compile", 2.0, 2.0))]
    (tmp_path / "bench_kernels.json").write_text(json.dumps({"meta": {}, "rows": bench_rows}))
    script = SCRIPT.parent / "gpu_check_summary.py"
    result = subprocess.run([sys.executable, str(script), str(tmp_path), "H200"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    payload = json.loads((tmp_path / "gpu_check.json").read_text())
    assert payload["all_passed"] is False and payload["variant_step_time_bf16"]["msar"]["final_loss"] == 3.5
    streams = payload["msar_streams_kernel"]
    assert streams["tests"]["result"] == "fail (exit 1)" and streams["tests"]["last_line"] == "1 failed / 10 passed"
    assert [(r["mode"], r["speedup_vs_torch"], r["speedup_vs_torch_compile"]) for r in streams["bandwidth"]] == [
        ("fwd", 6.0, 2.0), ("fwd+bwd", 6.0, 2.0)]
    assert any("NCCL point-to-point" in line for line in payload["not_checked"])
