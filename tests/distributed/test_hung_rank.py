"""A frozen rank under the local launcher (launch/process_rank_group.py): its heartbeat stops, the
driver names it in one line, kills it and restarts the ranks from the last checkpoint, and the run
ends with the undisturbed run's losses; with no restart left, one `error:` line and exit 1. Frozen by
the rehearsal hook (ATTNRES_PP_FREEZE_RANK) and by a real SIGSTOP from outside; nothing of the run
outlives it. `attnres-pp train` with a short --timeout (the hung rank is found after max(5 s,
--timeout / 2)) called in this process, as test_start_loss.py's: its ranks are real processes, forked
from this process's fork server, so no interpreter has to start for the driver. What the ranks print
goes to the fork server's output; that a frozen rank's run prints nothing else, no traceback, is
test_chaos.py's `freeze-rank` trial (the same hook, its ranks' output read)."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest

from attnres_lab.chaos_probe import children, fork_server_pid
from attnres_pp.cli import main
from attnres_pp.launch.rank_group import HEARTBEAT_S, hung_after_s
from tests.run_helpers import assert_same_losses, losses, summary

pytestmark = pytest.mark.distributed

TINY = ["--layers", "4", "--d-model", "32", "--heads", "2", "--seq-len", "16", "--batch-size", "4",
        "--microbatches", "2", "--eval-every", "3", "--stages", "2"]
RUN = [*TINY, "--launcher", "local", "--checkpoint-every", "1", "--timeout", "6"]


def undisturbed(tmp_path: Path, steps: int) -> list[float]:
    """The losses of the same run on thread ranks, in this process (the same steps, and fast)."""
    assert main(["train", *TINY, "--steps", str(steps), "--launcher", "inprocess", "--quiet",
                 "--out", str(tmp_path / "plain")]) == 0
    return losses(tmp_path / "plain")


def _stat(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def rank_pids(driver: int | None = None) -> list[int]:
    """The driver's rank processes (children of its fork server), oldest first: rank 0, rank 1.
    Walked down from the driver (the watcher asks every 50 ms; a scan of all of /proc costs ms);
    without one, from this process's own fork server (not another child's children: Ray's workers)."""
    started = {}
    servers = children(driver) if driver is not None else [pid for pid in [fork_server_pid()] if pid]
    for server in servers:
        for pid in children(server):
            try:
                started[pid] = int(_stat(pid)[19])
            except (OSError, IndexError, ValueError):  # gone meanwhile
                continue
    return sorted(started, key=started.get)


def alive(pid: int) -> bool:
    try:
        return _stat(pid)[0] != "Z"
    except (OSError, IndexError):
        return False


def assert_all_ended(pids: set[int], timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in pids if alive(pid)], "rank processes outlived the run"


class RankWatcher:
    """Collects, on a thread, every rank process of the run this process drives (children of its fork
    server that were not there before) until `stop()` (`seen`); `wait(until)` returns the rank pids
    of the moment `until(pids)` first holds."""

    def __init__(self) -> None:
        self.before = set(rank_pids())
        self.seen, self.now = set(), []
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        while not self._stop.is_set():
            self.now = [pid for pid in rank_pids() if pid not in self.before]
            self.seen |= set(self.now)
            self._stop.wait(0.05)

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(timeout=5)

    def wait(self, until, timeout_s: float = 120.0) -> list[int]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not self._stop.is_set():
            pids = list(self.now)
            if until(pids):
                return pids
            time.sleep(0.02)
        raise AssertionError(f"the run ended or took over {timeout_s} s before its ranks could be caught")


def test_a_frozen_rank_is_killed_and_restarted_from_the_last_checkpoint(tmp_path, capsys, monkeypatch):
    """Rank 1 SIGSTOPs itself at the start of step 2 (the hook): one line names it and the restart from
    checkpoint step 1, the run ends like the undisturbed one, and the frozen process is gone."""
    want = undisturbed(tmp_path, 3)
    capsys.readouterr()
    monkeypatch.setenv("ATTNRES_PP_FREEZE_RANK", "1:2")
    watcher = RankWatcher()
    try:
        code = main(["train", *RUN, "--steps", "3", "--out", str(tmp_path / "run")])
    finally:
        watcher.stop()
    captured = capsys.readouterr()
    assert code == 0, captured.err
    notices = [line for line in captured.out.splitlines() if "stopped answering" in line]
    assert len(notices) == 1 and re.fullmatch(
        r"rank 1 stopped answering at step 2/3 \(no heartbeat for \d+ s: its process is frozen or hung; killed it\); "
        r"restarting from checkpoint step 1 \(restart 1/3\)", notices[0]), captured.out
    assert captured.err == "", captured.err
    assert_same_losses(losses(tmp_path / "run"), want)
    assert summary(tmp_path / "run")["restarts"] == 1
    assert len(watcher.seen) == 4, watcher.seen  # two ranks, then two fresh ones
    assert_all_ended(watcher.seen)


def test_a_rank_stopped_from_outside_with_no_restart_left_is_one_error_line(tmp_path, capsys):
    """A real SIGSTOP sent to rank 1 mid-run, with --max-restarts 0: exit 1, one `error:` line naming
    rank 1 as hung, no traceback, every rank process ended (the stopped one killed)."""
    metrics, watcher = tmp_path / "run" / "metrics.jsonl", RankWatcher()
    stopped: dict = {}
    returned = threading.Event()

    def stop_rank_1() -> None:
        """SIGSTOP rank 1 after two steps; a run that then goes on (or whose ranks were not caught)
        is stopped by SIGTERM to this process, which main turns into the end of its run."""
        try:
            pids = watcher.wait(lambda pids: len(pids) == 2 and metrics.is_file()
                                and metrics.read_text().count("\n") >= 2)
            stopped.update(pids=pids, at=time.monotonic())
            os.kill(pids[1], signal.SIGSTOP)
        except AssertionError as error:
            stopped["error"] = str(error)
        if not returned.wait(120):
            os.kill(os.getpid(), signal.SIGTERM)

    stopper = threading.Thread(target=stop_rank_1, daemon=True)
    stopper.start()
    try:
        code = main(["train", *TINY, "--launcher", "local", "--timeout", "6", "--steps", "100000", "--eval-every", "0",
                     "--max-restarts", "0", "--no-final-checkpoint", "--quiet", "--out", str(tmp_path / "run")])
        ended = time.monotonic()
    finally:
        returned.set()
        watcher.stop()
        stopper.join(timeout=10)
    err = capsys.readouterr().err
    assert "pids" in stopped, stopped.get("error")
    assert code == 1, err
    assert re.fullmatch(r"error: rank 1 stopped answering at step \d+/100000 \(no heartbeat for \d+ s: its process "
                        r"is frozen or hung; killed it\) after 0 restart\(s\), the limit set by --max-restarts\n",
                        err), err
    # Found after hung_after_s(6) = 5 s without a heartbeat (the last one came up to HEARTBEAT_S before
    # the stop), then the ranks stopped.
    took = ended - stopped["at"]
    assert hung_after_s(6) - HEARTBEAT_S <= took < 30, took
    assert_all_ended(set(stopped["pids"]))
