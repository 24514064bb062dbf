"""`--launcher inprocess`: a `RankGroup` (see `rank_group`) whose ranks are threads of this process,
for debugging and fast tests.

Each call runs every rank's worker method in its own thread, so collectives between ranks
(`mesh.ThreadCollectives`) block as they do between processes. Pipeline hops go over the loopback
transport (one mailbox per replica) and the ranks take turns action by action: a worker hands its
started runtime to `ThreadPeers.run_together`, and once every rank has, one thread runs them all in
turns (`loopback.run_in_turns`: a receive runs only once its message is in the mailbox, the
unit-step execution the validator proves deadlock-free). With NCCL's rules each replica's loopback
enforces them (`loopback_nccl`: in-order matching, rendezvous sends) and the runtimes issue their
messages in NCCL's order, so a schedule that would hang on NCCL hangs here, on the CPU.

Nothing crosses a process boundary; `bytes_exchanged` counts what the same requests and replies
measure pickled, the bytes the local launcher's pipes would carry.
"""

from __future__ import annotations

import pickle
import threading
import time

import torch

from attnres_pp.comm.transport import ByteLedger, LoopbackTransport
from attnres_pp.pipeline.loopback import run_in_turns
from attnres_pp.pipeline.loopback_nccl import NcclLoopbackTransport
from attnres_pp.pipeline.mesh import thread_collectives
from attnres_pp.schedule.validate_nccl import NcclP2P


class ThreadPeers:
    """Where the rank threads of one group meet outside collectives: running their runtimes together
    in turns, and handing values to rank 0 (one process writes one checkpoint for all of them)."""

    def __init__(self, world_size: int, timeout_s: float) -> None:
        self.world_size, self.timeout_s = world_size, timeout_s
        self._cond = threading.Condition()
        self._round, self._arrived, self._outcome = 0, {}, {}
        self._aborted: BaseException | None = None

    def _meet(self, rank: int, value, last):
        """Deposit `value`; the last rank to arrive runs `last(values in rank order)`. Every rank gets
        its outcome (an error raised by `last` is raised on every rank)."""
        with self._cond:
            if self._aborted is not None:
                raise RuntimeError(f"rank {rank} stopped: another rank failed ({self._aborted})")
            this_round = self._round
            self._arrived[rank] = value
            if len(self._arrived) == self.world_size:
                values = [self._arrived[r] for r in range(self.world_size)]
                try:
                    self._outcome[this_round] = (last(values), None)
                except BaseException as error:  # noqa: BLE001  (raised on every rank below)
                    self._outcome[this_round] = (None, error)
                self._arrived, self._round = {}, this_round + 1
                self._cond.notify_all()
            elif not self._cond.wait_for(lambda: self._round != this_round or self._aborted is not None,
                                         self.timeout_s):
                raise RuntimeError(f"in-process ranks did not meet within {self.timeout_s:.0f} s")
            if self._aborted is not None and self._round == this_round:
                raise RuntimeError(f"rank {rank} stopped: another rank failed ({self._aborted})")
            result, error = self._outcome[this_round]
        if error is not None:
            raise error
        return result

    def run_together(self, rank: int, runtime, what: str) -> None:
        """Every rank's started runtime to its end (without `finish_step`), taking turns."""
        self._meet(rank, runtime, lambda runtimes: run_in_turns(runtimes, what))

    def gather(self, rank: int, value) -> list | None:
        """Every rank's `value`, in rank order, on rank 0; None on the others."""
        values = self._meet(rank, value, lambda values: values)
        return values if rank == 0 else None

    def abort(self, error: BaseException) -> None:
        """Wake every waiting rank with an error: a rank failed and will not arrive."""
        with self._cond:
            self._aborted = error
            self._cond.notify_all()


