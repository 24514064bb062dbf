"""`TRITON_INTERPRET=1 attnres-pp train --kernels triton --device cpu`: the CLI runs the Triton
kernels under the interpreter (MSAR through the fused stream kernel) and trains to the torch
kernels' losses on a tiny model. The block variant's Triton run is a fresh process, as a user would
start it, with the interpreter variable set before anything imports triton; MSAR's runs `main` in
the test's process (conftest.py set the variable before triton was imported here: the fresh start is
the block run's to check, the stream kernel's training is the same code either way), as do the torch
kernels' references."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attnres_pp.cli import main
from attnres_pp.kernels import dispatch
from tests.pipeline_helpers import TORCH_TWINS
from tests.run_helpers import REPO, assert_same_losses, summary

TINY = ["--layers", "2", "--d-model", "16", "--heads", "2", "--seq-len", "8", "--batch-size", "2",
        "--microbatches", "1", "--steps", "3", "--lr", "0.01", "--eval-every", "0", "--seed", "4", "--quiet",
        "--launcher", "local", "--device", "cpu"]
VARIANTS = {
    "msar": ["--residual", "msar", "--block-size", "2"],  # stream kernels (2,) from the TOML file
    "block": ["--residual", "attnres", "--block-size", "2"],
}


def _refused(name):
    def refused(*args, **kwargs):
        raise AssertionError(f"{name} ran: the torch twin, not the Triton kernel")
    return refused


def _train(tmp_path: Path, variant: str, kernels: str, fresh_process: bool = False) -> dict:
    out = tmp_path / f"{variant}_{kernels}"
    config = tmp_path / "model.toml"
    # One conv stream (two streams): the interpreter's cost grows with the streams, and m = 3 and 4 streams
    # are test_triton_msar_streams.py's to check against the float64 reference.
    config.write_text("[model]\nstream_kernels = [2]\n")
    argv = ["train", "--config", str(config), *TINY, *VARIANTS[variant], "--kernels", kernels, "--out", str(out)]
    if not fresh_process:
        assert main(argv) == 0
        return summary(out)
    console = shutil.which("attnres-pp")
    command = [console] if console else [sys.executable, "-m", "attnres_pp.cli"]
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    result = subprocess.run([*command, *argv], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    return summary(out)


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU, scripts/gpu_check.sh trains with the compiled "
                    "kernels instead (triton_vs_torch_loss)")
@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.subprocess
def test_interpreted_triton_kernels_train_to_the_torch_kernels_losses(tmp_path, variant, kernel_device, monkeypatch):
    torch_run = _train(tmp_path, variant, "torch")
    if variant != "block":  # in this process: the torch twins refuse, so the run completes on the kernels
        for name in TORCH_TWINS:
            monkeypatch.setattr(dispatch, name, _refused(name))
    triton_run = _train(tmp_path, variant, "triton", fresh_process=variant == "block")
    monkeypatch.undo()
    assert triton_run["config"]["train"]["kernels"] == "triton" and triton_run["config"]["train"]["device"] == "cpu"
    assert torch_run["config"]["train"]["kernels"] == "torch"
    if variant == "msar":
        assert triton_run["config"]["model"]["stream_kernels"] == [2]
    want, got = torch_run["losses"], triton_run["losses"]
    assert len(got) == len(want) == 3 and want[-1] < want[0]
    assert_same_losses(got, want)
