"""`attnres-pp train ...` in a fork of the test's process, for the runs that a test kills
(ATTNRES_PP_KILL_DURING_CHECKPOINT SIGKILLs the process, or a rank, at a point of a save): the child
is killed as a fresh `python -m attnres_pp.cli` process would be, and leaves the same files, without
an interpreter start and a torch import (~2.5 CPU-s a run). A run whose ranks are processes of their
own starts its own fork server from the child, as a fresh driver does. Every run keeps a fresh
process once this process has started CUDA, which a forked child cannot use."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass

import torch

from attnres_pp.cli import main
from tests.run_helpers import REPO


@dataclass(frozen=True)
class Forked:
    returncode: int  # as subprocess reports it: -N when signal N ended the child
    stderr: str


def run_forked(argv: list[str], timeout_s: float = 120.0, **env: str) -> Forked:
    """`train ARGV` with ENV added, in a forked child whose stdout is dropped and whose stderr is
    kept; the child is SIGKILLed and the test fails if it runs past `timeout_s`."""
    if torch.cuda.is_initialized():
        return _fresh_process(argv, timeout_s, env)
    with tempfile.TemporaryFile() as err:
        pid = os.fork()
        if pid == 0:  # the child: never returns into pytest
            _child(argv, env, err.fileno())
        status = _wait(pid, timeout_s)
        err.seek(0)
        stderr = err.read().decode(errors="replace")
    if status is None:
        raise AssertionError(f"train {' '.join(argv)} ran past {timeout_s} s (killed):\n{stderr}")
    return Forked(os.waitstatus_to_exitcode(status), stderr)


def _fresh_process(argv: list[str], timeout_s: float, env: dict[str, str]) -> Forked:
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-m", "attnres_pp.cli", "train", *argv], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout_s, env={**os.environ, "PYTHONPATH": path, **env})
    return Forked(done.returncode, done.stderr)


def _forget_the_fork_server() -> None:
    """A forked child cannot wait on its parent's multiprocessing fork server (not its child), which
    multiprocessing does before each use: forget it, so that rank processes started here come from
    a server of this child's own. The inherited end of the parent's keep-alive pipe stays open until
    the child ends, so the parent's server is not ended by this."""
    from multiprocessing import forkserver

    server = forkserver._forkserver
    server._forkserver_pid = server._forkserver_address = server._forkserver_alive_fd = None


def _child(argv: list[str], env: dict[str, str], err_fd: int) -> None:
    code = 1
    try:
        _forget_the_fork_server()
        os.environ.update(env)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(err_fd, 2)
        # pytest's capture objects are not fds 1 and 2: write to them through fresh streams instead.
        sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115 - the child ends by os._exit
        sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
        code = main(["train", *argv])
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else int(done.code is not None)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code if isinstance(code, int) else 1)


def _wait(pid: int, timeout_s: float) -> int | None:
    """The child's wait status, or None when it was killed at the timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None
