"""Crash-consistent saves: a run with --checkpoint-every 2 is SIGKILLed at each of the five kill
points of the save of step_4 (ATTNRES_PP_KILL_DURING_CHECKPOINT=4:POINT, the driver or, for
`after-shard`, rank 1 of a two-process run), which leaves step_2 the newest complete checkpoint;
`train --resume` removes what the crash left and ends with the uninterrupted run's losses. A crash
between the two renames of a save that replaces a complete step_N leaves it as step_N.old, which
`latest_checkpoint` finds and resuming renames back. The crashed runs' drivers are forks of the test's
process (`forked_cli.run_forked`)."""

from __future__ import annotations

import shutil
import signal
from pathlib import Path

import pytest
import torch

from attnres_pp.cli import main
from attnres_pp.train.checkpoint import latest_checkpoint, restore_replaced_checkpoints
from attnres_pp.train.faults import KILL_DURING_CHECKPOINT, KILL_POINTS, KillPoint, kill_point
from attnres_pp.train.shards import read_parameters
from tests.run_helpers import assert_same_losses, losses

from .forked_cli import run_forked

TINY = ["--layers", "2", "--d-model", "16", "--heads", "2", "--seq-len", "16", "--batch-size", "4",
        "--microbatches", "2", "--eval-every", "0", "--steps", "4", "--checkpoint-every", "2", "--max-restarts", "0",
        "--quiet"]
