"""A frozen rank under the local launcher (launch/process_rank_group.py): its heartbeat stops, the
driver names it in one line, kills it and restarts the ranks from the last checkpoint, and the run
ends with the undisturbed run's losses; with no restart left, one `error:` line and exit 1. Frozen by
the rehearsal hook (ATTNRES_PP_FREEZE_RANK) and by a real SIGSTOP from outside; nothing of the run
outlives it. Real `attnres-pp train` processes with a short --timeout (the hung rank is found after
max(5 s, --timeout / 2))."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from attnres_lab.chaos_probe import children
from attnres_pp.cli import main
from tests.run_helpers import REPO, assert_same_losses, losses, summary

pytestmark = [pytest.mark.distributed, pytest.mark.subprocess]

TINY = ["--layers", "4", "--d-model", "32", "--heads", "2", "--seq-len", "16", "--batch-size", "4",
        "--microbatches", "2", "--eval-every", "3", "--stages", "2"]
RUN = [*TINY, "--launcher", "local", "--checkpoint-every", "1", "--timeout", "6"]


@pytest.fixture
def short_tmp():
    """A TMPDIR of this test's own, short (the fork server's Unix socket lives in it)."""
    tmp = Path(tempfile.mkdtemp(prefix="hung-", dir="/tmp"))
    yield tmp
    shutil.rmtree(tmp, ignore_errors=True)


def undisturbed(tmp_path: Path, steps: int) -> list[float]:
    """The losses of the same run on thread ranks, in this process (the same steps, and fast)."""
    assert main(["train", *TINY, "--steps", str(steps), "--launcher", "inprocess", "--quiet",
                 "--out", str(tmp_path / "plain")]) == 0
    return losses(tmp_path / "plain")


def start(argv: list[str], out: Path, tmp: Path, **env: str) -> subprocess.Popen:
    """`attnres-pp train argv --out out` with `env` added, stdout piped, stderr into tmp/stderr.txt."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    with open(tmp / "stderr.txt", "w") as stderr:
        return subprocess.Popen([sys.executable, "-m", "attnres_pp.cli", "train", *argv, "--out", str(out)], cwd=REPO,
                                stdout=subprocess.PIPE, stderr=stderr, text=True,
                                env={**os.environ, "PYTHONPATH": path, "TMPDIR": str(tmp), "OMP_NUM_THREADS": "1",
                                     **env})


def finish(proc: subprocess.Popen, tmp: Path, timeout_s: float = 240) -> tuple[int, list[str], str]:
    """(exit code, stdout lines, stderr) of a finished run."""
    out, _ = proc.communicate(timeout=timeout_s)
    return proc.returncode, out.splitlines(), (tmp / "stderr.txt").read_text()


def _stat(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def rank_pids(driver: int) -> list[int]:
    """The driver's rank processes (children of its fork server), oldest first: rank 0, rank 1.
    Walked down from the driver (the watcher asks every 50 ms; a scan of all of /proc costs ms)."""
    started = {}
    for server in children(driver):
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
    """Collects, on a thread, every rank pid of the run `proc` until it ends (`seen`); `wait(until)`
    returns the rank pids of the moment `until(pids)` first holds."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc, self.seen, self.now = proc, set(), []
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        while self.proc.poll() is None:
            self.now = rank_pids(self.proc.pid)
            self.seen |= set(self.now)
            time.sleep(0.05)

    def wait(self, until, timeout_s: float = 120.0) -> list[int]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            pids = list(self.now)
            if until(pids):
                return pids
            time.sleep(0.02)
        raise AssertionError(f"the run ended or took over {timeout_s} s before its ranks could be caught")


def test_a_frozen_rank_is_killed_and_restarted_from_the_last_checkpoint(tmp_path, short_tmp):
    """Rank 1 SIGSTOPs itself at the start of step 2 (the hook): one line names it and the restart from
    checkpoint step 1, the run ends like the undisturbed one, and the frozen process is gone."""
    want = undisturbed(tmp_path, 3)
    proc = start([*RUN, "--steps", "3"], tmp_path / "run", short_tmp, ATTNRES_PP_FREEZE_RANK="1:2")
    watcher = RankWatcher(proc)
    code, out, err = finish(proc, short_tmp)
    assert code == 0, err
    notices = [line for line in out if "stopped answering" in line]
    assert len(notices) == 1 and re.fullmatch(
        r"rank 1 stopped answering at step 2/3 \(no heartbeat for \d+ s: its process is frozen or hung; killed it\); "
        r"restarting from checkpoint step 1 \(restart 1/3\)", notices[0]), out
    assert err == "", err
    assert_same_losses(losses(tmp_path / "run"), want)
    assert summary(tmp_path / "run")["restarts"] == 1
    watcher.thread.join(timeout=5)
    assert len(watcher.seen) == 4, watcher.seen  # two ranks, then two fresh ones
    assert_all_ended(watcher.seen)


def test_a_rank_stopped_from_outside_with_no_restart_left_is_one_error_line(tmp_path, short_tmp):
    """A real SIGSTOP sent to rank 1 mid-run, with --max-restarts 0: exit 1, one `error:` line naming
    rank 1 as hung, no traceback, every rank process ended (the stopped one killed)."""
    proc = start([*TINY, "--launcher", "local", "--timeout", "6", "--steps", "100000", "--eval-every", "0",
                  "--max-restarts", "0", "--no-final-checkpoint", "--quiet"], tmp_path / "run", short_tmp)
    metrics, watcher = tmp_path / "run" / "metrics.jsonl", RankWatcher(proc)
    pids = watcher.wait(lambda pids: len(pids) == 2 and metrics.is_file() and metrics.read_text().count("\n") >= 2)
    began = time.monotonic()
    os.kill(pids[1], signal.SIGSTOP)
    code, out, err = finish(proc, short_tmp)
    took = time.monotonic() - began
    assert code == 1, err
    assert re.fullmatch(r"error: rank 1 stopped answering at step \d+/100000 \(no heartbeat for \d+ s: its process "
                        r"is frozen or hung; killed it\) after 0 restart\(s\), the limit set by --max-restarts\n",
                        err), err
    assert 5 <= took < 30, took  # found after max(5 s, --timeout / 2), then the ranks stopped
    assert_all_ended(set(pids))
