"""`--dp-shard fsdp` (FSDP2 over the replicas) over gloo in four processes, D = 2, P = 2, V = 2: the
losses equal the replicated in-process run's (Block AttnRes under a loop schedule, MSAR under ZB-V
with the I/W split, resharding after every forward and selective checkpointing), each rank holds
about half the parameter, gradient and AdamW bytes, and DCP checkpoints move between fsdp and
replicate at another P."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from attnres_pp.cli import main

TINY = ["--layers", "4", "--d-model", "32", "--heads", "2", "--seq-len", "16", "--batch-size", "8", "--microbatches",
        "2", "--eval-every", "0", "--quiet", "--data-parallel", "2"]
D2P2V2 = [*TINY, "--stages", "2", "--virtual", "2"]


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def _state_bytes(entry: dict) -> int:
    return entry["param_bytes"] + entry["grad_bytes"] + entry["optimizer_bytes"]


def _assert_losses(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert abs(g - w) <= 1e-5 * abs(w), (got, want)


# The upper bound of a rank's sharded state over its whole state: MSAR's tied convolutions and gate
# scales stay whole, a larger share of this tiny model than of a real one.
@pytest.mark.parametrize(("model", "schedule", "extra", "at_most"), [
    (["--residual", "attnres", "--block-size", "3"], "interleaved_1f1b", [], 0.51),
    (["--residual", "msar", "--block-size", "3"], "zbv",
     ["--fsdp-reshard-after-forward", "always", "--activation-checkpoint", "selective"], 0.56),
], ids=["block-interleaved", "msar-zbv"])
def test_fsdp_over_gloo_equals_the_replicated_run(tmp_path, model, schedule, extra, at_most):
    layout = [*D2P2V2, *model, "--schedule", schedule, "--steps", "3"]
    assert main(["train", *layout, "--launcher", "inprocess", "--out", str(tmp_path / "replicate")]) == 0
    assert main(["train", *layout, "--launcher", "local", "--dp-shard", "fsdp", *extra,
                 "--out", str(tmp_path / "fsdp")]) == 0
    want, got = _summary(tmp_path / "replicate"), _summary(tmp_path / "fsdp")
    _assert_losses(got["losses"], want["losses"])
    for whole, shard in zip(want["memory_per_rank"], got["memory_per_rank"], strict=True):
        # Half of every sharded tensor (FSDP2 pads dim 0 to a multiple of D).
        assert 0.5 * _state_bytes(whole) <= _state_bytes(shard) <= at_most * _state_bytes(whole)


def test_checkpoints_move_between_fsdp_and_replicate_at_another_split(tmp_path):
    layout = [*D2P2V2, "--residual", "attnres", "--block-size", "3", "--schedule", "interleaved_1f1b", "--steps", "3"]
    assert main(["train", *layout, "--launcher", "inprocess", "--out", str(tmp_path / "whole")]) == 0
    want = _summary(tmp_path / "whole")["losses"]
    for name, first, then in (("from_fsdp", ["--dp-shard", "fsdp"], []), ("to_fsdp", [], ["--dp-shard", "fsdp"])):
        run = tmp_path / name
        # No final checkpoint: the resume continues from step_2 (with step_3 saved it would have nothing to do).
        assert main(["train", *layout, "--launcher", "local", *first, "--checkpoint-every", "2",
                     "--no-final-checkpoint", "--out", str(run)]) == 0
        (run / "summary.json").unlink()
        assert main(["train", "--resume", str(run), "--launcher", "local", "--stages", "1", "--virtual", "1",
                     "--schedule", "1f1b", "--dp-shard", "replicate" if not then else "fsdp", "--quiet"]) == 0
        resumed = _summary(run)
        assert resumed["config"]["pipeline"]["stages"] == 1
        _assert_losses(resumed["losses"], want)
