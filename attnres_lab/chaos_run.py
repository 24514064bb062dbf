"""Running chaos trials (`chaos_trials`): the driver is `attnres-pp train`'s main in this process
(most kinds: its rank processes come from the local launcher's fork server, which keeps torch
imported, so a trial costs what its ranks cost) or a process of its own where the driver itself
must die (SIGKILL): under the local launcher a fork of this process set up as a fresh driver
(`ForkedDriver`), else a fresh interpreter. A watcher thread follows each run from outside: the processes below the
driver, the records of metrics.jsonl, the fault to deliver at a step, and the trial's deadline.
Every wait is bounded: a run past its deadline is stopped (SIGTERM to this process's run, SIGKILL to
a driver process) and counted as a hang."""

from __future__ import annotations

import contextlib
import errno
import faulthandler
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from attnres_lab import chaos_probe as probe
from attnres_lab.chaos_trials import (
    CHECKPOINT_EVERY,
    DEADLINE_S,
    FLAGS,
    TIMEOUT_S,
    Trial,
    run_losses,
)
from attnres_pp.train.faults import FREEZE_RANK, LOSE_RANK_AT_START

_POLL_S = 0.02
_PAGE = 4096


class Watcher(threading.Thread):
    """Samples the processes below `driver` (less `exclude` and the fork server, which outlives a run
    by design), counts metrics.jsonl's records, calls `fire(ranks)` once `when(records, ranks)` holds
    (`ranks`: the rank processes seen so far, by pid), and `on_deadline()` once `deadline_s` passed."""

    def __init__(self, driver: int, metrics: Path, *, exclude: set[int], deadline_s: float,
                 on_deadline: Callable[[], None], when=None, fire=None) -> None:
        super().__init__(daemon=True)
        self.driver, self.metrics, self.exclude = driver, metrics, exclude
        self.deadline_s, self.on_deadline, self.when, self.fire = deadline_s, on_deadline, when, fire
        self.seen: set[int] = set()
        self.fired, self.hang = False, False
        self.fired_at: float | None = None  # time.monotonic() of the fault's delivery
        self._stop_event = threading.Event()

    def ranks(self) -> list[int]:
        """The rank processes now: children of the fork server (local), or Ray's rank actors."""
        server = probe.fork_server_pid()
        if server is not None:
            local = sorted(p for p in probe.descendants(server) if p in self.seen and probe.alive(p))
            if local:
                return local
        return sorted(p for p in self.seen if probe.command_of(p).startswith("ray::RankActor"))

    def records(self) -> int:
        try:
            return self.metrics.read_bytes().count(b"\n")
        except OSError:
            return 0

    def run(self) -> None:
        started = time.monotonic()
        while not self._stop_event.wait(_POLL_S):
            server = probe.fork_server_pid()
            self.seen |= probe.descendants(self.driver) - self.exclude - {server}
            if self.when is not None and not self.fired and self.when(self.records(), self.ranks()):
                self.fired, self.fired_at = True, time.monotonic()
                with contextlib.suppress(OSError):
                    self.fire(self.ranks())
            if not self.hang and time.monotonic() - started > self.deadline_s:
                self.hang = True
                self.on_deadline()

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=5)


