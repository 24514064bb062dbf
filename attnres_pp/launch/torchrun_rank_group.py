"""`--launcher torchrun`: a `RankGroup` (see `rank_group`) for a run whose processes torchrun started,
each one rank of the (dp, pp, tp) mesh (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT).

There is no separate driver: the process of RANK 0 runs the command as every launcher's driver does
(the engine, the training loop, summary.json, metrics.jsonl, the trace) and hosts its own rank's
worker in-process (`TorchrunRankGroup`); every other rank runs `serve_rank`, which executes the
driver's calls on its local worker and writes nothing but its checkpoint shards. Calls and replies
are the local launcher's messages (`rank_group._serve_rank`): a request `(method, args)`, where
`"start"` builds the worker and joins the mesh (env://, torchrun's rendezvous store) and `"close"`
ends the rank, and a reply `("ok", value)`, `("refused", one line)` or `("error", traceback)`.
They cross the control channel of `torchrun_channel`, which takes only the job's own ranks.

Each rank runs its worker's calls on a thread of their own, so its main thread keeps watching the
channel: a rank whose connection closes has died, and is named within a fraction of a second
whatever its peers are blocked in. Rank 0 raises WorkerLost naming it, and the run stops with one
`error:` line (torchrun restarts processes itself, `torchrun --max-restarts`; the engine has no
restart of its own); a lost rank 0 is reported by rank 1 alone. torchrun's agent stops the other
ranks with SIGTERM once one has ended (`--monitor-interval`, 0.1 s): that signal also ends a rank
with at most that one line, never a traceback (rank 0 names a rank whose connection has closed; a
rank > 0 first gives rank 0 up to 2 s to say it). Every wait is bounded by the pipeline timeout
plus start-up slack. A rank on rank 0's host whose process is stopped (frozen) is hung
(`rank_group.RankHung`) after `hung_after_s(timeout)`, or at once when a peer has failed meanwhile:
rank 0 kills it, and the run ends with one line naming it (torchrun restarts the job).

Of the project this module and `torchrun_channel` import only `pipeline.errors` and each other (the
worker class comes with the "start" request), so the two move together wherever the rank groups go.
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection, wait
from typing import NoReturn

from attnres_pp.launch.rank_group import RankGroupBase, StoppedSince, hung_after_s
from attnres_pp.launch.torchrun_channel import (
    SLACK_S,
    ControlError,
    DriverEnded,
    TorchrunEnv,
    WorkerThread,
    connect_to_driver,
    exit_now,
    note_early_exit,
    open_driver_channel,
)
from attnres_pp.pipeline.errors import WorkerLost

_GRACE_S = 1.0  # after a rank's failure, how long a peer's death may take to show (it names the cause)


def check_torchrun_run(pipe, *, fault_tolerance: str, environ=None) -> None:
    """ValueError (one line) for a `--launcher torchrun` run these processes cannot carry out."""
    env = TorchrunEnv.from_environ(environ)
    if env is None:
        raise ValueError("--launcher torchrun runs in the processes torchrun starts (RANK, WORLD_SIZE and "
                         "MASTER_ADDR are not set here): run torchrun --standalone --nproc-per-node N -m attnres_pp "
                         "train --launcher torchrun ..., or choose --launcher local")
    if fault_tolerance != "off":
        raise ValueError(f"--fault-tolerance {fault_tolerance} does not run under --launcher torchrun (a lost replica "
                         "group restarts as processes of its own, which only torchrun could start): use "
                         "--launcher local or ray, or drop --fault-tolerance")
    refusal = env.refusal(pipe)
    if refusal is not None:
        raise ValueError(refusal)


def rank_label(rank: int, pipe) -> str:
    """`rank R (dp d, pp p[, tp t])` in the (D, P, T) layout of PipelineConfig `pipe`."""
    t, p = pipe.tensor_parallel, pipe.stages
    tp = f", tp {rank % t}" if t > 1 else ""
    return f"rank {rank} (dp {rank // (p * t)}, pp {rank // t % p}{tp})"


def _send(conn: Connection, message) -> int:
    data = pickle.dumps(message)
    conn.send_bytes(data)
    return len(data)


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


class TorchrunRankGroup(RankGroupBase):
    """The ranks of this torchrun job, seen from rank 0: its own worker on a thread of this process,
    the others over the control channel. `pipe` is the run's PipelineConfig. Only torchrun starts
    its processes, so `restart` and `stop_ranks` refuse: a lost rank ends the run."""

    where = "on each node (torchrun's LOCAL_WORLD_SIZE ranks)"

    def __init__(self, pipe, *, environ=None) -> None:
        check_torchrun_run(pipe, fault_tolerance="off", environ=environ)
        self.env = TorchrunEnv.from_environ(environ)
        if self.env.rank != 0:
            raise ValueError(f"rank {self.env.rank} serves rank 0's calls (serve_rank); only rank 0 drives the run")
        super().__init__(pipe.world_size, pipe.timeout_s)  # bytes_exchanged: the control channel's, both ways
        self.pipe = pipe
        self._conns: dict[int, Connection] = {}
        self._thread: WorkerThread | None = None
        self._doing: str | None = None  # the call in flight, for the lines that name a lost rank
        self._broken = False  # a call failed: ranks may be blocked on a lost peer
        self._stopped = False
        self._sigterm_before = None
        self._frozen = StoppedSince([])  # the other ranks' processes on this host, watched for a freeze

    def gpus(self) -> int | None:
        """Every rank has its own GPU (LOCAL_RANK's) when each node has one per torchrun process on it."""
        import torch

        if os.environ.get("ATTNRES_PP_FORCE_CPU") == "1" or not torch.cuda.is_available():
            return 0
        count = torch.cuda.device_count()
        return self.world_size if self.env.local_world_size <= count else count

    def start(self, worker_cls: type, rank_kwargs: list[dict], *, device: str = "cpu") -> list:
        if _in_main_thread():
            self._sigterm_before = signal.signal(signal.SIGTERM, self._on_sigterm)
        self._conns = open_driver_channel(self.env, self.timeout_s)
        self._thread = WorkerThread("attnres-pp-rank0")
        start = [(worker_cls, kwargs, "env://", self.world_size) for kwargs in rank_kwargs]
        self.setup_results = self.call("start", start, what="setup")
        here = socket.gethostname()
        self._frozen = StoppedSince([None] + [d.get("pid") if d.get("host") == here else None
                                               for d in self.setup_results[1:]])
        return self.setup_results

    def send(self, method: str, per_rank_args: list[tuple]) -> None:
        self._doing = method
        for rank, conn in self._conns.items():
            try:
                self.bytes_exchanged += _send(conn, (method, per_rank_args[rank]))
            except OSError:
                raise self._lost(rank, method) from None
        self._thread.submit(method, per_rank_args[0])

    def replied(self) -> bool:
        """Whether every rank's reply (or a closed connection) is waiting."""
        return all(conn.poll(0) for conn in self._conns.values()) and self._thread.done.poll(0)

    def gather(self, what: str) -> list:
        self._doing = what
        try:
            replies = self._gather(what)
        except BaseException:
            self._broken = True
            raise
        self._doing = None
        return [replies[rank] for rank in range(self.world_size)]

    def _gather(self, what: str) -> dict:
        """Every rank's reply to the call in flight, waiting at most timeout_s (+ slack); a closed
        connection is WorkerLost at once, a failed rank raises once a peer's death had time to show."""
        deadline = time.monotonic() + self.timeout_s + SLACK_S
        replies, pending = {}, {conn: rank for rank, conn in self._conns.items()}
        local_done = False
        while pending or not local_done:
            waiting = list(pending) + ([] if local_done else [self._thread.done])
            for ready in wait(waiting, timeout=min(0.5, max(0.0, deadline - time.monotonic()))):
                if ready is self._thread.done:
                    replies[0], local_done = self._thread.take(), True
                else:
                    rank = pending.pop(ready)
                    replies[rank] = self._receive(rank, ready, what)
            failed = [rank for rank, (status, _) in sorted(replies.items()) if status != "ok"]
            if failed:
                self._raise_failure(failed[0], replies[failed[0]], pending, what)
            self._frozen.raise_if_hung(sorted(pending.values()), what, hung_after_s(self.timeout_s))
            if time.monotonic() > deadline:
                silent = sorted(pending.values()) or [0]
                raise self._lost(silent[0], f"{rank_label(silent[0], self.pipe)} did not answer {what} within "
                                            f"{self.timeout_s:.0f} s", closed=False)
        return {rank: value for rank, (_, value) in replies.items()}

    def _receive(self, rank: int, conn: Connection, what: str):
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            raise self._lost(rank, what) from None
        self.bytes_exchanged += len(data)
        return pickle.loads(data)

    def _raise_failure(self, rank: int, reply: tuple, pending: dict, what: str) -> None:
        status, value = reply
        if status == "refused":  # a ValueError, so the CLI prints it as one `error:` line
            raise ValueError(f"rank {rank} refused to start: {value}")
        if status == "fault":  # a write the disk refused: the run stops with one line
            raise value
        # A peer's death often surfaces first as this rank's failed receive: name the cause.
        for ready in wait(list(pending), timeout=_GRACE_S):
            self._receive(pending.pop(ready), ready, what)
        self._frozen.raise_if_hung(sorted(pending.values()), what, None)  # a frozen peer: the cause of its timeout
        raise RuntimeError(f"rank {rank} failed during {what}:\n{value}")

    def _lost(self, rank: int, what: str, *, closed: bool = True) -> WorkerLost:
        """WorkerLost naming `rank`; from here on torchrun's SIGTERM waits for the run to say so itself."""
        self._broken = True
        if _in_main_thread():
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if not closed:
            return WorkerLost(rank, what)
        return WorkerLost(rank, f"{rank_label(rank, self.pipe)} ended during {what} (its control connection "
                                "closed)")

    def _on_sigterm(self, signum, frame) -> None:
        """torchrun's agent stops this rank because another one ended (or the job was cancelled): say
        which, in one line, and end at once."""
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        lost = self._closed_rank()
        doing = f" during {self._doing}" if self._doing else ""
        if lost is not None:
            line = f"{rank_label(lost, self.pipe)} was lost{doing}: its process ended, and torchrun stopped the others"
        else:
            line = f"rank 0 was stopped by SIGTERM{doing}: torchrun stops every rank once one ends, or the job was " \
                   "cancelled"
        print(f"error: {line}", file=sys.stderr, flush=True)
        self._close_ranks(clean=False)
        exit_now(1)

    def _closed_rank(self) -> int | None:
        """The first rank whose connection has closed (its EOF is there before torchrun's agent sees it
        end), waiting up to _GRACE_S; None if every rank is still connected."""
        deadline = time.monotonic() + _GRACE_S
        rank_of = {conn: rank for rank, conn in self._conns.items()}
        while rank_of and time.monotonic() < deadline:
            for ready in sorted(wait(list(rank_of), timeout=0.1), key=rank_of.get):
                try:
                    ready.recv_bytes()  # a reply to the call in flight: that rank is alive
                except (EOFError, OSError):
                    return rank_of[ready]
        return None

    def _close_ranks(self, clean: bool) -> None:
        """Ask every rank to end: `clean` ones close their worker and reply, the others end at once."""
        for conn in self._conns.values():
            try:
                _send(conn, ("close", (clean,)))
            except OSError:
                pass

    def restart(self, rank_kwargs: list[dict] | None = None) -> None:
        raise RuntimeError("torchrun's processes are restarted by torchrun (torchrun --max-restarts), not from "
                           "inside the job")

    def stop_ranks(self) -> None:
        raise RuntimeError("torchrun's processes are stopped and started by torchrun, not from inside the job")

    def stop(self, graceful: bool = True) -> None:
        """Close every rank; after a failed call (ranks may be blocked on a lost peer) without waiting."""
        if self._stopped:
            return
        self._stopped = True
        clean = graceful and not self._broken and self._thread is not None
        self._close_ranks(clean)
        if clean:  # each rank closes its worker and replies; rank 0's worker closes last
            deadline, closing = time.monotonic() + 10.0, list(self._conns.values())
            while closing and time.monotonic() < deadline:
                for conn in wait(closing, timeout=max(0.0, deadline - time.monotonic())):
                    closing.remove(conn)
                    try:
                        conn.recv_bytes()
                    except (EOFError, OSError):
                        pass
            self._thread.submit("close", ())
            wait([self._thread.done], timeout=10.0)
        for conn in self._conns.values():
            conn.close()
        if clean and self._sigterm_before is not None and _in_main_thread():
            signal.signal(signal.SIGTERM, self._sigterm_before)


class _RankServer:
    """A rank > 0: executes rank 0's calls on its worker thread until rank 0 closes it."""

    def __init__(self, env: TorchrunEnv, pipe, conn: Connection) -> None:
        self.env, self.pipe, self.conn = env, pipe, conn
        self.thread = WorkerThread(f"attnres-pp-rank{env.rank}")
        self.ending = False
        self.doing = "between calls"
        signal.signal(signal.SIGTERM, self._on_sigterm)

    def serve(self) -> int:
        while True:
            if not self.conn.poll(self.pipe.timeout_s + SLACK_S):
                self._driver_lost(f"sent nothing for {self.pipe.timeout_s + SLACK_S:.0f} s")
            method, args = self._read()
            if method == "close":
                return self._close(clean=args[0])
            self.doing = f"while rank {self.env.rank} ran {method}"
            self.thread.submit(method, args)
            self._await_call(method)
            try:
                _send(self.conn, self.thread.take())
            except OSError:
                self._driver_lost("ended (its control connection closed)")
            self.doing = "between calls"

    def _await_call(self, method: str) -> None:
        """Wait for the call in flight. Rank 0 sends nothing meanwhile but its abort (a close: it gave up
        on the call and says why itself) or, dying, its EOF; it gives up after timeout_s + slack, so a
        call still running well past that is this rank's own to report."""
        limit_s = self.pipe.timeout_s + 2 * SLACK_S
        ready = wait([self.conn, self.thread.done], timeout=limit_s)
        if self.thread.done in ready:
            return
        if ready:
            self._read()
            exit_now(1)
        print(f"error: rank {self.env.rank}: its {method} did not finish within {limit_s:.0f} s and rank 0 did "
              "not stop it", file=sys.stderr, flush=True)
        exit_now(1)

    def _read(self) -> tuple:
        try:
            return pickle.loads(self.conn.recv_bytes())
        except (EOFError, OSError):
            self._driver_lost("ended (its control connection closed)")

    def _close(self, clean: bool) -> int:
        if not clean:
            exit_now(1)
        self.thread.submit("close", ())
        wait([self.thread.done], timeout=10.0)
        try:
            _send(self.conn, ("ok", None))
        except OSError:
            pass
        return 0

    def _driver_lost(self, how: str) -> NoReturn:
        """Rank 0 is gone: rank 1 says so in one line (the others end quietly), and the rank ends."""
        self.ending = True
        if self.env.rank == 1:
            print(f"error: {rank_label(0, self.pipe)}, which drives the run, was lost {self.doing}: it {how}; "
                  "every rank stops", file=sys.stderr, flush=True)
        exit_now(1)

    def _on_sigterm(self, signum, frame) -> None:
        """torchrun stops this rank: rank 0 names the lost rank itself, so wait up to 2 s for its word
        (a close) or its end (then rank 0 is the lost one), and end."""
        if self.ending:  # the line, if any, is being written: the rank ends in a moment
            return
        if self.conn.poll(2.0):
            try:
                self.conn.recv_bytes()
            except (EOFError, OSError):
                self._driver_lost("ended (its control connection closed)")
        exit_now(1)


def serve_rank(env: TorchrunEnv, pipe) -> int:
    """The body of every rank > 0: connect to rank 0 and serve its calls; returns the exit code."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches every process; rank 0 stops the run
    try:
        conn = connect_to_driver(env, pipe.timeout_s)
    except DriverEnded as ended:
        return ended.code
    except ControlError as error:
        if env.rank == 1:
            print(f"error: rank {env.rank}: {error}", file=sys.stderr, flush=True)
        return 1
    return _RankServer(env, pipe, conn).serve()


def run_torchrun_rank(env: TorchrunEnv, drive, read_config) -> int:
    """`attnres-pp train` in a process torchrun started: rank 0 runs `drive()` (the command itself),
    the others serve it. `read_config()` is the run's RunConfig (ValueError for a bad one, which
    rank 0's run reports in one line while the others end quietly with the same exit code 2)."""
    try:
        pipe = read_config().pipeline
        refusal = env.refusal(pipe)
    except ValueError:
        pipe, refusal = None, None
    if env.rank != 0:
        return 2 if pipe is None or refusal is not None else serve_rank(env, pipe)
    if refusal is not None:
        print(f"error: {refusal}", file=sys.stderr, flush=True)
        code = 2
    else:
        try:
            code = drive()
        except WorkerLost as lost:  # a rank lost while the engine started (later ones end the run in the loop)
            print(f"error: {lost}", file=sys.stderr, flush=True)
            exit_now(1)
        except Exception:  # reported as any launcher's driver reports it, then ended (see exit_now)
            traceback.print_exc()
            exit_now(1)
    if env.world_size > 1:
        note_early_exit(env, code, 5.0)  # the ranks wait for a channel that rank 0 never opened
    if code:
        exit_now(code)
    return code
