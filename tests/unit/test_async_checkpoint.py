"""`--async-checkpoint`: each rank writes its shard in the background (DCP's async_save) while
training goes on. A checkpoint holds the state of the step it was begun at, although the
optimizer changes the parameters during the write; at most one save is in flight; a crash while a
background write runs leaves the previous checkpoint the newest complete one, and resuming ends
with the uninterrupted run's losses."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from attnres_pp.cli import main
from attnres_pp.train import background_save
from attnres_pp.train.background_save import BackgroundSave
from attnres_pp.train.checkpoint import latest_checkpoint, read_meta
from attnres_pp.train.faults import KILL_DURING_CHECKPOINT
from attnres_pp.train.shards import read_parameters
from tests.run_helpers import assert_same_losses, losses, metrics, summary

from .forked_cli import run_forked
from .test_crash_consistent_saves import RANKS, SINGLE

TINY = ["--layers", "2", "--d-model", "16", "--heads", "2", "--seq-len", "16", "--batch-size", "4",
        "--microbatches", "2", "--eval-every", "0", "--steps", "6", "--checkpoint-every", "2", "--max-restarts", "0",
        "--keep-checkpoints", "0", "--quiet"]
THREADS = ["--launcher", "inprocess", "--stages", "2", "--virtual", "1"]  # two thread ranks, rank 0 writes


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The same run with blocking saves, in this process."""
    out = tmp_path_factory.mktemp("blocking") / "run"
    assert main(["train", *SINGLE, *TINY, "--out", str(out)]) == 0
    return out


def same_parameters(run_dir: Path, reference: Path, step: int, exact: bool) -> None:
    got = read_parameters(run_dir / "checkpoints" / f"step_{step}")
    want = read_parameters(reference / "checkpoints" / f"step_{step}")
    assert got.keys() == want.keys()
    for name in want:
        if exact:
            assert torch.equal(got[name], want[name]), (step, name)
        else:  # another split rounds differently
            assert torch.allclose(got[name], want[name], rtol=1e-4, atol=1e-6), (step, name)


@pytest.mark.parametrize("split", [SINGLE, THREADS], ids=["one-process", "thread-ranks"])
def test_background_saves_hold_their_steps_state(tmp_path, reference, split):
    run = tmp_path / "run"
    assert main(["train", *split, *TINY, "--async-checkpoint", "--out", str(run)]) == 0
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_2", "step_4", "step_6"]
    for step in (2, 4, 6):  # the state at the save's step, not the later one the write ran beside
        same_parameters(run, reference, step, exact=split is SINGLE)
    assert read_meta(run / "checkpoints" / "step_4")["checkpointing"]["async_save"] is True
    assert read_meta(run / "checkpoints" / "step_4")["losses"] == losses(run)[:4]
    # The steps right after a save began ran beside its write; the first two steps saw no save.
    in_flight = [r["step"] for r in metrics(run) if r.get("checkpoint_in_flight")]
    assert in_flight[:1] == [2] and 0 not in in_flight and 1 not in in_flight
    assert_same_losses(losses(run), losses(reference))


@pytest.mark.distributed
def test_rank_processes_save_in_the_background_and_a_rank_killed_during_a_write_keeps_the_previous_one(
        tmp_path, reference):
    """Four rank processes, parameters and optimizer state sharded by FSDP2 (DTensors), each
    replica's ranks writing their shards together over the gloo group made for the saves. Rank 1
    dies right after its background write of step_4 finished, while step 5 trains: the run stops,
    step_4 was never committed, and the resume (background saves again) ends as the uninterrupted
    run. One run for both: the crash needs a background write in flight, which the sharded one is.
    The resume runs on thread ranks, replicated (FSDP2 needs processes): the crash needed the
    processes, the numbers do not; step_2 is the rank processes' sharded background write, checked
    here; resumes into fsdp rank processes: tests/distributed/test_fsdp.py (another split) and
    test_expert_fsdp_save.py (the same layout)."""
    run = tmp_path / "run"
    crashed = run_forked([*RANKS, "--data-parallel", "2", "--dp-shard", "fsdp", *TINY, "--async-checkpoint",
                          "--out", str(run)], **{KILL_DURING_CHECKPOINT: "4:after-shard:1"})  # a forked driver
    assert crashed.returncode == 1, crashed.stderr
    assert "rank 1 lost at step" in crashed.stderr, crashed.stderr
    root = run / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step_2", "step_4.tmp"]
    assert not (root / "step_4.tmp" / "meta.json").exists()
    assert latest_checkpoint(run) == root / "step_2"
    same_parameters(run, reference, 2, exact=False)
    assert main(["train", "--resume", str(run), "--launcher", "inprocess", "--dp-shard", "replicate", "--quiet"]) == 0
    assert summary(run)["config"]["pipeline"]["launcher"] == "inprocess"
    assert sorted(p.name for p in root.iterdir()) == ["step_2", "step_4", "step_6"]
    assert read_meta(root / "step_4")["checkpointing"]["async_save"] is True
    for step in (4, 6):  # the background writes of the resumed ranks
        same_parameters(run, reference, step, exact=False)
    assert_same_losses(losses(run), losses(reference))


