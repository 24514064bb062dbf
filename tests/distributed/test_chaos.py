"""The chaos suite in CI (`attnres-lab chaos`, attnres_lab/chaos.py): 30 seeded trials of faults as
users meet them under the local launcher, each a real two-rank-process training run, and every one
clean: the expected exit and one line, the right recovery (a restart, or `--resume` to the
undisturbed run's losses), no hang, no misleading line, no traceback, no leftover process, folder
or /dev/shm file, no checkpoint lost.

The trials run in this process (train's main, its ranks forked from the fork server that keeps
torch imported); only the trials that SIGKILL the driver start a driver process. The kinds are
weighted towards the cheap in-process ones; every kind runs at least once. It holds what the
single-fault tests it replaced asserted: SIGTERM to the driver stops the run within 15 s with
exit 143 and the one line "terminated (SIGTERM): stopping the workers", its ranks end and no
rendezvous folder is left; a SIGKILLed driver's ranks end within 5 s without a traceback and leave
no rendezvous folder; a full disk during a rank's save (a real tmpfs, root) is one exact
`error:` line (the checkpoint, the filesystem, the fix, the last complete checkpoint and the
command that resumes it), exit 2, each step trained once (no restart), no half-written checkpoint
left, and the last checkpoint resumes to the undisturbed losses.

The kinds whose fault hooks are not in train.faults yet (a frozen rank, a rank lost at start-up)
join once they are (`hook_env`)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from attnres_lab.chaos import run_trials, tally
from attnres_lab.chaos_trials import HOOKS, hook_env

pytestmark = [pytest.mark.distributed, pytest.mark.subprocess]

PARTS = 3
TRIALS_PER_PART = 10
# In turn; in-process kinds several times, the driver-killing ones (a fresh interpreter each) once.
WEIGHTED = ["kill-rank", "sigterm", "full-disk-log", "kill-in-save", "torn-log", "full-disk-save", "kill-rank",
            "sigterm", "kill-in-save", "full-disk-log"]
DRIVER_KILLS = {0: "sigkill-driver", 1: "kill-driver-in-save"}


def kinds_of(part: int) -> list[str]:
    """Part `part`'s kinds: the weighted list, a driver kill in place of one trial, the hooked kinds
    where train.faults has their hooks, no tmpfs where this is not root (test_full_disk's rule)."""
    kinds = list(WEIGHTED)
    if part in DRIVER_KILLS:
        kinds[-1] = DRIVER_KILLS[part]
    hooked = [kind for kind in HOOKS if hook_env(kind)]
    for index, kind in enumerate(hooked):
        kinds[2 + 3 * index] = kind
    if os.geteuid() != 0:
        kinds = [kind if kind != "full-disk-save" else "kill-rank" for kind in kinds]
    return kinds


@pytest.fixture
def work():
    """A short folder: the fork server's socket and the runs' rendezvous folders live below it."""
    path = Path(tempfile.mkdtemp(prefix="chaos-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("part", range(PARTS))
def test_chaos_trials_are_all_clean(part, work):
    lines: list[str] = []
    outcomes = run_trials(TRIALS_PER_PART, part, ["local"], kinds_of(part), lines.append, work)
    counts = tally(outcomes)
    assert counts == {"trials": TRIALS_PER_PART, "clean": TRIALS_PER_PART, "hangs": 0, "misleading": 0,
                      "tracebacks": 0, "leaks": 0, "checkpoints lost": 0}, "\n".join(lines)
    assert {o.trial.kind for o in outcomes} == set(kinds_of(part))
