"""A private Ray instance ends with the driver that started it, even a driver killed outright.

Ray starts its GCS and raylet as the driver's children with a parent-death signal, so they end with
it; the raylet's dashboard and runtime-env agents (about 210 MB together) then notice their parent
is gone within two seconds, but first try to tell the dead GCS, with a fixed 60 s timeout: they
outlived a SIGKILLed driver by 50-140 s. Nothing inside the driver can act once it is killed, so
`watch_private_instance` starts a small watchdog process (this module run as a script, no torch, no
ray) that holds a pidfd of every process of the instance and SIGKILLs the ones left when the
driver's pidfd says it ended. Pidfds, not pids: a pid reused by an unrelated process is never
signalled. The watchdog also ends when the whole instance has ended (the driver's ray.shutdown),
so a long-lived driver that starts many instances (a test session) does not collect watchdogs.
Linux only (pidfds, /proc); elsewhere nothing is started.

`keeping_sigterm_handler` keeps the driver's SIGTERM handler across ray.init, which installs its own
(`sys.exit(15)`): under it SIGTERM to a training driver ended it with exit code 15 and no line
instead of the run's stop (ranks told to stop, one line, exit 143).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
from pathlib import Path

# How often the watchdog looks for processes the instance started since (workers, actors): the
# agents exist once ray.init returns, so this only bounds how late a new worker is adopted.
_SCAN_S = 0.5


def watch_private_instance(ray) -> subprocess.Popen | None:
    """Start the watchdog over the Ray instance this process started (`ray` the imported module,
    after ray.init); None where pidfds are missing. The caller reaps it (`end_watchdog`)."""
    if not hasattr(os, "pidfd_open") or not Path("/proc/self/stat").exists():
        return None
    node = getattr(ray._private.worker, "_global_node", None)
    roots = sorted({info.process.pid for infos in getattr(node, "all_processes", {}).values()
                    for info in infos if getattr(info, "process", None) is not None})
    if not roots:
        return None
    # The driver's import path, so that `-m` finds the attnres_pp this process runs.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    return subprocess.Popen([sys.executable, "-m", "attnres_pp.launch.ray_watchdog", str(os.getpid()),
                             *map(str, roots)], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=env, start_new_session=True, close_fds=True)


@contextlib.contextmanager
def keeping_sigterm_handler():
    """The SIGTERM handler in place before the block is in place after it (ray.init replaces it)."""
    try:
        before = signal.getsignal(signal.SIGTERM)
    except ValueError:  # not the main thread: nothing to keep, and ray.init sets nothing either
        before = None
    try:
        yield
    finally:
        if before is not None:
            with contextlib.suppress(ValueError):
                signal.signal(signal.SIGTERM, before)


def end_watchdog(watchdog: subprocess.Popen | None, timeout_s: float = 3.0) -> None:
    """Reap the watchdog after ray.shutdown (it ends by itself once the instance has; killed if not)."""
    if watchdog is None:
        return
    try:
        watchdog.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        watchdog.kill()
        watchdog.wait(timeout=timeout_s)


def _parents() -> dict[int, int]:
    """pid -> parent pid of every process now, from /proc."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):  # gone meanwhile
                continue
    return parents


def _adopt(held: dict[int, int], roots: list[int]) -> None:
    """Open a pidfd for each root and each process below a held one that is not held yet. A child's
    parent is checked again after its pidfd is open, so a pid reused between the scan and the open
    is not adopted."""
    for pid in roots:
        if pid not in held:
            try:
                held[pid] = os.pidfd_open(pid)
            except OSError:
                continue
    parents = _parents()
    frontier = set(held)
    while frontier:
        children = {child for child, parent in parents.items() if parent in frontier and child not in held}
        for child in children:
            try:
                fd = os.pidfd_open(child)
            except OSError:
                continue
            if _parents_of(child) in held:
                held[child] = fd
            else:
                os.close(fd)
        frontier = children & set(held)


def _parents_of(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _ended(fd: int) -> bool:
    """A pidfd is readable once its process has ended."""
    return bool(select.select([fd], [], [], 0)[0])


def watch(driver_pid: int, roots: list[int]) -> int:
    """Until the driver ends (then SIGKILL what is left of the instance) or the instance has ended."""
    try:
        driver = os.pidfd_open(driver_pid)
    except OSError:  # the driver is gone already
        driver = None
    held: dict[int, int] = {}
    while True:
        _adopt(held, roots)
        roots = []
        if driver is None or select.select([driver], [], [], _SCAN_S)[0]:
            for fd in held.values():
                try:
                    signal.pidfd_send_signal(fd, signal.SIGKILL)
                except OSError:  # ended meanwhile
                    continue
            return 0
        if all(_ended(fd) for fd in held.values()):
            return 0


if __name__ == "__main__":
    sys.exit(watch(int(sys.argv[1]), [int(pid) for pid in sys.argv[2:]]))
