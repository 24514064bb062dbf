"""scripts/gpu_check.sh on a machine without CUDA says so and exits non-zero, running nothing."""

import subprocess
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.sh"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the check would really run")
def test_gpu_check_without_cuda_refuses(tmp_path):
    result = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert result.returncode == 3
    assert "no CUDA device is visible" in result.stderr and "nothing was run" in result.stderr
    assert not (tmp_path / "out" / "summary.md").exists()


def test_gpu_check_needs_an_output_dir():
    result = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "usage: scripts/gpu_check.sh OUT_DIR" in result.stderr
