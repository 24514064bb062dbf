"""`attnres-pp bench kernels` and `bench kernel-streams` on the paths that run without a GPU: the
no-device exit and the interpreter dry run of the whole timing code, the fused MSAR stream kernel's
rows included (which must not write result files), run as scripts/gpu_check.sh runs them
(`python -m attnres_pp.cli` from the checkout) and without importing Ray, which the GPU machine lacks.
The four runs share one child process, one after the other, each checked on its own output."""

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.cli_batch import END, split_runs

# One worker runs them all (--dist loadgroup), so that the shared child process (`runs`) starts once.
pytestmark = [pytest.mark.subprocess, pytest.mark.xdist_group("bench-kernels-cli")]

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"
# The CLI as gpu_check.sh calls it, once for each argv of the JSON list in argv[1], each run's output
# closed by END and its exit code; then a last line saying whether any of them imported Ray.
CLI = ("import json, runpy, sys\n"
       "for argv in json.loads(sys.argv[1]):\n"
       "    sys.argv = ['attnres_pp.cli', *argv]\n"
       "    code = 0\n"
       "    try:\n"
       "        runpy.run_module('attnres_pp.cli', run_name='__main__')\n"
       "    except SystemExit as done:\n"
       "        code = done.code if isinstance(done.code, int) else int(done.code is not None)\n"
       f"    print('{END}' + str(code), flush=True)\n"
       f"    print('{END}' + str(code), file=sys.stderr, flush=True)\n"
       "print('ray imported' if 'ray' in sys.modules else 'ray not imported')\n")
RUNS = {"dry kernels": ["bench", "kernels", "--dry-run-cpu"],
        "dry kernel-streams": ["bench", "kernel-streams", "--dry-run-cpu"]}
if not torch.cuda.is_available():  # with a GPU --quick measures for real (gpu_check.sh runs it)
    RUNS |= {"quick kernels": ["bench", "kernels", "--quick"],
             "quick kernel-streams": ["bench", "kernel-streams", "--quick"]}


@dataclass(frozen=True)
class Run:
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture(scope="module")
def runs():
    """Every command of RUNS in ONE child process (a process start and torch import each would cost
    ~2.5 CPU-s): each run's output and exit code, whether any run imported Ray, and the result files
    before and after all of them."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("TRITON_INTERPRET", None)
    before = set(RESULTS.iterdir()) if RESULTS.exists() else set()
    result = subprocess.run([sys.executable, "-c", CLI, json.dumps(list(RUNS.values()))], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=480)
    after = set(RESULTS.iterdir()) if RESULTS.exists() else set()
    assert result.returncode == 0, result.stderr
    (outs, codes, last), (errs, _, _) = split_runs(result.stdout), split_runs(result.stderr)
    assert len(outs) == len(errs) == len(RUNS), result.stdout + result.stderr
    by_name = {name: Run(code, out, err) for name, code, out, err in zip(RUNS, codes, outs, errs, strict=True)}
    return by_name, last.strip(), (before, after)


def test_no_run_imports_ray_and_none_writes_results(runs):
    _, last_line, (before, after) = runs
    assert last_line == "ray not imported"
    assert after == before


@pytest.mark.skipif(torch.cuda.is_available(), reason="measures for real when a GPU is present")
@pytest.mark.parametrize("name", ["kernels", "kernel-streams"])
def test_without_cuda_it_measures_nothing_and_exits_0(runs, name):
    result = runs[0][f"quick {name}"]
    assert result.returncode == 0, result.stderr
    assert "no CUDA device: nothing measured" in result.stdout


def test_dry_run_times_every_implementation_and_writes_nothing(runs):
    result = runs[0]["dry kernels"]
    assert result.returncode == 0, result.stderr
    assert "dry run: no results written" in result.stdout
    rows = [line for line in result.stdout.splitlines() if line.startswith("| phase")]
    assert len(rows) == 14  # 3 shapes x (phase1, phase2) x (fwd, fwd+bwd), and the fused MSAR stream kernel's 2
    streams = [row for row in rows if row.startswith("| phase1_streams | dry-run msar |")]
    assert [row.split("|")[8].strip() for row in streams] == ["fwd", "fwd+bwd"]
    assert not any("error" in row or "skipped" in row for row in rows), rows
    _, _, (before, after) = runs
    assert after == before


def test_kernel_streams_dry_run_times_only_the_stream_kernel(runs):
    result = runs[0]["dry kernel-streams"]
    assert result.returncode == 0, result.stderr
    rows = [line for line in result.stdout.splitlines() if line.startswith("| phase")]
    assert [row.split("|")[1].strip() for row in rows] == ["phase1_streams", "phase1_streams"]
    assert not any("error" in row or "skipped" in row for row in rows), rows
    assert "dry run: no results written" in result.stdout
