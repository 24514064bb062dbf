"""`--launcher local`: a `RankGroup` (`rank_group`) of one process per rank on this machine,
answering the driver's requests over a pipe.

Each rank builds its worker and joins the process group (`worker.join_process_group(init_method,
world_size)`); the setup result is its first reply, or ("refused", one line) when the set-up raises
ValueError, or ("error", traceback). A request that fails for want of disk space or permission is
("fault", a `storage_fault.StorageFault`), any other failure ("error", traceback), whatever it
raised (DCP's CheckpointException derives from BaseException): a rank reports, it does not die.
When several ranks fail, the cause is raised, not what follows from it: a rank that exits after
replying is its reply, not a death, and once one rank has reported a failure the others get
FAILURE_GRACE_S to report theirs; then a refusal wins, then a storage fault, then a rank gone
without a word, then an error, lowest rank first in each. `bytes_exchanged` counts what crossed
between the driver and the ranks (pickled requests and replies), so engines can report it per step.

The process group's ranks rendezvous through a file in a temporary folder (no port hunting) and
ignore Ctrl-C: the driver, which receives it too, stops them. A driver killed outright cannot: each
rank's watchdog thread ends the rank, silently, when the driver process ends.

The same watchdog thread stamps the rank's heartbeat (a shared array of monotonic times, one per
rank) every HEARTBEAT_S, whatever the rank's worker is doing. A rank whose heartbeat stops while its
process lives is frozen or hung (`rank_group.RankHung`): silent for `hung_after_s(timeout)`, or for
STALE_S once a peer has failed; the driver kills it (SIGKILL, which a stopped process obeys too) and
raises RankHung, which the training loop restarts like a lost rank. After any failure the group
stops its ranks without the close handshake (a survivor may be blocked on the failed rank).

Rank processes are forked from multiprocessing's fork server, which imports torch and the worker's
module once per driver: a spawned rank spent about 2 s of CPU importing them before it did anything,
at every start and every restart. The server is a clean single-threaded process started on demand
(not a fork of the driver, which may hold threads and locks), so a rank is what a spawned one would
be with those imports done. Each rank takes the driver's environment as it is when the rank starts
(the server's own is the driver's at the server's start).
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing as mp
import os
import select
import shutil
import signal
import tempfile
import threading
import time
import traceback
import typing
from multiprocessing.reduction import ForkingPickler

from attnres_pp.launch import rank_group
from attnres_pp.launch.rank_group import HEARTBEAT_S, STALE_S, RankGroupBase, hung, hung_after_s, kill_pid
from attnres_pp.launch.storage_fault import failure_reply
from attnres_pp.pipeline.errors import WorkerLost

# What the fork server imports before it forks any rank: what every rank imports first.
# torch._dynamo: every rank imports it on its first parameter init (about 0.7 CPU-s a rank at a small
# model); imported once in the server, each forked rank has it already.
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo"]
# Imported last, so that its atexit handler runs first: the server ends without the interpreter's
# teardown (`fork_server_exit`).
_QUIT_AT_ONCE = "attnres_pp.launch.fork_server_exit"


def rank_context(worker_module: str):
    """The multiprocessing context rank processes start from: the fork server, preloaded with torch
    and `worker_module` (the preload list is read when the server starts, once per process)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(dict.fromkeys([*_PRELOAD, worker_module, _QUIT_AT_ONCE])))
    return ctx