SINGLE = ["--launcher", "local", "--stages", "1", "--virtual", "1"]  # the driver is the one rank
RANKS = ["--launcher", "local", "--stages", "2", "--virtual", "1"]  # two rank processes


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The uninterrupted run, in this process (its losses are every case's target)."""
    out = tmp_path_factory.mktemp("reference") / "run"
    assert main(["train", *SINGLE, *TINY, "--keep-checkpoints", "0", "--out", str(out)]) == 0
    return out


def _no_meta(folder: Path) -> bool:
    return folder.is_dir() and not (folder / "meta.json").exists()


# (kill value, split, exit code, what checkpoints/ holds after the crash, a check of step_4.tmp)
CASES = [
    pytest.param("4:before-shards", SINGLE, -signal.SIGKILL, ["step_2", "step_4.tmp"],
                 lambda tmp: _no_meta(tmp) and not list(tmp.glob("*.distcp")),
                 id="before-shards", marks=pytest.mark.subprocess),
    pytest.param("4:after-shard:1", RANKS, 1, ["step_2", "step_4.tmp"],
                 lambda tmp: _no_meta(tmp) and (tmp / ".metadata").is_file(),
                 id="after-shard-rank-1", marks=pytest.mark.distributed),
    pytest.param("4:before-meta", SINGLE, -signal.SIGKILL, ["step_2", "step_4.tmp"],
                 lambda tmp: _no_meta(tmp) and list(tmp.glob("*.distcp")),
                 id="before-meta", marks=pytest.mark.subprocess),
    pytest.param("4:before-rename", SINGLE, -signal.SIGKILL, ["step_2", "step_4.tmp"],
                 lambda tmp: (tmp / "meta.json").is_file() and (tmp / ".metadata").is_file(),
                 id="before-rename", marks=pytest.mark.subprocess),
    # The save replaces a step_4 that is there already: a folder left without meta.json (not a
    # checkpoint), so the crash leaves it as step_4.old next to the complete step_4.tmp.
    pytest.param("4:between-renames", SINGLE, -signal.SIGKILL, ["step_2", "step_4.old", "step_4.tmp"],
                 lambda tmp: (tmp / "meta.json").is_file() and _no_meta(tmp.parent / "step_4.old"),
                 id="between-renames", marks=pytest.mark.subprocess),
]


@pytest.mark.parametrize(("kill", "split", "code", "left", "staged"), CASES)
def test_a_crash_at_each_kill_point_leaves_step_2_and_resume_ends_as_the_uninterrupted_run(
        tmp_path, reference, kill, split, code, left, staged):
    run = tmp_path / "run"
    root = run / "checkpoints"
    if kill.endswith("between-renames"):
        (root / "step_4").mkdir(parents=True)
        (root / "step_4" / "leftover").write_text("an interrupted copy\n")
    kill_env = {KILL_DURING_CHECKPOINT: kill}
    crashed = run_forked([*split, *TINY, "--out", str(run)], **kill_env)  # the driver: a fork of this process
    assert crashed.returncode == code, crashed.stderr
    if code == 1:
        assert "rank 1 lost at step 4/4" in crashed.stderr, crashed.stderr
    assert sorted(p.name for p in root.iterdir()) == left
    assert staged(root / "step_4.tmp")
    assert latest_checkpoint(run) == root / "step_2"
    # step_2 loads, and holds the uninterrupted run's parameters (up to the float rounding of another split)
    got, want = read_parameters(root / "step_2"), read_parameters(reference / "checkpoints" / "step_2")
    assert got.keys() == want.keys() and all(torch.allclose(got[k], want[k], rtol=1e-4, atol=1e-6) for k in want)

    assert main(["train", "--resume", str(run), "--quiet"]) == 0
    assert sorted(p.name for p in root.iterdir()) == ["step_2", "step_4"]
    assert_same_losses(losses(run), losses(reference), what=kill)


def test_a_complete_old_copy_is_found_and_restored(tmp_path, reference, capsys):
    """A crash between the renames of a save that replaced a complete step_2 leaves step_2.old (the
    old checkpoint) and step_2.tmp (the new one): step_2.old is the run's newest checkpoint, and
    the resume renames it back, drops the .tmp and trains on to the uninterrupted run's losses."""
    root = tmp_path / "run" / "checkpoints"
    root.mkdir(parents=True)
    shutil.copytree(reference / "checkpoints" / "step_2", root / "step_2.old")
    shutil.copytree(reference / "checkpoints" / "step_2", root / "step_2.tmp")
    assert latest_checkpoint(tmp_path / "run") == root / "step_2.old"
    assert main(["train", "--resume", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "restored step_2 from step_2.old" in out and "removed step_2.tmp" in out
    assert sorted(p.name for p in root.iterdir()) == ["step_2", "step_4"]
    assert_same_losses(losses(tmp_path / "run"), losses(reference))


def test_an_old_copy_is_not_restored_over_a_complete_checkpoint_or_when_incomplete(tmp_path, reference):
    root = tmp_path / "checkpoints"
    root.mkdir()
    for name in ("step_2", "step_2.old", "step_4.old"):
        shutil.copytree(reference / "checkpoints" / "step_2", root / name)
    (root / "step_4.old" / "meta.json").unlink()
    assert latest_checkpoint(tmp_path) == root / "step_2"
    assert restore_replaced_checkpoints(tmp_path) == []


def test_the_kill_hook_values(monkeypatch):
    cases = {"4": KillPoint(4, "before-meta"), "2:before-shards": KillPoint(2, "before-shards"),
             "3:after-shard:1": KillPoint(3, "after-shard", 1), "4:between-renames": KillPoint(4, "between-renames")}
    for raw, want in cases.items():
        monkeypatch.setenv(KILL_DURING_CHECKPOINT, raw)
        assert kill_point() == want
    assert set(KILL_POINTS) == {"before-shards", "after-shard", "before-meta", "before-rename", "between-renames"}
    for raw in ("0", "soon", "4:later", "4:after-shard", "4:before-meta:1", "4:after-shard:x", "4:after-shard:1:2"):
        monkeypatch.setenv(KILL_DURING_CHECKPOINT, raw)
        with pytest.raises(ValueError, match=rf"{KILL_DURING_CHECKPOINT}='{raw}' is invalid: set it to .* or unset it"):
            kill_point()
    monkeypatch.delenv(KILL_DURING_CHECKPOINT)
    assert kill_point() is None
