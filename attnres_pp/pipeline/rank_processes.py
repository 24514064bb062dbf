"""One spawned process per rank, each answering (method, args) requests over a pipe: the process
side of the local launcher (and of the torch.distributed.pipelining peer benchmark).

The ranks rendezvous through a file in a temporary folder (no port hunting). Every wait is bounded:
the driver polls with a deadline and checks that every process is alive, so a dead rank becomes
WorkerLost naming it. Rank processes ignore Ctrl-C: the driver, which receives it too, stops them.
"""

from __future__ import annotations

import multiprocessing as mp
import shutil
import signal
import tempfile
import time
import traceback
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler

from attnres_pp.pipeline.errors import WorkerLost


def serve(make_worker: Callable, conn) -> None:
    """Rank-process body: build the worker (its setup result is the first reply; a ValueError in the
    setup is ("refused", its one-line message)), then answer requests with ("ok", result) or
    ("error", traceback) until "close", which closes the worker."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        worker, setup_result = make_worker()
        conn.send(("ok", setup_result))
    except ValueError as error:  # a setting or resource this rank refuses, said in one line (no room in /dev/shm)
        conn.send(("refused", " ".join(str(error).split())))
        return
    except Exception:  # report any setup failure to the driver rather than dying silently
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        method, args = conn.recv()
        if method == "close":
            worker.close()
            conn.send(("ok", None))
            return
        try:
            conn.send(("ok", getattr(worker, method)(*args)))
        except Exception:  # the driver raises it with the rank's traceback
            conn.send(("error", traceback.format_exc()))


class RankProcesses:
    """`target(pp_rank, init_method, world_size, conn, *extra_args[pp_rank])` in one spawned process
    per rank; `target` is expected to call `serve`. The setup replies are in `setup_results`."""

    def __init__(self, target: Callable, n_ranks: int, timeout_s: float, *, name: str,
                 extra_args: list[tuple] | None = None) -> None:
        self.timeout_s = timeout_s
        self.bytes_exchanged = 0  # pickled requests and replies through the pipes, both directions
        self.conns, self.procs = [], []
        self._rendezvous_dir = tempfile.mkdtemp(prefix=f"{name}-rdzv-")
        init_method = f"file://{self._rendezvous_dir}/rendezvous"
        ctx = mp.get_context("spawn")
        try:
            for rank in range(n_ranks):
                parent, child = ctx.Pipe()
                args = (rank, init_method, n_ranks, child, *(extra_args[rank] if extra_args else ()))
                proc = ctx.Process(target=target, name=f"{name}-rank{rank}", daemon=True, args=args)
                proc.start()
                self.conns.append(parent)
                self.procs.append(proc)
            self.setup_results = self.gather("setup")
        except BaseException:
            self.stop(graceful=False)
            raise

    def gather(self, what: str) -> list:
        """Each rank's next reply, waiting at most timeout_s (+ start-up slack) for each."""
        results = []
        deadline = time.monotonic() + self.timeout_s + 30.0
        for rank, conn in enumerate(self.conns):
            while not conn.poll(0.2):
                # Any dead rank ends the wait: the others may be blocked on it until their timeout.
                self._raise_if_a_rank_died(what)
                if time.monotonic() > deadline:
                    raise WorkerLost(rank, f"rank {rank} did not answer {what} within {self.timeout_s:.0f} s")
            try:
                message = conn.recv_bytes()
                self.bytes_exchanged += len(message)
                status, value = ForkingPickler.loads(message)
            except EOFError:
                raise WorkerLost(rank, f"rank {rank} closed its pipe during {what}") from None
            if status == "refused":  # a ValueError, so the CLI prints it as one `error:` line
                raise ValueError(f"rank {rank} refused to start: {value}")
            if status == "error":
                # A peer's death often surfaces first as this rank's failed receive: name the cause.
                time.sleep(0.5)
                self._raise_if_a_rank_died(what, f"\nrank {rank} then failed with:\n{value}")
                raise RuntimeError(f"rank {rank} failed during {what}:\n{value}")
            results.append(value)
        return results

    def _raise_if_a_rank_died(self, what: str, detail: str = "") -> None:
        for rank, proc in enumerate(self.procs):
            if not proc.is_alive():
                raise WorkerLost(rank, f"rank {rank} exited (code {proc.exitcode}) during {what}{detail}")

    def call(self, method: str, args_by_rank: list[tuple]) -> list:
        for conn, args in zip(self.conns, args_by_rank, strict=True):
            # What conn.send does, with the bytes counted (`bytes_exchanged`).
            message = ForkingPickler.dumps((method, args))
            self.bytes_exchanged += len(message)
            conn.send_bytes(message)
        return self.gather(method)

    def call_all(self, method: str) -> list:
        return self.call(method, [()] * len(self.procs))

    def stop(self, graceful: bool) -> None:
        """graceful: ask each live rank to close (leave the process group) first; else terminate."""
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