def _serve_rank(rank: int, init_method: str, world_size: int, conn, worker_cls: type, kwargs: dict,
                environ: dict[str, str], driver_pid: int, beats) -> None:
    """Rank-process body: take the driver's environment, build the worker and join the group (the
    setup result is the first reply; a ValueError in the set-up is ("refused", its one-line
    message)), then answer requests with ("ok", result), ("fault", a StorageFault) or ("error",
    traceback) until "close", which closes the worker. The rank ends with the driver (`driver_pid`)
    and stamps `beats[rank]` while it runs."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    gone = functools.partial(_driver_gone, init_method.removeprefix("file://").rsplit("/", 1)[0])
    _exit_with_the_driver(driver_pid, gone, beats, rank)
    os.environ.clear()
    os.environ.update(environ)
    try:
        worker = worker_cls(**kwargs)
        setup_result = worker.join_process_group(init_method, world_size)
        conn.send(("ok", setup_result))
    except ValueError as error:  # a setting or resource this rank refuses, said in one line (no room in /dev/shm)
        conn.send(("refused", " ".join(str(error).split())))
        return
    except Exception as error:  # report any setup failure to the driver rather than dying silently
        conn.send(failure_reply(error, traceback.format_exc))
        return
    while True:
        try:
            method, args = conn.recv()
        except (EOFError, OSError):
            gone()
        if method == "close":
            worker.close()
            _answer(conn, ("ok", None), gone)
            return
        try:
            reply = ("ok", getattr(worker, method)(*args))
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as error:  # noqa: BLE001  DCP's CheckpointException is a BaseException
            # Reported, not died of: a dead rank is a lost one, restarted into the same failure.
            reply = failure_reply(error, traceback.format_exc)
        _answer(conn, reply, gone)


def _answer(conn, reply: tuple, gone) -> None:
    try:
        conn.send(reply)
    except OSError:  # BrokenPipeError, ConnectionResetError: the driver is gone
        gone()


def _driver_gone(rendezvous_dir: str) -> typing.NoReturn:
    """The driver ended without a "close" (killed): its own stop, or its user, speaks for the run. Remove
    the rendezvous folder it can no longer remove (every rank is going; a restart would have made a new
    one), then end at once and without a word: a traceback per rank after the shell's prompt says
    nothing the user can act on, and the process group's teardown would wait on peers that are going
    too. (The shared-memory files were unlinked at set-up; the memory goes with the process.)"""
    shutil.rmtree(rendezvous_dir, ignore_errors=True)
    os._exit(1)


def _exit_with_the_driver(driver_pid: int, gone, beats, rank: int) -> None:
    """End this rank (`gone()`), from a watchdog thread, as soon as the driver process ends; until
    then stamp `beats[rank]` with the time every HEARTBEAT_S (the driver's sign that it runs). A driver
    killed outright (SIGKILL, the OOM killer) cannot stop its ranks, and a rank inside a call (blocked
    on a peer) does not read its pipe; nor does a parent-death signal reach it: its parent is the fork
    server, which every rank keeps alive (each holds the server's liveness pipe). The driver's pidfd
    becomes readable when it exits (no pid reuse can fool it); without pidfds, its pid is polled."""
    try:
        pidfd = os.pidfd_open(driver_pid)
    except (AttributeError, OSError):
        pidfd = None

    def watch() -> None:
        while True:
            beats[rank] = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process of the host
            if pidfd is not None:
                ended = bool(select.select([pidfd], [], [], HEARTBEAT_S)[0])
            else:
                time.sleep(HEARTBEAT_S)
                try:
                    os.kill(driver_pid, 0)
                    ended = False
                except ProcessLookupError:
                    ended = True
                except PermissionError:  # another user's process took the pid: ours is gone
                    ended = True
            if ended:
                gone()

    threading.Thread(target=watch, name="driver-watchdog", daemon=True).start()


class ProcessRankGroup(RankGroupBase):
    """One process per rank on this machine (forked from the preloaded fork server), answering requests
    over a pipe."""

    def __init__(self, world_size: int, timeout_s: float, *, name: str) -> None:
        super().__init__(world_size, timeout_s)
        self.name = name
        self.conns, self.procs = [], []
        self._rendezvous_dir: str | None = None
        self._beats = None  # each rank's last heartbeat (time.monotonic(); 0: none yet), shared with the ranks
        self._failed = False  # a call failed: ranks may be blocked on the failed one

    def start(self, worker_cls: type, rank_kwargs: list[dict], *, device: str = "cpu") -> list:
        self._worker = (worker_cls, rank_kwargs, device)
        self._rendezvous_dir = tempfile.mkdtemp(prefix=f"{self.name}-rdzv-")
        init_method = f"file://{self._rendezvous_dir}/rendezvous"
        ctx = rank_context(worker_cls.__module__)
        self._failed = False
        try:
            self._beats = ctx.RawArray("d", self.world_size)
            for rank in range(self.world_size):
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=_serve_rank, name=f"{self.name}-rank{rank}", daemon=True,
                                   args=(rank, init_method, self.world_size, child, worker_cls, rank_kwargs[rank],
                                         dict(os.environ), os.getpid(), self._beats))
                proc.start()
                self.conns.append(parent)
                self.procs.append(proc)
            self.setup_results = self.gather("setup")
        except OSError as error:
            self.stop(graceful=False)
            if "AF_UNIX path too long" not in str(error):
                raise
            # The fork server listens on a Unix socket in the temporary folder, whose path is limited.
            raise ValueError(f"the temporary folder {tempfile.gettempdir()} is too long a path for the rank "
                             "processes' fork server socket (a Unix socket path takes at most 107 bytes): set "
                             "TMPDIR to a shorter folder, e.g. TMPDIR=/tmp") from None
        except BaseException:
            self.stop(graceful=False)
            raise
        return self.setup_results

    def gather(self, what: str) -> list:
        """The replies to the last `send` (or the set-up), in rank order, waiting at most timeout_s (+
        start-up slack) for each. A rank that fails or exits is reported by `_raise_first_cause`,
        which reads every reply first; a rank whose heartbeat stops is killed and reported hung."""
        try:
            return self._gather(what)
        except Exception:
            self._failed = True
            raise

    def _gather(self, what: str) -> list:
        replies: list[tuple[str, object] | None] = [None] * len(self.conns)
        deadline = time.monotonic() + self.timeout_s + 30.0
        for rank, conn in enumerate(self.conns):
            while replies[rank] is None:
                if conn.poll(0.2):
                    replies[rank] = self._read(rank, what)
                elif any(not proc.is_alive() for proc in self.procs):
                    # Any exit ends the wait (the others may be blocked on it until their timeout).
                    self._raise_first_cause(replies, what)
                elif time.monotonic() > deadline:
                    raise WorkerLost(rank, f"rank {rank} did not answer {what} within {self.timeout_s:.0f} s")
                else:
                    self._raise_if_hung(replies, what, hung_after_s(self.timeout_s))
            if replies[rank][0] != "ok":
                self._raise_first_cause(replies, what)
        return [value for _status, value in replies]

    def silent_s(self, rank: int) -> float:
        """Seconds since rank `rank`'s last heartbeat; 0 before its first (a process just forked on a
        loaded machine may take seconds to run its body: the set-up deadline bounds that wait)."""
        if self._beats is None or not self._beats[rank]:
            return 0.0
        return time.monotonic() - self._beats[rank]

    def _raise_if_hung(self, replies: list, what: str, limit_s: float) -> None:
        """Kill and raise RankHung for the lowest live rank that has not replied and whose heartbeat
        has been silent for more than `limit_s` (replies that arrived are read first)."""
        self._read_arrived(replies, what)
        for rank, (reply, proc) in enumerate(zip(replies, self.procs, strict=True)):
            silent_s = self.silent_s(rank)
            if reply is None and silent_s > limit_s and proc.is_alive():
                kill_pid(proc.pid)
                proc.join(timeout=5)
                raise hung(rank, what, silent_s)

    def _read(self, rank: int, what: str) -> tuple[str, object]:
        """Rank `rank`'s next reply, which has arrived: (status, value), or ("lost", why) when the
        rank's end of the pipe is gone."""
        try:
            message = self.conns[rank].recv_bytes()
        except (EOFError, ConnectionResetError):
            # A rank that dies with a request unread resets its end of the pipe rather than closing it.
            return "lost", f"rank {rank} closed its pipe during {what}"
        self.bytes_exchanged += len(message)
        return ForkingPickler.loads(message)

    def _read_arrived(self, replies: list, what: str) -> None:
        """Read every reply that has arrived and is not read yet: a rank that has exited may have
        left one, its report of why it stopped."""
        for rank, conn in enumerate(self.conns):
            if replies[rank] is None:
                try:
                    arrived = conn.poll(0)
                except (EOFError, ConnectionResetError, OSError):
                    arrived = True  # `_read` names the closed pipe
                if arrived:
                    replies[rank] = self._read(rank, what)

    def _raise_first_cause(self, replies: list, what: str) -> None:
        """A rank has failed or exited: raise the cause, not its consequences. The replies that have
        arrived are read first, so an exit after a report is the report. Once a rank has reported a
        failure the others get FAILURE_GRACE_S to report theirs (ranks that refuse together reply
        moments apart, in any order), unless they have ended or fallen silent. Then, lowest rank
        first: a refusal (ValueError, the one line that names the fix), a write the disk refused
        (StorageFault: out of space, no permission), a rank gone without a report (WorkerLost: the
        others' errors follow from it), a live rank whose heartbeat has been silent for STALE_S
        (RankHung: the others' timeouts follow from it), a rank's error (RuntimeError with its
        traceback)."""
        self._read_arrived(replies, what)
        if any(reply is not None and reply[0] in ("refused", "fault", "error") for reply in replies):
            grace_ends = time.monotonic() + rank_group.FAILURE_GRACE_S
            while time.monotonic() < grace_ends and not all(  # each rank has answered, ended or fallen silent
                    reply is not None or not proc.is_alive() or self.silent_s(rank) > STALE_S
                    for rank, (reply, proc) in enumerate(zip(replies, self.procs, strict=True))):
                time.sleep(0.05)
                self._read_arrived(replies, what)
            self._read_arrived(replies, what)
        errors = [(rank, reply[1]) for rank, reply in enumerate(replies) if reply is not None and reply[0] == "error"]
        detail = "".join(f"\nrank {rank} then failed with:\n{value}" for rank, value in errors[:1])
        for rank, reply in enumerate(replies):
            if reply is not None and reply[0] == "refused":  # a ValueError, so the CLI prints it as one `error:` line
                raise ValueError(f"rank {rank} refused to start: {reply[1]}")
        for reply in replies:
            if reply is not None and reply[0] == "fault":  # a full disk, no permission: no restart would help
                raise reply[1]
        for rank, (reply, proc) in enumerate(zip(replies, self.procs, strict=True)):
            if reply is not None and reply[0] == "error":
                continue
            if not proc.is_alive():  # gone without a report (its pipe closed with it, or after an answer)
                raise WorkerLost(rank, f"rank {rank} exited (code {proc.exitcode}) during {what}{detail}")
            if reply is not None and reply[0] == "lost":  # its pipe reset before its exit is seen
                raise WorkerLost(rank, f"{reply[1]}{detail}")
        self._raise_if_hung(replies, what, STALE_S)
        if errors:
            rank, value = errors[0]
            raise RuntimeError(f"rank {rank} failed during {what}:\n{value}")

    def _raise_if_a_rank_died(self, what: str) -> None:
        for rank, proc in enumerate(self.procs):
            if not proc.is_alive():
                raise WorkerLost(rank, f"rank {rank} exited (code {proc.exitcode}) during {what}")

    def send(self, method: str, per_rank_args: list[tuple]) -> None:
        """The requests of `call` without waiting for the replies (`gather` collects them)."""
        for conn, args in zip(self.conns, per_rank_args, strict=True):
            # What conn.send does, with the bytes counted (`bytes_exchanged`).
            message = ForkingPickler.dumps((method, args))
            self.bytes_exchanged += len(message)
            try:
                conn.send_bytes(message)
            except (BrokenPipeError, ConnectionResetError):
                self._raise_if_a_rank_died(method)
                raise

    def replied(self) -> bool:
        """Whether `gather` would return or raise at once: every rank has replied, or one is dead or hung."""
        return (all(conn.poll(0) for conn in self.conns) or any(not proc.is_alive() for proc in self.procs)
                or any(self.silent_s(rank) > hung_after_s(self.timeout_s) for rank in range(len(self.procs))))

    def stop_ranks(self) -> None:
        """Stop every rank at once (some may be blocked on a lost peer)."""
        self.stop(graceful=False)

    def stop(self, graceful: bool) -> None:
        # A survivor may be blocked on a failed or frozen rank: then none is waited for.
        graceful = graceful and not self._failed and all(self.silent_s(rank) <= STALE_S
                                                         for rank in range(len(self.procs)))
        if graceful:
            for conn, proc in zip(self.conns, self.procs, strict=True):
                if proc.is_alive():
                    try:
                        conn.send(("close", ()))
                    except (BrokenPipeError, OSError):
                        pass
        for proc in self.procs:
            if graceful:
                proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGCONT)  # a stopped rank acts on SIGTERM only once it runs
                proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        for conn in self.conns:
            conn.close()
        self.conns, self.procs = [], []
        if self._rendezvous_dir is not None:
            shutil.rmtree(self._rendezvous_dir, ignore_errors=True)
            self._rendezvous_dir = None