@pytest.mark.subprocess
def test_the_driver_killed_before_committing_a_background_save_keeps_the_previous_one(tmp_path, reference):
    run = tmp_path / "run"
    crashed = run_forked([*SINGLE, *TINY, "--async-checkpoint", "--out", str(run)],
                         **{KILL_DURING_CHECKPOINT: "4:before-meta"})  # one process: a fork of this one
    assert crashed.returncode < 0, crashed.stderr  # SIGKILL
    root = run / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step_2", "step_4.tmp"]
    assert list((root / "step_4.tmp").glob("*.distcp")), "the background write had finished"
    assert main(["train", "--resume", str(run), "--quiet"]) == 0
    assert_same_losses(losses(run), losses(reference))


class _SlowWriter(background_save.FileSystemWriter):
    """A filesystem that takes `delay_s` to write each rank's data."""

    delay_s = 0.0
    started: list[float] = []

    def write_data(self, plan, planner):
        type(self).started.append(time.perf_counter())
        time.sleep(self.delay_s)
        return super().write_data(plan, planner)


def _state() -> dict:
    return {"w": torch.arange(6.0)}


def test_one_write_in_flight_the_next_waits_for_it(tmp_path, monkeypatch):
    monkeypatch.setattr(background_save, "FileSystemWriter", _SlowWriter)
    monkeypatch.setattr(_SlowWriter, "delay_s", 0.5)
    monkeypatch.setattr(_SlowWriter, "started", [])
    saver = BackgroundSave(timeout_s=30)
    state = _state()
    saver.begin(tmp_path / "a", state, distributed=False)
    state["w"].add_(100)  # the write holds DCP's copy, made before begin returned
    assert not saver.written()
    first = saver._future
    blocked_s = saver.begin(tmp_path / "b", state, distributed=False)
    assert first.done() and blocked_s >= 0.3  # the second waited for the first's write
    saver.wait()
    assert saver.written()
    torch_a = read_parameters_free(tmp_path / "a")
    assert torch.equal(torch_a["w"], torch.arange(6.0))
    assert torch.equal(read_parameters_free(tmp_path / "b")["w"], torch.arange(6.0) + 100)


def read_parameters_free(folder: Path) -> dict:
    """A plain DCP load of a one-tensor folder (no model config beside it)."""
    import torch.distributed.checkpoint as dcp

    state = {"w": torch.empty(6)}
    dcp.load(state, checkpoint_id=str(folder), no_dist=True)
    return state


def test_a_write_that_outlasts_the_timeout_is_one_error_naming_the_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(background_save, "FileSystemWriter", _SlowWriter)
    monkeypatch.setattr(_SlowWriter, "delay_s", 1.0)
    saver = BackgroundSave(timeout_s=0.1)
    saver.begin(tmp_path / "slow", _state(), distributed=False)
    with pytest.raises(RuntimeError, match=r"background checkpoint write into .*slow did not finish within 0 s"):
        saver.wait()
    assert saver.written()  # nothing in flight is tracked any more; the thread ends on its own
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join(timeout=5)


def test_a_failed_write_is_one_error_naming_the_folder(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    saver = BackgroundSave(timeout_s=30)
    with pytest.raises(RuntimeError, match=r"background checkpoint write into .*file/step failed: rank 0: "
                                           r"NotADirectoryError: \[Errno 20\] Not a directory") as raised:
        saver.begin(blocker / "step", _state(), distributed=False)
        saver.wait()
    assert "\n" not in str(raised.value)
    assert saver.written()
