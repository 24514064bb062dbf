"""SIGTERM to the driver (what `kill`, systemd, Slurm and `docker stop` send) under the local launcher
stops the run as Ctrl-C does: a real `attnres-pp train --launcher local --stages 2` is signalled
mid-run and exits 143 with one line, its rank processes (and the fork server they came from) end,
and no rendezvous folder is left. SIGKILL to the driver takes the ranks with it too."""

from __future__ import annotations

import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from tests.run_helpers import REPO

pytestmark = [pytest.mark.distributed, pytest.mark.subprocess]

RUN = ["--launcher", "local", "--stages", "2", "--layers", "2", "--d-model", "32", "--heads", "2", "--seq-len", "16",
       "--batch-size", "4", "--microbatches", "2", "--steps", "100000", "--eval-every", "0"]


def descendants(pid: int) -> set[int]:
    """Every process below `pid` now, from /proc."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):  # gone meanwhile
                continue
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def alive(pid: int) -> bool:
    """Running (a zombie whose parent is gone counts as ended: nothing of it runs)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


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


def start_run(tmp_path: Path, tmp: Path) -> tuple[subprocess.Popen, Path]:
    """The run, and the TMPDIR `tmp` it makes its rendezvous folder in. Its stderr goes to a file
    (`run_stderr`): a pipe that nothing drains until the end could fill and stop the run."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    with open(tmp_path / "stderr.txt", "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "attnres_pp.cli", "train", *RUN, "--out",
                                 str(tmp_path / "run")], cwd=REPO, stdout=subprocess.PIPE, stderr=stderr, text=True,
                                env={**os.environ, "PYTHONPATH": path, "TMPDIR": str(tmp)})
    return proc, tmp


def run_stderr(tmp_path: Path) -> str:
    return (tmp_path / "stderr.txt").read_text()


def wait_until_ended(pids: set[int], timeout_s: float) -> list[int]:
    """The pids still running after up to `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    return [pid for pid in pids if alive(pid)]


def test_sigterm_stops_the_run_like_ctrl_c(tmp_path, short_tmp):
    proc, tmp = start_run(tmp_path, short_tmp)
    try:
        wait_for_line(proc, "step ", timeout_s=120)  # the ranks are stepping
        ranks = descendants(proc.pid)
        assert len(ranks) >= 3, ranks  # the fork server and two ranks
        assert list(tmp.glob("attnres-pp-rdzv-*"))
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
        stop_s = time.monotonic() - started
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    err = run_stderr(tmp_path)
    assert proc.returncode == 143, err
    assert err.splitlines() == ["terminated (SIGTERM): stopping the workers"], err
    assert stop_s < 15, stop_s
    assert wait_until_ended(ranks, 10) == []
    assert not list(tmp.glob("attnres-pp-rdzv-*"))


def test_a_killed_driver_takes_its_ranks_with_it(tmp_path, short_tmp):
    """SIGKILL leaves the driver no say: each rank's watchdog sees the driver end and ends the rank
    at once and without a word, instead of a traceback per rank once their pipes fail."""
    proc, tmp = start_run(tmp_path, short_tmp)
    try:
        wait_for_line(proc, "step ", timeout_s=120)
        assert list(tmp.glob("attnres-pp-rdzv-*"))
        ranks = descendants(proc.pid)
        assert len(ranks) >= 3, ranks
        proc.kill()
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert wait_until_ended(ranks, 5) == []
    # the ranks wrote to the driver's stderr file until they ended: what they said on the way
    err = run_stderr(tmp_path)
    assert "Traceback" not in err, err  # ended quietly, not left to fail on their closed pipes one by one
    assert not list(tmp.glob("attnres-pp-rdzv-*"))  # what the driver could not remove, its ranks did


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
