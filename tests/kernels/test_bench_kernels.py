"""`attnres-pp bench kernels` and `bench kernel-streams` on the paths that run without a GPU: the
no-device exit and the interpreter dry run of the whole timing code, the fused MSAR stream kernel's
rows included (which must not write result files), run as scripts/gpu_check.sh runs them
(`python -m attnres_pp.cli` from the checkout) and without importing Ray, which the GPU machine lacks."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.subprocess

REPO = Path(__file__).resolve().parents[2]
# The CLI as gpu_check.sh calls it, then a last line saying whether anything imported Ray.
CLI = ("import runpy, sys\n"
       "sys.argv = ['attnres_pp.cli', *sys.argv[1:]]\n"
       "try:\n"
       "    runpy.run_module('attnres_pp.cli', run_name='__main__')\n"
       "except SystemExit as done:\n"
       "    code = done.code\n"
       "print('ray imported' if 'ray' in sys.modules else 'ray not imported')\n"
       "sys.exit(code)\n")


def _run(*argv):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run(
        [sys.executable, "-c", CLI, "bench", *argv], cwd=REPO, env=env, capture_output=True, text=True, timeout=240
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="measures for real when a GPU is present")
@pytest.mark.parametrize("name", ["kernels", "kernel-streams"])
def test_without_cuda_it_measures_nothing_and_exits_0(name):
    result = _run(name, "--quick")
    assert result.returncode == 0, result.stderr
    assert "no CUDA device: nothing measured" in result.stdout
    assert result.stdout.rstrip().endswith("ray not imported")


def test_dry_run_times_every_implementation_and_writes_nothing():
    results = REPO / "benchmarks" / "results"
    before = set(results.iterdir()) if results.exists() else set()
    result = _run("kernels", "--dry-run-cpu")
    assert result.returncode == 0, result.stderr
    assert result.stdout.rstrip().endswith("ray not imported")
    assert "dry run: no results written" in result.stdout
    rows = [line for line in result.stdout.splitlines() if line.startswith("| phase")]
    assert len(rows) == 14  # 3 shapes x (phase1, phase2) x (fwd, fwd+bwd), and the fused MSAR stream kernel's 2
    streams = [row for row in rows if row.startswith("| phase1_streams | dry-run msar |")]
    assert [row.split("|")[8].strip() for row in streams] == ["fwd", "fwd+bwd"]
    assert not any("error" in row or "skipped" in row for row in rows), rows
    after = set(results.iterdir()) if results.exists() else set()
    assert after == before


def test_kernel_streams_dry_run_times_only_the_stream_kernel():
    result = _run("kernel-streams", "--dry-run-cpu")
    assert result.returncode == 0, result.stderr
    rows = [line for line in result.stdout.splitlines() if line.startswith("| phase")]
    assert [row.split("|")[1].strip() for row in rows] == ["phase1_streams", "phase1_streams"]
    assert not any("error" in row or "skipped" in row for row in rows), rows
    assert "dry run: no results written" in result.stdout and result.stdout.rstrip().endswith("ray not imported")
