"""The chaos suite in CI (`attnres-lab chaos`, attnres_lab/chaos.py): 25 seeded trials of faults as
users meet them under the local launcher, each a real two-rank-process training run, and every one
clean: the expected exit and one line, the right recovery (a restart, or `--resume` to the
undisturbed run's losses), no hang, no misleading line, no traceback, no leftover process, folder
or /dev/shm file, no checkpoint lost.

The trials run in this process (train's main, its ranks forked from the fork server that keeps
torch imported); only the trials that SIGKILL the driver start a driver process (a fork of this
one set up as a fresh driver, `chaos_run.ForkedDriver`, with its own fork server). The kinds are
weighted towards the cheap in-process ones; every kind runs at least once (five tests of five). It holds what the
single-fault tests it replaced asserted: SIGTERM to the driver stops the run within 15 s with
exit 143 and the one line "terminated (SIGTERM): stopping the workers", its ranks end and no
rendezvous folder is left; a SIGKILLed driver's ranks end within 5 s without a traceback and leave
no rendezvous folder; a full disk during a rank's save (a real tmpfs, root) is one exact
`error:` line (the checkpoint, the filesystem, the fix, the last complete checkpoint and the
command that resumes it), exit 2, each step trained once (no restart), no half-written checkpoint
left, and the last checkpoint resumes to the undisturbed losses.

A frozen rank and a rank lost at start-up come from train.faults' rehearsal hooks
(tests/distributed/test_hung_rank.py and test_start_loss.py deliver them by outside signals too)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest

from attnres_lab.chaos import run_trials, tally
from attnres_lab.chaos_probe import (
    descendants,
    end_processes,
    fork_server_pid,
    output_to,
    parents,
    restart_fork_server,
)
from attnres_lab.chaos_run import Session
from attnres_lab.chaos_trials import KINDS

# One worker runs the five tests in turn: they share the session (its fork server, its reference run).
pytestmark = [pytest.mark.distributed, pytest.mark.subprocess, pytest.mark.xdist_group("chaos")]

PARTS = 5
TRIALS_PER_PART = 5
# The 25 trials in turn, 5 a test (each well within pytest's 300 s on a loaded machine): the cheap
# in-process kinds several times each (another rank, step or save), the driver-killing ones (a fresh
# interpreter each) once. Part p's ranks and steps are drawn from seed p (`chaos_trials.plan`); no
# two trials are the same (kind, rank, step) but #18, sigterm at step 6 as #8 (the rank is not
# drawn into a signal to the driver). The last part was chosen so: its seed draws a step or a rank
# that parts 0-3 do not have for each of its kinds.
WEIGHTED = ["kill-rank", "sigterm", "full-disk-log", "kill-in-save", "sigkill-driver",
            "torn-log", "full-disk-save", "freeze-rank", "sigterm", "kill-in-save",
            "full-disk-log", "kill-rank", "torn-log", "kill-driver-in-save", "sigterm",
            "kill-in-save", "full-disk-save", "kill-rank", "sigterm", "full-disk-log",
            "full-disk-log", "torn-log", "torn-log", "lose-at-start", "kill-in-save"]


def kinds_of(part: int) -> list[str]:
    """Part `part`'s kinds: its share of the weighted list, no tmpfs where this is not root (a
    kill-rank in its place)."""
    kinds = list(WEIGHTED)
    if os.geteuid() != 0:
        kinds = [kind if kind != "full-disk-save" else "kill-rank" for kind in kinds]
    return kinds[part * TRIALS_PER_PART:(part + 1) * TRIALS_PER_PART]


@pytest.fixture(scope="module")
def session():
    """One session for the five tests: a short folder (the fork server's socket and the runs'
    rendezvous folders live below it), the undisturbed run's losses, and one fork server whose
    stdout and stderr are the session's log, started by the first test and stopped at the end."""
    path = Path(tempfile.mkdtemp(prefix="chaos-", dir="/tmp"))
    held = Session(path, lambda line: None)
    held.server = None
    yield held
    restart_fork_server()
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("part", range(PARTS))
def test_chaos_trials_are_all_clean(part, session):
    lines: list[str] = []
    if session.server is None or session.server != fork_server_pid():
        restart_fork_server()  # stopped: the first rank start below makes one that writes to the log
    with output_to(session.log, fresh_server=False):
        outcomes = run_trials(TRIALS_PER_PART, part, ["local"], kinds_of(part), lines.append, session.work,
                              session=session, start=part * TRIALS_PER_PART)
        session.server = fork_server_pid()
    counts = tally(outcomes)
    assert counts == {"trials": TRIALS_PER_PART, "clean": TRIALS_PER_PART, "hangs": 0, "misleading": 0,
                      "tracebacks": 0, "leaks": 0, "checkpoints lost": 0}, "\n".join(lines)
    assert [o.trial.kind for o in outcomes] == kinds_of(part)


def test_the_ci_trials_cover_every_kind():
    """Every kind runs in CI (a full disk on a tmpfs only as root)."""
    kinds = {kind for part in range(PARTS) for kind in kinds_of(part)}
    assert kinds == set(KINDS) - ({"full-disk-save"} if os.geteuid() != 0 else set())


def _below(pid: int) -> set[int]:
    """The processes below `pid` by the parent of every process in /proc (what `descendants` walks
    down to from `pid` alone)."""
    table = parents()
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in table.items() if parent in frontier} - found
        found |= frontier
    return found


def test_descendants_walked_down_are_every_process_below():
    """The watchers' `descendants` (each thread's /proc children list) finds what a scan of every
    process finds: grandchildren, and a child started from a thread other than the main one."""
    tree = subprocess.Popen(["sh", "-c", "sleep 30 & sleep 30 & wait"])
    threaded: list[subprocess.Popen] = []
    thread = threading.Thread(target=lambda: threaded.append(subprocess.Popen(["sleep", "30"])))
    thread.start()
    thread.join(10)
    try:
        deadline = time.monotonic() + 10
        while len(descendants(tree.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(descendants(tree.pid)) == 2 and descendants(tree.pid) == _below(tree.pid)
        mine = descendants(os.getpid())
        assert {tree.pid, threaded[0].pid} | descendants(tree.pid) <= mine
        assert mine == _below(os.getpid())  # this process's others: a fork server, long-lived
    finally:
        for proc in (tree, *threaded):
            end_processes({*descendants(proc.pid), proc.pid})
            proc.wait(10)
