"""A driver killed outright takes its rank processes with it, even a rank inside a call that never
returns by itself (as one blocked on a lost peer would be): only the rank's watchdog, waiting on the
driver's pidfd, can end it. SIGTERM and SIGKILL to a training run's driver are chaos trials
(tests/distributed/test_chaos.py: exit 143 and one line within 15 s, every rank gone, no
rendezvous folder, no traceback)."""

from __future__ import annotations

import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from attnres_lab.chaos_probe import alive
from tests.run_helpers import REPO

pytestmark = [pytest.mark.distributed, pytest.mark.subprocess]



def wait_for_line(proc: subprocess.Popen, prefix: str, timeout_s: float) -> list[str]:
    """stdout lines up to the first starting with `prefix`, within `timeout_s` (read by a thread:
    select on a buffered text stream misses lines its buffer already holds)."""
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout] and None, daemon=True).start()
    seen, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.5)
        except queue.Empty:
            continue
        seen.append(line)
        if line.startswith(prefix):
            return seen
    raise AssertionError(f"no line {prefix!r} within {timeout_s} s: {seen}")


@pytest.fixture
def short_tmp():
    """A TMPDIR of this test's own, short: the fork server's socket lives in it, and a Unix socket's
    path must stay under 108 bytes (pytest's tmp_path under xdist can be longer)."""
    tmp = Path(tempfile.mkdtemp(prefix="sigterm-", dir="/tmp"))
    yield tmp
    shutil.rmtree(tmp, ignore_errors=True)


def wait_until_ended(pids: set[int], timeout_s: float) -> list[int]:
    """The pids still running after up to `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    return [pid for pid in pids if alive(pid)]


class SleepyWorker:
    """A rank whose call never returns by itself, as one blocked on a lost peer would be."""

    def join_process_group(self, init_method: str, world_size: int) -> dict:
        return {"pid": os.getpid()}

    def block(self) -> None:
        time.sleep(600)

    def close(self) -> None:
        pass


DRIVER = """
import time
from attnres_pp.launch.process_rank_group import ProcessRankGroup
from tests.distributed.test_sigterm import SleepyWorker
group = ProcessRankGroup(1, 600.0, name="pdeathsig-test")
print(group.start(SleepyWorker, [{}])[0]["pid"], flush=True)
group.send("block", [()])
print("blocked", flush=True)
time.sleep(600)
"""


def test_a_rank_blocked_in_a_call_dies_with_a_killed_driver(short_tmp):
    """The rank does not read its pipe while it is in the call, so only its watchdog (waiting on the
    driver's pidfd) can end it before the call's own timeout."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    proc = subprocess.Popen([sys.executable, "-c", DRIVER], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": path, "TMPDIR": str(short_tmp)})
    try:
        lines = wait_for_line(proc, "blocked", timeout_s=60)
        rank = int(lines[0])
        time.sleep(0.5)  # inside `block` by now
        assert alive(rank)
        proc.kill()
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert wait_until_ended({rank}, 5) == []
