"""What a chaos trial looks at from outside a run: the processes below a driver (its rank processes,
its fork server, a Ray instance's GCS, raylet, agents and actors), whether they still run, the rank
processes of the local launcher (children of multiprocessing's fork server), the driver's output
captured at the file-descriptor level (rank processes write to the descriptors the fork server was
started with), and what a run may leave behind: rendezvous folders and shared-memory files.
Linux /proc only; nothing here imports torch."""

from __future__ import annotations

import contextlib
import os
import re
import sys
import time
from pathlib import Path

# A run's leftovers have this long to go after the run ends (or its driver is killed).
LEAK_GRACE_S = 5.0
_SHM_CREATOR = re.compile(r"-p(\d+)$")  # comm.shm_files.file_stem: the receiver's pid ends the name


def parents() -> dict[int, int]:
    """pid -> parent pid of every process now."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                found[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):  # gone meanwhile
                continue
    return found


def children(pid: int) -> set[int]:
    """The processes whose parent is `pid` now: each of its threads' /proc children list (a child
    is listed under the thread that forked it)."""
    found: set[int] = set()
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:  # gone
        return found
    for tid in threads:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as handle:
                found.update(int(child) for child in handle.read().split())
        except (OSError, ValueError):  # the thread ended meanwhile
            continue
    return found


def descendants(pid: int) -> set[int]:
    """Every process below `pid` now. Walked down from `pid` (the watchers call this every few
    milliseconds: reading every process's stat, as `parents` does, cost about 6 ms of CPU a call on
    a machine of 170 processes)."""
    found, frontier = set(), {pid}
    while frontier:
        frontier = set().union(*(children(parent) for parent in frontier)) - found
        found |= frontier
    return found


def alive(pid: int) -> bool:
    """Running or stopped (a zombie counts as ended: nothing of it runs)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def command_of(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def wait_until_ended(pids: set[int], timeout_s: float) -> tuple[list[int], float]:
    """(the pids still running after up to `timeout_s`, the seconds waited)."""
    started = time.monotonic()
    while any(alive(pid) for pid in pids) and time.monotonic() - started < timeout_s:
        time.sleep(0.1)
    return sorted(pid for pid in pids if alive(pid)), time.monotonic() - started


def fork_server_pid() -> int | None:
    """The pid of this process's multiprocessing fork server (the local launcher's), if one runs."""
    from multiprocessing import forkserver

    pid = getattr(forkserver._forkserver, "_forkserver_pid", None)
    return pid if pid and alive(pid) else None


def restart_fork_server() -> None:
    """Stop this process's fork server, so the next rank start makes one that inherits the file
    descriptors in place now (rank processes write where their fork server's stdout and stderr go).
    Called between trials: a rank still there (a leak, counted already) is ended first, since the
    server ends only when none holds its liveness pipe."""
    from multiprocessing import forkserver

    server = fork_server_pid()
    if server is not None:
        end_processes(descendants(server))
    with contextlib.suppress(Exception):
        forkserver._forkserver._stop()


@contextlib.contextmanager
def output_to(log_path: Path, fresh_server: bool = True):
    """This process's stdout and stderr (descriptors 1 and 2, and sys.stdout/err) appended to
    `log_path`, with a fork server started afresh inside, so its rank processes write there too, and
    stopped at the end. `fresh_server=False` keeps the fork server as it is, at both ends: one that
    an earlier `output_to` of the same log started (its caller stops it, `restart_fork_server`)."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    saved = (os.dup(1), os.dup(2))
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    stdout, stderr = sys.stdout, sys.stderr
    handle = open(log_fd, "a", buffering=1, closefd=False)  # noqa: SIM115 (closed below)
    try:
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        sys.stdout = sys.stderr = handle
        if fresh_server:
            restart_fork_server()
        yield
    finally:
        handle.flush()
        sys.stdout, sys.stderr = stdout, stderr
        if fresh_server:
            restart_fork_server()  # its descriptors point at the log: the next user gets a fresh one
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, log_fd):
            os.close(fd)
        handle.close()


def rendezvous_folders(tmp: Path) -> list[str]:
    return sorted(p.name for p in tmp.glob("*-rdzv-*"))


def shm_files_of(pids: set[int], shm: Path = Path("/dev/shm")) -> list[str]:
    """The shared-memory files made by one of `pids` (their names end in -p<pid>)."""
    found = []
    with contextlib.suppress(OSError):
        for entry in shm.iterdir():
            m = _SHM_CREATOR.search(entry.name)
            if m and int(m.group(1)) in pids:
                found.append(entry.name)
    return sorted(found)


def leaks(pids: set[int], tmp: Path, grace_s: float = LEAK_GRACE_S) -> tuple[list[str], float]:
    """What of a run outlived it by more than `grace_s`: its processes (`pids`, seen while it ran),
    rendezvous folders in `tmp`, shared-memory files of its processes; and how long the last
    process took to end."""
    left, waited = wait_until_ended(pids, grace_s)
    found = [f"process {pid} ({command_of(pid)[:60]})" for pid in left]
    found += [f"folder {name}" for name in rendezvous_folders(tmp)]
    found += [f"/dev/shm/{name}" for name in shm_files_of(pids)]
    return found, waited


def end_processes(pids: set[int]) -> None:
    """SIGKILL what is left of a trial (after it was counted), so the next trial starts clean."""
    for pid in pids:
        if alive(pid):
            with contextlib.suppress(OSError):
                os.kill(pid, 9)