class ThreadRankGroup:
    """Every rank a worker in this process; rank r is replica r // stages, pipeline rank r % stages.
    `nccl_rules`: each replica's loopback enforces NCCL's point-to-point rules. `ledger`, if given,
    records every rank's hops (else each transport keeps its own)."""

    one_process = True
    spans_nodes = False
    where = "on this node"

    def __init__(self, world_size: int, *, stages: int, timeout_s: float, nccl_rules: bool = False,
                 ledger: ByteLedger | None = None) -> None:
        self.world_size, self.stages, self.timeout_s = world_size, stages, timeout_s
        self.nccl_rules, self.ledger = nccl_rules, ledger
        self.bytes_exchanged = 0
        self.workers: list = []
        self.setup_results: list = []
        self.rank_nodes: list[tuple[str, str]] = []
        self.lost_nodes: list[dict] = []
        self._worker: tuple[type, list[dict], str] | None = None

    def gpus(self) -> int | None:
        return None

    def start(self, worker_cls: type, rank_kwargs: list[dict], *, device: str = "cpu") -> list:
        self._worker = (worker_cls, rank_kwargs, device)
        replicas = self.world_size // self.stages
        self.workers = [worker_cls(**kwargs) for kwargs in rank_kwargs]
        collectives = thread_collectives(replicas, self.stages, self.timeout_s)
        self.peers = ThreadPeers(self.world_size, self.timeout_s)
        # One loopback per replica: a mailbox (gloo's rules) or an NCCL point-to-point model.
        fabrics = [NcclP2P(self.stages) if self.nccl_rules else {} for _ in range(replicas)]
        self.setup_results = []
        for rank, worker in enumerate(self.workers):
            dp_rank, pp_rank = divmod(rank, self.stages)
            transport = (NcclLoopbackTransport(pp_rank, fabrics[dp_rank], self.ledger) if self.nccl_rules
                         else LoopbackTransport(pp_rank, fabrics[dp_rank], self.ledger))
            self.setup_results.append(worker.join_threads(torch.device(device), transport, collectives[rank],
                                                          self.peers))
        return self.setup_results

    def call(self, method: str, per_rank_args: list[tuple], what: str | None = None) -> list:
        self.bytes_exchanged += sum(len(pickle.dumps((method, args))) for args in per_rank_args)
        results = self._in_threads(lambda worker, args: getattr(worker, method)(*args), per_rank_args, what or method)
        self.bytes_exchanged += sum(len(pickle.dumps(result)) for result in results)
        return results

    def call_all(self, method: str, *args, what: str | None = None) -> list:
        return self.call(method, [args] * self.world_size, what)

    def _in_threads(self, fn, per_rank_args: list[tuple], what: str) -> list:
        """fn(worker, args) for every worker, each in its own thread (they meet in collectives)."""
        if len(self.workers) == 1:
            return [fn(self.workers[0], per_rank_args[0])]
        results: list = [None] * len(self.workers)
        errors: list[BaseException] = []

        def run(rank: int) -> None:
            try:
                results[rank] = fn(self.workers[rank], per_rank_args[rank])
            except BaseException as error:  # noqa: BLE001  (re-raised below, on the caller's thread)
                errors.append(error)
                self.peers.abort(error)

        threads = [threading.Thread(target=run, args=(rank,), daemon=True) for rank in range(len(self.workers))]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + self.timeout_s + 30.0  # one bound for the call, not one per rank
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        if errors:
            self.peers = self._fresh_peers()
            raise errors[0]
        if any(thread.is_alive() for thread in threads):
            raise RuntimeError(f"in-process ranks did not finish {what} within {self.timeout_s:.0f} s")
        return results

    def _fresh_peers(self) -> ThreadPeers:
        """After a failed call the old meeting point is aborted: the workers meet at a new one."""
        peers = ThreadPeers(self.world_size, self.timeout_s)
        for worker in self.workers:
            worker.peers = peers
        return peers

    def restart(self, rank_kwargs: list[dict] | None = None) -> None:
        worker_cls, last_kwargs, device = self._worker
        self.start(worker_cls, rank_kwargs or last_kwargs, device=device)

    def stop(self, graceful: bool) -> None:
        """Nothing to release in one process."""
