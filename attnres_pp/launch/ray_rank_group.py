"""`--launcher ray`: a `RankGroup` (`rank_group`) of one Ray actor per rank, placed by a placement
group of one bundle per rank, or under tensor parallelism one per tp group of T ranks, which Ray then
keeps on one node whatever the strategy (`ray_checks.placement_bundles`); with `ray_actor` (each
rank's actor and the replies of its set-up), the only modules that start Ray, place actors or import
`ray`.

Each actor is a thin shell (`ray_actor.RankActor`) around the worker the group is given (training's
`StageWorker`, generation's `GenerationWorker`). Ray prefixes an actor's log lines with its repr,
the worker's class named as an actor: `(StageActor rank=0 (dp 0, pp 0) ...)`, with `, tp t` under
tensor parallelism (`actor_label`).

Where the actors run: `address` (or RAY_ADDRESS, which `ray job submit` sets for its driver) joins
that cluster, after checking that something listens there (`ray_checks.check_reachable`);
`address="auto"` joins the `ray start` cluster of this machine; otherwise a private local instance
is started (and stopped by `stop`), never an unrelated cluster found by accident. A placement no
node can hold is refused before the placement group is made (`ray_checks.check_placement`).

The process-group rendezvous follows Ray Train: rank 0 picks its node's address and a free port,
every actor binds its sockets to its node's interface (`stage_setup.bind_to_address`: without it
gloo may take a loopback address) and joins concurrently. A group that does not connect is
RendezvousError, one line naming every rank's address; a rank whose set-up raises ValueError is
`rank R refused to start: ...`. On GPUs each actor holds one, and the ranks of a node see all of
that node's (`ray_checks.node_gpu_views`). The driver's ATTNRES_PP_* settings reach every rank.

Every wait is bounded: results are collected as they arrive, so a dead actor is named (with its
node, and recorded in `lost_nodes`) as soon as Ray reports it, and the whole wait is capped by the
pipeline timeout. The surviving ranks, blocked on a lost one, are killed by `restart` or `stop`.
A rank whose process on the driver's node is stopped (frozen) is hung (`rank_group.RankHung`) once it
has been for `hung_after_s(timeout)`, or at once when a peer's task has failed meanwhile: the group
kills its process and raises RankHung, which the training loop restarts like a lost rank. A hung
rank on another node meets the step deadline (timeout + slack): WorkerLost naming it.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import time

from attnres_pp.launch.rank_group import RankGroupBase, RankHung, StoppedSince, hung_after_s
from attnres_pp.launch.ray_actor import RankActor, join_results
from attnres_pp.launch.ray_checks import (
    check_placement,
    check_reachable,
    node_gpu_views,
    placement_bundles,
    ranks_by_node,
    require_ray,
    where_rank,
)
from attnres_pp.launch.ray_watchdog import end_watchdog, keeping_sigterm_handler, watch_private_instance
from attnres_pp.launch.storage_fault import find_storage_fault
from attnres_pp.pipeline.config import PLACEMENTS
from attnres_pp.pipeline.errors import WorkerLost

# After one rank's task fails, how long to wait for Ray to report a dead peer that caused it: a lost
# host resets its TCP connections at once, but Ray declares its node dead only after missed health
# checks (3 s under attnres_lab/netns_host.py's settings, ~30 s under Ray's defaults).
_DEATH_GRACE_S = 10.0


LOOPBACK = "127.0.0.1"
# Ray's switch for clusters on one machine only (named for Windows and macOS, where it is the default):
# off, a node's address is loopback.
_CLUSTERS_OFF = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


@contextlib.contextmanager
def _loopback_only(ray):
    """A private local instance listens on 127.0.0.1 only, not on every interface of the machine.
    Ray 2.x turns `_node_ip_address="127.0.0.1"` into the machine's own address
    (services.resolve_ip_for_localhost) and its servers then listen on all interfaces, unless
    clusters are off (ray_constants.ENABLE_RAY_CLUSTER, from RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0):
    then the node's address is loopback and the GCS, raylet, workers and dashboard agent bind it.
    Ray's processes read the variable when they start (they inherit it from this one, and the
    workers from the raylet); this process has imported ray already, so its constant is set for the
    init and both are put back afterwards, so that a later join of a real cluster is unaffected."""
    from ray._private import ray_constants

    before_env, before_flag = os.environ.get(_CLUSTERS_OFF), ray_constants.ENABLE_RAY_CLUSTER
    os.environ[_CLUSTERS_OFF] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = before_flag
        if before_env is None:
            os.environ.pop(_CLUSTERS_OFF, None)
        else:
            os.environ[_CLUSTERS_OFF] = before_env


class RayRankGroup(RankGroupBase):
    """`world_size` actors placed with `placement` (STRICT_PACK, PACK, SPREAD), each tensor-parallel
    group of `tensor_parallel` consecutive ranks in one bundle, so on one node."""

    spans_nodes = True
    where = "in the Ray cluster"

    def __init__(self, world_size: int, timeout_s: float, *, address: str | None = None,
                 placement: str = "STRICT_PACK", cpus: int | None = None, tensor_parallel: int = 1) -> None:
        require_ray()  # before `import ray`: a missing package is one line, not a traceback
        import ray

        if placement not in PLACEMENTS:
            raise ValueError(f"placement={placement!r} is invalid: choose one of {', '.join(PLACEMENTS)}")
        super().__init__(world_size, timeout_s)
        self._ray = ray
        self.placement, self.tensor_parallel = placement, tensor_parallel
        self.actors, self._pg, self.started_ray, self._watchdog = [], None, False, None
        self._in_flight: tuple[list, int] | None = None  # `send`'s refs and request bytes
        self._stopped = StoppedSince([])  # the ranks' processes on the driver's node, watched for a freeze
        if not ray.is_initialized():
            source = "--address" if address else "RAY_ADDRESS"
            address = address or os.environ.get("RAY_ADDRESS")
            if address:
                check_reachable(address, source)
                try:
                    with keeping_sigterm_handler():  # the driver's SIGTERM stops the run, not Ray's exit
                        ray.init(address=address, log_to_driver=True)
                except ConnectionError as error:  # "auto" with no `ray start` cluster on this machine
                    raise ValueError(f"{source} {address}: {error}") from None
            else:
                # One CPU per rank even on a smaller machine: the ranks mostly wait on each other.
                with _loopback_only(ray), keeping_sigterm_handler():
                    ray.init(address="local", num_cpus=max(cpus or world_size, os.cpu_count() or 1),
                             include_dashboard=False,
                             log_to_driver=True, _node_ip_address=LOOPBACK)
                self.started_ray = True
                self._watchdog = watch_private_instance(ray)  # the instance ends with this process

    def driver_address(self) -> str:
        """The address of the driver's node as the cluster knows it (loopback on a private instance):
        where a server the driver runs for the ranks (torchft's Lighthouse) is reached from any node."""
        return self._ray.util.get_node_ip_address()

    def gpus(self) -> int:
        """The cluster's GPUs (0 with ATTNRES_PP_FORCE_CPU=1)."""
        if os.environ.get("ATTNRES_PP_FORCE_CPU") == "1":
            return 0
        return int(self._ray.cluster_resources().get("GPU", 0))

    def start(self, worker_cls: type, rank_kwargs: list[dict], *, device: str = "cpu") -> list:
        """Placement group, one actor per rank in its (tp group's) bundle, GPU views, rendezvous and
        process group."""
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._worker = (worker_cls, rank_kwargs, device)
        self._stopped = StoppedSince([])  # the last start's processes are gone (their pids may be reused)
        ray, world, use_gpu = self._ray, self.world_size, device == "cuda"
        bundles = placement_bundles(world, self.tensor_parallel, gpu=use_gpu)
        # A group no node can hold would wait out the whole timeout: refuse it now, saying why.
        check_placement(bundles, self.placement, [n["Resources"] for n in ray.nodes() if n["Alive"]],
                        ranks_per_bundle=self.tensor_parallel)
        self._pg = placement_group(bundles, strategy=self.placement)
        ready, _ = ray.wait([self._pg.ready()], timeout=self.timeout_s)
        if not ready:
            raise RuntimeError(
                f"Ray could not place {len(bundles)} bundles of {bundles[0]} with {self.placement} within "
                f"{self.timeout_s:.0f} s: the cluster has {ray.cluster_resources()}; add resources or use "
                "--placement PACK/SPREAD for several nodes"
            )
        # Each actor takes one rank's share of its bundle (a tp group's T actors share theirs).
        actor_cls = ray.remote(num_cpus=1, num_gpus=1 if use_gpu else 0, max_restarts=0)(RankActor)
        rank_bundles = ranks_by_node(ray.util.placement_group_table(self._pg)["bundles_to_node_id"], len(bundles),
                                     self.tensor_parallel)
        # The driver's ATTNRES_PP_* settings (ATTNRES_PP_SHM, ATTNRES_PP_SOCKET_IFNAME, ...) hold for
        # its ranks too, on whichever node they run.
        env_vars = {k: v for k, v in os.environ.items() if k.startswith("ATTNRES_PP_")}
        runtime_env = {"runtime_env": {"env_vars": env_vars}} if env_vars else {}
        self.actors = [
            actor_cls.options(**runtime_env, scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self._pg, placement_group_bundle_index=rank_bundles[rank])).remote(
                    worker_cls, rank_kwargs[rank])
            for rank in range(world)
        ]
        self.rank_nodes = self._get([a.node.remote() for a in self.actors], "node lookup")
        if use_gpu:  # each rank its own GPU, seeing its node's others
            gpus = self._get([a.gpu_ids.remote() for a in self.actors], "GPU lookup")
            views = node_gpu_views([node_id for node_id, _ip in self.rank_nodes], gpus)
            self._get([a.see_node_gpus.remote(*view) for a, view in zip(self.actors, views, strict=True)],
                      "GPU set-up")
        host, port = self._get([self.actors[0].master_address.remote()], "rendezvous")[0]
        init_method = f"tcp://{host}:{port}"
        self.setup_results = join_results([a.join_process_group.remote(init_method, world) for a in self.actors],
                                          init_method, self.timeout_s, self.rank_nodes)
        here = ray.get_runtime_context().get_node_id()
        self._stopped = StoppedSince([d.get("pid") if node_id == here else None
                                      for d, (node_id, _ip) in zip(self.setup_results, self.rank_nodes, strict=True)])
        return self.setup_results

    def send(self, method: str, per_rank_args: list[tuple]) -> None:
        """The requests of `call` without waiting for the results (`gather` collects them). Arguments
        shared by several ranks (the same object) go to the object store once."""
        shared, refs, sent = {}, [], 0
        for actor, args in zip(self.actors, per_rank_args, strict=True):
            sent += len(pickle.dumps(args))
            args = tuple(self._shared(arg, per_rank_args, shared) for arg in args)
            refs.append(actor.call.remote(method, *args))
        self._in_flight = (refs, sent)

    def replied(self) -> bool:
        """Whether `gather` would return or raise at once: every result is in, or one failed."""
        refs = self._in_flight[0]
        ready, _ = self._ray.wait(refs, num_returns=len(refs), timeout=0)
        if len(ready) == len(refs):
            return True
        for ref in ready:
            try:
                self._ray.get(ref, timeout=0)
            except Exception:  # a dead actor or a failed task: `gather` names it
                return True
        return False

    def gather(self, what: str) -> list:
        """The results of the last `send`, in rank order (WorkerLost or RuntimeError as `call`)."""
        refs, sent = self._in_flight
        self._in_flight = None
        results = self._get(refs, what)
        # What Ray serialises for these calls: their arguments and results, pickled.
        self.bytes_exchanged += sent + sum(len(pickle.dumps(r)) for r in results)
        return results

    def stop_ranks(self) -> None:
        """Kill this group's actors and free its placement group; the Ray instance stays up."""
        self._in_flight = None
        self._stop_actors()

    def _shared(self, arg, per_rank_args: list[tuple], shared: dict):
        if isinstance(arg, dict) and arg and sum(any(a is arg for a in args) for args in per_rank_args) > 1:
            if id(arg) not in shared:
                shared[id(arg)] = self._ray.put(arg)
            return shared[id(arg)]
        return arg

    def _get(self, refs: list, what: str) -> list:
        """The results of `refs` (one per rank, in rank order), waiting at most the pipeline timeout.
        A dead actor becomes WorkerLost naming its rank as soon as Ray reports it."""
        ray = self._ray
        deadline = time.monotonic() + self.timeout_s + 30.0
        pending = list(refs)
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                silent = min(refs.index(ref) for ref in pending)
                raise WorkerLost(silent, f"{where_rank(self.rank_nodes, silent)} did not finish {what} within "
                                         f"{self.timeout_s:.0f} s")
            ready, pending = ray.wait(pending, num_returns=1, timeout=min(remaining, 1.0))
            for ref in ready:
                self._raise_if_failed(refs, refs.index(ref), what)
            self._raise_if_hung([refs.index(ref) for ref in pending], what, hung_after_s(self.timeout_s))
        return ray.get(refs)

    def _raise_if_hung(self, silent: list[int], what: str, limit_s: float | None) -> None:
        """RankHung for a `silent` rank whose process on this node is stopped (`StoppedSince`), killed."""
        try:
            self._stopped.raise_if_hung(silent, what, limit_s)
        except RankHung as frozen:
            self._note_lost(frozen.pp_rank, what)
            raise

    def _raise_if_failed(self, refs: list, rank: int, what: str) -> None:
        ray = self._ray
        try:
            ray.get(refs[rank], timeout=self.timeout_s)
        except ray.exceptions.RayActorError as error:
            self._note_lost(rank, what)
            raise WorkerLost(rank, f"{where_rank(self.rank_nodes, rank)} stopped answering (its actor died) during "
                                   f"{what}: {error}") from error
        except ray.exceptions.RayTaskError as error:
            fault = find_storage_fault(error)
            if fault is not None:  # a write the disk refused: the cause, whatever the peers do next
                raise fault from None
            # A peer's death often shows first as this rank's failed receive: name the dead one.
            others = [ref for r, ref in enumerate(refs) if r != rank]
            ready, _ = ray.wait(others, num_returns=len(others), timeout=_DEATH_GRACE_S) if others else ([], [])
            for ref in ready:
                try:
                    ray.get(ref, timeout=1.0)
                except ray.exceptions.RayActorError:
                    dead = refs.index(ref)
                    self._note_lost(dead, what)
                    raise WorkerLost(dead, f"{where_rank(self.rank_nodes, dead)} stopped answering (its actor died) "
                                           f"during {what}") from error
                except Exception:  # another rank's own failure: the first one is reported below
                    pass
            # A peer frozen on this node: its silence is the cause, this rank's timeout its consequence.
            self._raise_if_hung([r for r, ref in enumerate(refs) if ref not in ready and r != rank], what, None)
            raise RuntimeError(f"rank {rank} failed during {what}:\n{error}") from error

    def _note_lost(self, rank: int, what: str) -> None:
        """Each lost rank, its node and when (summary.json's `lost_nodes`)."""
        if 0 <= rank < len(self.rank_nodes):
            node_id, ip = self.rank_nodes[rank]
            self.lost_nodes.append({"rank": rank, "node": node_id, "address": ip, "during": what})

    def _stop_actors(self) -> None:
        """Kill every actor (a survivor may be blocked on a lost peer) and free the placement group."""
        from ray.util.placement_group import remove_placement_group

        for actor in self.actors:
            self._ray.kill(actor, no_restart=True)
        self.actors = []
        if self._pg is not None:
            remove_placement_group(self._pg)
            self._pg = None

    def stop(self, graceful: bool = True) -> None:
        """Kill the actors, free the placement group and stop a Ray instance this group started.
        Safe to call twice and after a failed start."""
        ray = self._ray
        try:
            # A Ray instance this group started goes down whole with ray.shutdown(), actors included.
            # Killing actors one by one first would need its GCS, which a Ctrl-C sent to the whole
            # process group may already have stopped: those calls then retry for a minute.
            if ray.is_initialized() and not self.started_ray:
                self._stop_actors()
        finally:
            if self.started_ray and ray.is_initialized():
                ray.shutdown()
                end_watchdog(self._watchdog)
            self.started_ray = False
