"""`--launcher inprocess`: a `RankGroup` (`rank_group`) whose ranks are threads of this process,
for debugging and fast tests.

Every rank has a thread of its own for the group's life, and each call runs every rank's worker
method on its rank's thread, so collectives between ranks (`mesh.ThreadCollectives`) block as they do
between processes. Pipeline hops go over the loopback transport (one mailbox per replica and tp rank)
and the ranks take turns action by action: a worker hands its started runtime to
`ThreadPeers.run_together`, and once every rank has, the ranks of each lane (those of one tp rank;
every rank at T = 1; under expert parallelism also of one ep rank) pass one turn between them,
each running its own next action when the turn is its (`loopback.next_turn`: a receive runs only
once its message is in the mailbox, the unit-step execution the validator proves deadlock-free).
With NCCL's rules each replica's loopback enforces them (`loopback_nccl`: in-order matching,
rendezvous sends) and the runtimes issue their messages in NCCL's order, so a schedule that
would hang on NCCL hangs here, on the CPU.

Under tensor parallelism (T > 1) the ranks also join a threaded torch.distributed process group
(`threaded_process_group`) and its ("dp", "pp", "tp") device mesh, over whose tp axis DTensor splits
their layers, as rank processes do over gloo. The T lanes run side by side: the T ranks of a chunk
take the same turns in the same order (their mailboxes fill alike), so they meet in every tp
collective of an action. A thread's process groups are its own, which is why a rank's calls all run
on its own thread.

Nothing crosses a process boundary; `bytes_exchanged` counts what the same requests and replies
measure pickled, the bytes the local launcher's pipes would carry.
"""

from __future__ import annotations

import pickle
import queue
import threading
import time
import weakref

import torch

from attnres_pp.comm.transport import ByteLedger, LoopbackTransport
from attnres_pp.launch.rank_group import RankGroupBase
from attnres_pp.launch.storage_fault import find_storage_fault
from attnres_pp.launch.threaded_process_group import ThreadedWorld
from attnres_pp.pipeline.loopback import next_turn
from attnres_pp.pipeline.loopback_nccl import NcclLoopbackTransport
from attnres_pp.pipeline.mesh import MeshCollectives, RankCoords, thread_collectives
from attnres_pp.schedule.validate_nccl import NcclP2P


class _Turns:
    """One `run_together`: the runtimes by rank, and whose turn it is in each lane (a position in the
    lane, None once the lane has finished)."""

    def __init__(self, runtimes: list, lanes: list[list[int]], what: str) -> None:
        self.runtimes, self.lanes, self.what = runtimes, lanes, what
        self.place = {rank: (lane, position) for lane, ranks in enumerate(lanes) for position, rank in enumerate(ranks)}
        self.turn = [self.next(lane, -1) for lane in range(len(lanes))]
        self.moved_at = [time.monotonic()] * len(lanes)
        self.failed: tuple[int, BaseException] | None = None

    def next(self, lane: int, last: int) -> int | None:
        return next_turn([self.runtimes[rank] for rank in self.lanes[lane]], last, self.what)


class ThreadPeers:
    """Where the rank threads of one group meet outside collectives: running their runtimes together
    in turns, and handing values to rank 0 (one process writes one checkpoint for all of them).
    `lanes`: the ranks that take turns with each other, each lane in turn order."""

    def __init__(self, world_size: int, timeout_s: float, lanes: list[list[int]] | None = None) -> None:
        self.world_size, self.timeout_s = world_size, timeout_s
        self.lanes = lanes or [list(range(world_size))]
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
        """Every rank's started runtime to its end (without `finish_step`), taking turns within its lane;
        each rank runs its own actions, on its own thread. A lane whose turn does not pass within
        timeout_s raises, as does every rank once one fails."""
        turns = self._meet(rank, runtime, lambda runtimes: _Turns(runtimes, self.lanes, what))
        lane, position = turns.place[rank]

        def my_turn() -> bool:
            return turns.turn[lane] in (position, None) or turns.failed is not None or self._aborted is not None

        while True:
            with self._cond:
                while not my_turn():
                    left = turns.moved_at[lane] + self.timeout_s - time.monotonic()
                    if left <= 0:
                        raise RuntimeError(f"in-process ranks' {what} did not move within {self.timeout_s:.0f} s")
                    self._cond.wait(left)
                if turns.failed is not None:
                    raise RuntimeError(f"rank {rank} stopped: rank {turns.failed[0]} failed ({turns.failed[1]})")
                if self._aborted is not None:
                    raise RuntimeError(f"rank {rank} stopped: another rank failed ({self._aborted})")
                if turns.turn[lane] is None:
                    return
            try:
                runtime.run_next()
                with self._cond:
                    turns.turn[lane] = turns.next(lane, position)
                    turns.moved_at[lane] = time.monotonic()
                    self._cond.notify_all()
            except BaseException as error:
                with self._cond:
                    turns.failed = (rank, error)
                    self._cond.notify_all()
                raise

    def gather(self, rank: int, value) -> list | None:
        """Every rank's `value`, in rank order, on rank 0; None on the others."""
        values = self._meet(rank, value, lambda values: values)
        return values if rank == 0 else None

    def abort(self, error: BaseException) -> None:
        """Wake every waiting rank with an error: a rank failed and will not arrive."""
        with self._cond:
            self._aborted = error
            self._cond.notify_all()


