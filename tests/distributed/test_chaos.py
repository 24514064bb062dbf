"""The chaos suite in CI (`attnres-lab chaos`, attnres_lab/chaos.py): 30 seeded trials of faults as
users meet them under the local launcher, each a real two-rank-process training run, and every one
clean: the expected exit and one line, the right recovery (a restart, or `--resume` to the
undisturbed run's losses), no hang, no misleading line, no traceback, no leftover process, folder
or /dev/shm file, no checkpoint lost.

The trials run in this process (train's main, its ranks forked from the fork server that keeps
torch imported); only the trials that SIGKILL the driver start a driver process. The kinds are
weighted towards the cheap in-process ones; every kind runs at least once (six tests of five). It holds what the
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
import tempfile
from pathlib import Path

import pytest

from attnres_lab.chaos import run_trials, tally
from attnres_lab.chaos_probe import fork_server_pid, output_to, restart_fork_server
from attnres_lab.chaos_run import Session
from attnres_lab.chaos_trials import KINDS

# One worker runs the six tests in turn: they share the session (its fork server, its reference run).
pytestmark = [pytest.mark.distributed, pytest.mark.subprocess, pytest.mark.xdist_group("chaos")]

PARTS = 6
TRIALS_PER_PART = 5
# The 30 trials in turn, 5 a test (each well within pytest's 300 s on a loaded machine): the cheap
# in-process kinds several times each, the driver-killing ones (a fresh interpreter each) once.
WEIGHTED = ["kill-rank", "sigterm", "full-disk-log", "kill-in-save", "sigkill-driver",
            "torn-log", "full-disk-save", "freeze-rank", "sigterm", "kill-in-save",
            "full-disk-log", "kill-rank", "torn-log", "kill-driver-in-save", "sigterm",
            "kill-in-save", "full-disk-save", "kill-rank", "sigterm", "full-disk-log",
            "kill-rank", "torn-log", "kill-in-save", "full-disk-save", "sigterm",
            "full-disk-log", "lose-at-start", "kill-in-save", "torn-log", "kill-rank"]


def kinds_of(part: int) -> list[str]:
    """Part `part`'s kinds: its share of the weighted list, no tmpfs where this is not root (a
    kill-rank in its place)."""
    kinds = list(WEIGHTED)
    if os.geteuid() != 0:
        kinds = [kind if kind != "full-disk-save" else "kill-rank" for kind in kinds]
    return kinds[part * TRIALS_PER_PART:(part + 1) * TRIALS_PER_PART]


@pytest.fixture(scope="module")
def session():
    """One session for the six tests: a short folder (the fork server's socket and the runs'
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
