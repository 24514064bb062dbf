"""The kernel benchmark's paths that run without a GPU: the no-device exit and the interpreter dry
run of the whole timing code, the fused MSAR stream kernel's rows included (which must not write
result files)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.subprocess

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "bench_kernels.py"


def _run(*flags):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *flags], cwd=REPO, env=env, capture_output=True, text=True, timeout=240
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="measures for real when a GPU is present")
def test_without_cuda_it_measures_nothing_and_exits_0():
    result = _run()
    assert result.returncode == 0, result.stderr
    assert "no CUDA device: nothing measured" in result.stdout


def test_dry_run_times_every_implementation_and_writes_nothing():
    results = REPO / "benchmarks" / "results"
    before = set(results.iterdir()) if results.exists() else set()
    result = _run("--dry-run-cpu")
    assert result.returncode == 0, result.stderr
    assert "dry run: no results written" in result.stdout
    rows = [line for line in result.stdout.splitlines() if line.startswith("| phase")]
    assert len(rows) == 14  # 3 shapes x (phase1, phase2) x (fwd, fwd+bwd), and the fused MSAR stream kernel's 2
    streams = [row for row in rows if row.startswith("| phase1_streams | dry-run msar |")]
    assert [row.split("|")[8].strip() for row in streams] == ["fwd", "fwd+bwd"]
    assert not any("error" in row or "skipped" in row for row in rows), rows
    after = set(results.iterdir()) if results.exists() else set()
    assert after == before
