"""SIGTERM to the driver (what `kill`, systemd, Slurm and `docker stop` send) under the local launcher
stops the run as Ctrl-C does: a real `attnres-pp train --launcher local --stages 2` is signalled
mid-run and exits 143 with one line, its rank processes (and the fork server they came from) end,
and no rendezvous folder is left."""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
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
    """stdout lines up to the first starting with `prefix`, within `timeout_s`."""
    lines, selector = [], selectors.DefaultSelector()
    selector.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if selector.select(timeout=0.5):
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if line.startswith(prefix):
                return lines
    raise AssertionError(f"no line {prefix!r} within {timeout_s} s: {lines}")


def test_sigterm_stops_the_run_like_ctrl_c(tmp_path):
    tmp = tmp_path / "tmp"  # the rendezvous folder goes under TMPDIR: this test's own
    tmp.mkdir()
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    proc = subprocess.Popen([sys.executable, "-m", "attnres_pp.cli", "train", *RUN, "--out", str(tmp_path / "run")],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": path, "TMPDIR": str(tmp)})
    try:
        wait_for_line(proc, "step ", timeout_s=120)  # the ranks are stepping
        ranks = descendants(proc.pid)
        assert len(ranks) >= 3, ranks  # the fork server and two ranks
        assert list(tmp.glob("attnres-pp-rdzv-*"))
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        stop_s = time.monotonic() - started
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert proc.returncode == 143, err
    assert err.splitlines() == ["terminated (SIGTERM): stopping the workers"], err
    assert stop_s < 15, stop_s
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in ranks if alive(pid)]
    assert not list(tmp.glob("attnres-pp-rdzv-*"))