def fault(trial: Trial, driver: int, run: Path):
    """(env, extra flags, when, fire) that deliver `trial`'s fault to the run in `run`."""
    env, flags, when, fire = {}, [], None, None
    kind, rank, step = trial.kind, trial.rank, trial.step
    if kind == "kill-rank":
        flags = ["--inject-failure", f"{rank}:{step}"]
    elif kind == "kill-in-save":
        # The hook kills at every save of step_N, the restarted ranks' too: once the first attempt's
        # save has begun, the restarted ranks (which read the environment as they start) go without it.
        env["ATTNRES_PP_KILL_DURING_CHECKPOINT"] = f"{step}:after-shard:{rank}"
        when = lambda records, ranks: (run / "checkpoints" / f"step_{step}.tmp").exists()  # noqa: E731
        fire = lambda ranks: os.environ.pop("ATTNRES_PP_KILL_DURING_CHECKPOINT", None)  # noqa: E731
    elif kind == "kill-driver-in-save":
        env["ATTNRES_PP_KILL_DURING_CHECKPOINT"] = f"{step}:{trial.point}"
    elif kind == "freeze-rank":  # the rank stops itself at the step, its first start only
        flags = ["--timeout", str(TIMEOUT_S)]
        env[FREEZE_RANK] = f"{rank}:{step}"
    elif kind == "lose-at-start":  # the rank's process exits as it joins the group, its first start only
        env[LOSE_RANK_AT_START] = str(rank)
    elif kind in ("sigterm", "torn-log", "sigkill-driver"):
        sig = signal.SIGKILL if kind == "sigkill-driver" else signal.SIGTERM
        when, fire = (lambda records, ranks: records >= step), (lambda ranks: os.kill(driver, sig))
    return env, flags, when, fire


@contextlib.contextmanager
def _environ(env: dict[str, str]):
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _tempdir(path: Path):
    """tempfile's folder (where a run makes its rendezvous folder) set to `path` for a while."""
    before = tempfile.tempdir
    tempfile.tempdir = str(path)
    try:
        yield
    finally:
        tempfile.tempdir = before