class _InFlight:
    """One call handed to the rank threads: each rank's result, the errors in the order they were
    raised, and how many ranks are still running it (under `done`)."""

    def __init__(self, world_size: int) -> None:
        self.results: list = [None] * world_size
        self.errors: list[tuple[int, BaseException]] = []
        self.remaining = world_size
        self.done = threading.Condition()


class _RankThread:
    """One rank's thread: runs the jobs handed to it, in order, until `stop`."""

    def __init__(self, name: str) -> None:
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            job()
            del job  # an idle thread holds no reference to its group (see `_end_threads`)

    def stop(self) -> None:
        self.jobs.put(None)


def _end_threads(threads: list[_RankThread]) -> None:
    """Tell each rank thread to end once its jobs are done, and wait a little for those that can."""
    for thread in threads:
        thread.stop()
    for thread in threads:
        if thread.thread is not threading.current_thread():
            thread.thread.join(timeout=5.0)


class ThreadRankGroup(RankGroupBase):
    """Every rank a worker in this process, on a thread of its own; rank r is
    `mesh.RankCoords(r, replicas, stages, tensor_parallel)`. `nccl_rules`: each replica's loopback
    enforces NCCL's point-to-point rules. `ledger`, if given, records every rank's hops (else each
    transport keeps its own)."""

    one_process = True

    def __init__(self, world_size: int, *, stages: int, timeout_s: float, tensor_parallel: int = 1,
                 nccl_rules: bool = False, ledger: ByteLedger | None = None, expert_parallel: int = 1) -> None:
        super().__init__(world_size, timeout_s)
        self.stages, self.tensor_parallel, self.expert_parallel = stages, tensor_parallel, expert_parallel
        self.nccl_rules, self.ledger = nccl_rules, ledger
        self.workers: list = []
        self._in_flight: _InFlight | None = None  # `send`'s call, until `gather`
        self._threads: list[_RankThread] = []
        self._world: ThreadedWorld | None = None  # the threaded process group, under tensor parallelism

    def start(self, worker_cls: type, rank_kwargs: list[dict], *, device: str = "cpu") -> list:
        self._worker = (worker_cls, rank_kwargs, device)
        t = self.tensor_parallel
        replicas = self.world_size // (self.stages * t)
        coords = [RankCoords(rank, replicas, self.stages, t, self.expert_parallel) for rank in range(self.world_size)]
        self.workers = [worker_cls(**kwargs) for kwargs in rank_kwargs]
        collectives = thread_collectives(replicas, self.stages, self.timeout_s, t, self.expert_parallel)
        self.peers = ThreadPeers(self.world_size, self.timeout_s, self._lanes())
        # One loopback per replica and tp rank (a hop pairs (d, p, t) with (d, p + 1, t)): a mailbox
        # (gloo's rules) or an NCCL point-to-point model.
        fabrics = {(c.dp_rank, c.tp_rank): NcclP2P(self.stages) if self.nccl_rules else {} for c in coords}
        transports = [(NcclLoopbackTransport if self.nccl_rules else LoopbackTransport)(
            c.pp_rank, fabrics[(c.dp_rank, c.tp_rank)], self.ledger) for c in coords]
        self._threads = [_RankThread(f"attnres-pp-rank{rank}") for rank in range(self.world_size)]
        # A group dropped without `stop` (an engine never closed) ends its idle threads when collected.
        weakref.finalize(self, _end_threads, list(self._threads))
        if t > 1:
            self._world = ThreadedWorld(self.world_size, self.timeout_s)
        try:
            if self._world is not None:
                self._world.install()

            def join(worker, rank: int):
                tp_mesh = None
                if self._world is not None:  # the rank's own groups, on its own thread
                    self._world.join(rank)
                    tp_mesh = MeshCollectives(coords[rank], "cpu").mesh["tp"]
                return worker.join_threads(torch.device(device), transports[rank], collectives[rank], self._peers_of(),
                                           tp_mesh=tp_mesh)

            self.setup_results = self._in_threads(lambda worker, args: join(worker, *args),
                                                  [(rank,) for rank in range(self.world_size)], "setup")
        except BaseException:
            self.stop(graceful=False)
            raise
        return self.setup_results

    def _lanes(self) -> list[list[int]]:
        """The ranks of each tp rank and ep rank, in rank order: they take turns with each other. The
        members of a tp group, or of an EP group (`pipeline.expert_parallel`), sit at the same place
        in lanes of the same shape, so they take the same turns and meet in their collectives."""
        t, ep = self.tensor_parallel, self.expert_parallel
        replicas = self.world_size // (self.stages * t)
        coords = [RankCoords(rank, replicas, self.stages, t, ep) for rank in range(self.world_size)]
        return [[c.rank for c in coords if (c.tp_rank, c.ep_rank) == (tp_rank, ep_rank)]
                for ep_rank in range(ep) for tp_rank in range(t)]

    def send(self, method: str, per_rank_args: list[tuple]) -> None:
        """The requests of `call` handed to the rank threads without waiting (`gather` collects them)."""
        self.bytes_exchanged += sum(len(pickle.dumps((method, args))) for args in per_rank_args)
        self._in_flight = self._launch(lambda worker, args: getattr(worker, method)(*args), per_rank_args)

    def replied(self) -> bool:
        """Whether `gather` would return or raise without waiting: every rank has finished, or one failed."""
        return self._in_flight.remaining == 0 or bool(self._in_flight.errors)

    def gather(self, what: str) -> list:
        """The results of the last `send`, in rank order (the first cause of a failure raised)."""
        in_flight, self._in_flight = self._in_flight, None
        results = self._wait(in_flight, what)
        self.bytes_exchanged += sum(len(pickle.dumps(result)) for result in results)
        return results

    def stop_ranks(self) -> None:
        """End the rank threads (`stop`); the group can `start` again."""
        self.stop(graceful=False)

    def _in_threads(self, fn, per_rank_args: list[tuple], what: str) -> list:
        """fn(worker, args) for every worker, each on its rank's thread (they meet in collectives)."""
        return self._wait(self._launch(fn, per_rank_args), what)

    def _launch(self, fn, per_rank_args: list[tuple]) -> _InFlight:
        """Hand fn(worker, args) to every rank's thread; a lone rank without a process group runs
        on the caller's thread (there is nobody to meet)."""
        in_flight = _InFlight(len(self.workers))

        def run(rank: int) -> None:
            try:
                in_flight.results[rank] = fn(self.workers[rank], per_rank_args[rank])
            except BaseException as error:  # noqa: BLE001  (re-raised by `_wait`, on the caller's thread)
                in_flight.errors.append((rank, error))
                self.peers.abort(error)
                if self._world is not None:  # ranks waiting for it in a tp collective
                    self._world.wake_blocked(error)
            finally:
                with in_flight.done:
                    in_flight.remaining -= 1
                    in_flight.done.notify_all()

        if len(self.workers) == 1 and self._world is None:
            run(0)
        else:
            for rank, thread in enumerate(self._threads):
                thread.jobs.put(lambda rank=rank: run(rank))
        return in_flight

    def _wait(self, in_flight: _InFlight, what: str) -> list:
        """The results of `in_flight` once every rank has finished, bounded by the pipeline timeout;
        a failure raises its first cause."""
        with in_flight.done:  # one bound for the call, not one per rank
            finished = in_flight.done.wait_for(lambda: in_flight.remaining == 0, self.timeout_s + 30.0)
        if not finished and self._world is not None:
            self._world.wake_blocked(RuntimeError(f"{what} timed out"))
            with in_flight.done:
                in_flight.done.wait_for(lambda: in_flight.remaining == 0, 5.0)
        if in_flight.errors or not finished:
            if self._world is not None:
                self._world.clear_wake()
            self.peers = self._fresh_peers()
        if in_flight.errors:
            # A refusal (ValueError, lowest rank first) is the cause, then a write the disk refused;
            # otherwise the first error raised, since the others follow from it (`ThreadPeers.abort`).
            refusals = sorted((rank, error) for rank, error in in_flight.errors if isinstance(error, ValueError))
            faults = [(rank, fault) for rank, error in sorted(in_flight.errors, key=lambda item: item[0])
                      if (fault := find_storage_fault(error)) is not None]
            raise (refusals or faults or in_flight.errors)[0][1]
        if not finished:
            raise RuntimeError(f"in-process ranks did not finish {what} within {self.timeout_s:.0f} s")
        return in_flight.results

    def _peers_of(self) -> ThreadPeers | None:
        """What a worker meets its peers through: the group's `peers`; None for a lone rank, which has
        nobody to take turns with or hand its checkpoint to (it runs and saves as a rank process does)."""
        return self.peers if self.world_size > 1 else None

    def _fresh_peers(self) -> ThreadPeers:
        """After a failed call the old meeting point is aborted: the workers meet at a new one."""
        peers = ThreadPeers(self.world_size, self.timeout_s, self._lanes())
        self.peers = peers
        for worker in self.workers:
            worker.peers = self._peers_of()
        return peers

    def stop(self, graceful: bool) -> None:
        """End the rank threads; under tensor parallelism each leaves its process group first, and the
        threaded process group is uninstalled (also after a failure). Safe to call twice."""
        try:
            if self._world is not None and self._world.installed and self._threads:
                try:
                    self._in_threads(lambda worker, args: ThreadedWorld.leave(), [()] * self.world_size,
                                     "leaving the process group")
                except Exception:  # noqa: BLE001  (a failed rank's groups go with its thread)
                    pass
        finally:
            _end_threads(self._threads)
            self._threads = []
            if self._world is not None:
                self._world.uninstall()
                self._world = None