@contextlib.contextmanager
def full_disk_at(call: int):
    """The driver's `call`-th record write puts half its bytes on disk, then fails as a full disk does."""
    from attnres_pp.train import summary

    real, calls = summary.write_all, {"n": 0}

    def write_all(fd: int, data: bytes) -> None:
        calls["n"] += 1
        if calls["n"] == call:
            os.write(fd, data[: len(data) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd, data)

    summary.write_all = write_all
    try:
        yield
    finally:
        summary.write_all = real


def ignore_sigterm(signum, frame) -> None:
    """Between runs a late SIGTERM (a watcher that fired as a run ended) is dropped, not fatal."""


class Session:
    """Trials in this process: its output (and its ranks') captured in `work`/output.log, the
    undisturbed run's losses computed once."""

    def __init__(self, work: Path, progress: Callable[[str], None]) -> None:
        self.work, self.progress = work, progress
        self.log = work / "output.log"
        self.reference: list[float] | None = None
        self.checkpoint_bytes = 0
        from multiprocessing import util

        util.get_temp_dir()  # multiprocessing's folder (the fork server's socket), outside every trial's

    def output_since(self, offset: int) -> str:
        with open(self.log, "rb") as handle:
            handle.seek(offset)
            return handle.read().decode(errors="replace")

    def offset(self) -> int:
        sys.stdout.flush()
        return self.log.stat().st_size if self.log.exists() else 0

    def drive(self, args: list[str], *, env: dict, tmp: Path, deadline_s: float, when=None, fire=None,
              metrics: Path) -> tuple[int, Watcher, str]:
        """train's main in this process under a watcher: (exit code, the watcher, what was printed)."""
        from attnres_pp.cli import main

        me, start = os.getpid(), self.offset()
        server = probe.fork_server_pid()
        watcher = Watcher(me, metrics, exclude=probe.descendants(me) | ({server} if server else set()),
                          deadline_s=deadline_s, on_deadline=lambda: os.kill(me, signal.SIGTERM), when=when, fire=fire)
        with _environ(env), _tempdir(tmp):
            watcher.start()
            try:
                rc = main(args)
            except BaseException:  # what the console script would print and exit 1 on
                traceback.print_exc()
                rc = 1
            finally:
                watcher.stop()
        return rc, watcher, self.output_since(start)

    def ensure_reference(self, launcher: str) -> list[float]:
        """The undisturbed run's losses (under the local launcher: launchers give the same losses)."""
        if self.reference is None:
            run = self.work / "undisturbed"
            rc, _, out = self.drive(["train", "--launcher", "local", *FLAGS, "--out", str(run)], env={},
                                    tmp=self.work, deadline_s=DEADLINE_S["local"], metrics=run / "metrics.jsonl")
            losses, _ = run_losses(run)
            if rc != 0 or losses is None:
                raise RuntimeError(f"the undisturbed run failed (rc {rc}): {out[-2000:]}")
            self.reference = losses
            step = run / "checkpoints" / f"step_{CHECKPOINT_EVERY * (len(losses) // CHECKPOINT_EVERY)}"
            self.checkpoint_bytes = sum(-(-p.stat().st_size // _PAGE) * _PAGE for p in step.rglob("*") if p.is_file())
        return self.reference


def driver_command(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "attnres_pp.cli", *args]


def package_path() -> str:
    import attnres_pp

    parent = str(Path(attnres_pp.__file__).resolve().parents[1])
    return os.pathsep.join(filter(None, [parent, os.environ.get("PYTHONPATH")]))


def popen(args: list[str], env: dict, tmp: Path, log: Path) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen(driver_command(args), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, **env, "TMPDIR": str(tmp), "PYTHONPATH": package_path()})


class ForkedDriver:
    """`attnres-pp ARGS` as a fork of this process, which has torch and the package imported already: the
    driver a trial SIGKILLs starts without an interpreter start and a torch import (~2.5 CPU-s). After
    the fork it is what a fresh `python -m attnres_pp.cli` is: its environment, TMPDIR, stdin, stdout
    and stderr set as `popen` sets them, the default SIGTERM and SIGINT handling, and multiprocessing's
    fork server, resource tracker and temporary folder its own (made as its ranks start, under TMPDIR),
    so that its ranks and what they leave behind are its own as a fresh driver's are. The child never
    returns into the caller: it ends by os._exit with main's code, or 1 and a traceback."""

    def __init__(self, args: list[str], env: dict, tmp: Path, log: Path) -> None:
        out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        sys.stdout.flush()
        sys.stderr.flush()
        self.pid = os.fork()
        if self.pid == 0:
            _forked_driver(args, {**env, "TMPDIR": str(tmp), "PYTHONPATH": package_path()}, out)
        os.close(out)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            done, status = os.waitpid(self.pid, os.WNOHANG)
            if done:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(driver_command([]), timeout)
            time.sleep(_POLL_S)
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)


def _forked_driver(args: list[str], env: dict[str, str], out: int) -> None:
    code = 1
    try:
        from multiprocessing import forkserver, process, resource_tracker

        for server in (forkserver._forkserver, resource_tracker._resource_tracker):
            for name in ("_forkserver_pid", "_forkserver_address", "_forkserver_alive_fd", "_pid", "_fd"):
                if hasattr(server, name):
                    setattr(server, name, None)
        process.current_process()._config.pop("tempdir", None)
        faulthandler.disable()  # a host's (pytest's) dump to its own stderr: a fresh driver has none
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.environ.update(env)
        tempfile.tempdir = None  # read TMPDIR again
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115 - the child ends by os._exit
        sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
        from attnres_pp.cli import console_main, main

        code = console_main(lambda: main(args))
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else int(done.code is not None)
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(BaseException):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code if isinstance(code, int) else 1)


def start_driver(args: list[str], env: dict, tmp: Path, log: Path, launcher: str):
    """The driver of a trial that kills it: a fork of this process where that is a fresh driver's equal
    (the local launcher, no CUDA or Ray started here, which a forked child cannot use), else `popen`'s."""
    torch = sys.modules.get("torch")
    ray = sys.modules.get("ray")
    if launcher != "local" or (torch is not None and torch.cuda.is_initialized()) \
            or (ray is not None and ray.is_initialized()):
        return popen(args, env, tmp, log)
    return ForkedDriver(args, env, tmp, log)
