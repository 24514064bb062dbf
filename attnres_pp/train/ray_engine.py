"""`--launcher ray`: one Ray actor per rank (D replicas x P pipeline ranks), placed by a placement
group of D x P bundles.

The actor is a thin shell around `StageWorker` (the same runtime as the local launcher). The
process-group rendezvous follows Ray Train: rank 0 picks its node address and a free port, then
every actor initialises concurrently against it and joins the ("dp", "pp") mesh. The driver decides
the device (`train.devices`): one GPU per actor and nccl when the cluster has one for every rank,
else gloo on the CPU (`--device cuda` without enough GPUs is refused, naming the shortfall). Per
step the driver sends each actor (step, lr) and gets scalars back; actors read their own data and
write their own checkpoint shards into --out, which several nodes must share (checked at start).

Where the actors run: `address` (or RAY_ADDRESS, which `ray job submit` sets for its driver) joins
that cluster; `address="auto"` joins the `ray start` cluster of this machine; otherwise a private
local instance is started (and stopped on close), never an unrelated cluster found by accident.

Every wait on an actor is bounded: results are collected as they arrive, so a dead actor is named
as soon as Ray reports it (the surviving ranks, blocked on it, are killed by `restart_workers` or
`close`), and the whole wait is capped by the pipeline timeout.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import socket
import time
from pathlib import Path

import torch

from attnres_pp.model.routing import routing_metrics
from attnres_pp.pipeline.config import PLACEMENTS
from attnres_pp.pipeline.errors import WorkerLost
from attnres_pp.pipeline.stage_setup import bind_to_address
from attnres_pp.train.config import RunConfig
from attnres_pp.train.devices import decide_device, node_gpu_views, resolve_train
from attnres_pp.train.loop import StepResult
from attnres_pp.train.pipeline_engine import PipelineEngineBase, mean_eval_loss
from attnres_pp.train.rank_data import resolve_data_path
from attnres_pp.train.stage_worker import StageWorker

# After one rank's task fails, how long to wait for Ray to report a dead peer that caused it: a lost
# host resets its TCP connections at once, but Ray declares its node dead only after missed health
# checks (3 s under scripts/netns_cluster.py's settings, ~30 s under Ray's defaults).
_DEATH_GRACE_S = 10.0


class RendezvousError(ValueError):
    """The ranks' process group did not connect: one line naming the ranks and their addresses (a
    ValueError, so the CLI prints it as `error:` and exits 2)."""


def ranks_by_node(bundle_nodes: dict, world_size: int) -> list[int]:
    """Bundle index of each global rank such that ranks on one node are consecutive, nodes in the
    order their first bundle comes (as Ray Train orders its workers): a replica's pipeline ranks
    then share a node where the placement allows, and their hops stay in shared memory."""
    order: dict = {}
    for index in range(world_size):
        order.setdefault(bundle_nodes.get(index, bundle_nodes.get(str(index))), []).append(index)
    return [index for indices in order.values() for index in indices]


class StageActor(StageWorker):
    """Ray prefixes each actor's log lines with its repr, so they read `(StageActor rank=0 ...)`."""

    def __init__(self, run_cfg_dict: dict, rank: int, data_path: str, fail_at_step: int | None = None) -> None:
        import ray

        super().__init__(run_cfg_dict, rank, data_path=data_path, fail_at_step=fail_at_step)
        # Where this rank runs as Ray knows it: the node id decides shared memory vs the network
        # (`comm.pair_transport`), the node's address carries the process group's sockets.
        self.node_id = ray.get_runtime_context().get_node_id()
        self.node_ip = ray.util.get_node_ip_address()

    def __repr__(self) -> str:
        return f"StageActor rank={self.rank} (dp {self.dp_rank}, pp {self.pp_rank})"

    def master_address(self) -> tuple[str, int]:
        """This node's address and a free TCP port on it, for the tcp:// rendezvous (Ray Train's way)."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind((self.node_ip, 0))
            return self.node_ip, probe.getsockname()[1]

    def node(self) -> tuple[str, str]:
        """(Ray node id, node address) of this rank."""
        return self.node_id, self.node_ip

    def gpu_ids(self) -> list[str]:
        import ray

        return [str(g) for g in ray.get_gpu_ids()]

    def see_node_gpus(self, visible: str, local_rank: int) -> None:
        """Before CUDA starts here: see every GPU of this node's ranks, use the `local_rank`-th."""
        os.environ["CUDA_VISIBLE_DEVICES"] = visible
        os.environ["LOCAL_RANK"] = str(local_rank)

    def transport_bytes(self) -> dict[str, int]:
        """Bytes this rank sent in its last training step, by way ("shm", "gloo")."""
        return self.runtime.transport.ledger.bytes_by_transport()  # nccl's batched one: all "gloo"

    def join_process_group(self, init_method: str, world_size: int) -> dict:
        """As StageWorker's, with gloo's sockets on the interface of the node's address. A mesh that
        cannot connect is RendezvousError (one line: this rank, its address, the cause)."""
        interface = bind_to_address(self.node_ip)
        try:
            described = super().join_process_group(init_method, world_size)
        except RuntimeError as error:
            cause = " ".join(str(error).split())[:300]
            raise RendezvousError(f"rank {self.rank} at {self.node_ip} ({interface}) could not join the process "
                                  f"group at {init_method}: {cause}") from None
        described.update(node=self.node_id, address=self.node_ip, interface=interface)
        print(f"chunks {sorted(self.chunks)} ({described['params']:,} parameters) on {self.device} of "
              f"{described['host']}, node {self.node_ip} ({self.node_id[:8]}, {interface}), {described['backend']} "
              f"group of {world_size} via {init_method}", flush=True)
        return described


class RayEngine(PipelineEngineBase):
    def __init__(self, run_cfg: RunConfig, out_dir=None, *, address: str | None = None,
                 placement: str | None = None, fail_at: tuple[int, int] | None = None,
                 record_timelines: bool = False) -> None:
        from attnres_pp.pipeline.ray_checks import check_reachable, require_ray

        require_ray()  # before `import ray`: a missing package is one line, not a traceback
        import ray
        from ray.util.placement_group import remove_placement_group

        super().__init__(run_cfg, out_dir, record_timelines=record_timelines)  # checks the split before Ray starts
        self.placement = placement or run_cfg.pipeline.placement
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement={self.placement!r} is invalid: choose one of {', '.join(PLACEMENTS)}")
        self._ray, self._remove_pg = ray, remove_placement_group
        pipe = run_cfg.pipeline
        self.timeout_s = pipe.timeout_s
        self.actors, self._pg = [], None
        self.started_ray = False
        if not ray.is_initialized():
            source = "--address" if address else "RAY_ADDRESS"
            address = address or os.environ.get("RAY_ADDRESS")
            if address:
                check_reachable(address, source)
                try:
                    ray.init(address=address, log_to_driver=True)
                except ConnectionError as error:  # "auto" with no `ray start` cluster on this machine
                    raise ValueError(f"{source} {address}: {error}") from None
            else:
                # One CPU per rank even on a smaller machine: the ranks mostly wait on each other.
                ray.init(address="local", num_cpus=max(self.world_size, os.cpu_count() or 1), include_dashboard=False,
                         log_to_driver=True)
                self.started_ray = True
        try:
            gpus = 0 if os.environ.get("ATTNRES_PP_FORCE_CPU") == "1" else int(ray.cluster_resources().get("GPU", 0))
            decision = decide_device(run_cfg.train.device, n_ranks=self.world_size, one_process=False, gpus=gpus,
                                     where="in the Ray cluster", data_parallel=run_cfg.pipeline.data_parallel)
            self.run_cfg = dataclasses.replace(run_cfg, train=resolve_train(run_cfg.train, decision.device))
            self.use_gpu = decision.device == "cuda"
            self._start_workers(fail_at)
            self._check_shared_out_dir(lambda path, token: self._get(
                [a.sees_file.remote(path, token) for a in self.actors], "the --out visibility check"))
        except BaseException:
            self.close()
            raise

    def _start_workers(self, fail_at: tuple[int, int] | None) -> None:
        """Placement group, one actor per rank in its bundle, rendezvous and process group."""
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from attnres_pp.pipeline.ray_checks import check_placement

        ray, world = self._ray, self.world_size
        bundle = {"CPU": 1, **({"GPU": 1} if self.use_gpu else {})}
        # A group no node can hold would wait out the whole timeout: refuse it now, saying why.
        check_placement([bundle] * world, self.placement, [n["Resources"] for n in ray.nodes() if n["Alive"]])
        self._pg = placement_group([bundle] * world, strategy=self.placement)
        ready, _ = ray.wait([self._pg.ready()], timeout=self.timeout_s)
        if not ready:
            raise RuntimeError(
                f"Ray could not place {world} bundles of {bundle} with {self.placement} within "
                f"{self.timeout_s:.0f} s: the cluster has {ray.cluster_resources()}; add resources or use "
                "--placement PACK/SPREAD for several nodes"
            )
        actor_cls = ray.remote(num_cpus=1, num_gpus=1 if self.use_gpu else 0, max_restarts=0)(StageActor)
        data_path = resolve_data_path(self.run_cfg.train.data)
        bundles = ranks_by_node(ray.util.placement_group_table(self._pg)["bundles_to_node_id"], world)
        # The driver's ATTNRES_PP_* settings (ATTNRES_PP_SHM, ATTNRES_PP_SOCKET_IFNAME, ...) hold for
        # its ranks too, on whichever node they run.
        env_vars = {k: v for k, v in os.environ.items() if k.startswith("ATTNRES_PP_")}
        runtime_env = {"runtime_env": {"env_vars": env_vars}} if env_vars else {}
        self.actors = [
            actor_cls.options(**runtime_env, scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self._pg, placement_group_bundle_index=bundles[rank])).remote(
                    self.run_cfg.to_dict(), rank, data_path,
                    fail_at[1] if fail_at is not None and fail_at[0] == rank else None)
            for rank in range(world)
        ]
        self.rank_nodes = self._get([a.node.remote() for a in self.actors], "node lookup")
        self.static_extras["nodes"] = [node_id for node_id, _ip in self.rank_nodes]
        self.static_extras["node_addresses"] = [ip for _node_id, ip in self.rank_nodes]
        self._transport_bytes_known = False
        if self.use_gpu:  # each rank its own GPU, seeing its node's others (`devices.node_gpu_views`)
            gpus = self._get([a.gpu_ids.remote() for a in self.actors], "GPU lookup")
            views = node_gpu_views([node_id for node_id, _ip in self.rank_nodes], gpus)
            self._get([a.see_node_gpus.remote(*view) for a, view in zip(self.actors, views, strict=True)],
                      "GPU set-up")
        host, port = self._get([self.actors[0].master_address.remote()], "rendezvous")[0]
        init_method = f"tcp://{host}:{port}"
        described = self._join([a.join_process_group.remote(init_method, world) for a in self.actors], init_method)
        self.backend = described[0]["backend"]
        self._note_setup(described)

    def _join(self, refs: list, init_method: str) -> list[dict]:
        """The ranks' process-group set-up; RendezvousError naming every rank's address and the first
        rank's failure when the group does not connect (a rank that dies is still WorkerLost). A rank
        that refuses to start (a ValueError in its set-up, such as a /dev/shm without room for the
        shared-memory slots) is one line, as under the local launcher: `rank R refused to start: ...`."""
        ray = self._ray
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.timeout_s + 30.0)
        failures, refusals = [], []
        for rank, ref in enumerate(refs):
            if ref not in ready:
                failures.append(f"rank {rank} did not finish within {self.timeout_s:.0f} s")
                continue
            try:
                ray.get(ref, timeout=1.0)
            except ray.exceptions.RayActorError as error:
                raise WorkerLost(rank, f"{self._where(rank)} died during process-group setup: {error}") from None
            except ray.exceptions.RayTaskError as error:
                cause = getattr(error, "cause", None)
                if isinstance(cause, ValueError) and not isinstance(cause, RendezvousError):
                    refusals.append(f"rank {rank} refused to start: {' '.join(str(cause).split())}")
                else:
                    failures.append(str(cause) if isinstance(cause, RendezvousError)
                                    else f"rank {rank}: {' '.join(str(error).split())[-300:]}")
        if refusals:  # the cause, which the others' failures (a peer that gave up) only follow from
            raise ValueError(refusals[0])
        if failures:
            where = ", ".join(f"rank {r} at {ip}" for r, (_node, ip) in enumerate(self.rank_nodes))
            raise RendezvousError(f"the process group of ranks 0-{len(refs) - 1} ({where}) did not connect at "
                                  f"{init_method}: {failures[0]}; check that every node reaches the others at "
                                  "these addresses (routes, firewalls) and that each node's --node-ip-address "
                                  "is its own")
        return ray.get(refs)

    def _where(self, rank: int) -> str:
        """`rank R on node IP (id prefix)`, as far as the engine knows the rank's node."""
        nodes = getattr(self, "rank_nodes", None)
        if not nodes or rank < 0 or rank >= len(nodes):
            return f"rank {rank}"
        node_id, ip = nodes[rank]
        return f"rank {rank} on node {ip} ({node_id[:8]})"

    def _note_lost(self, rank: int, what: str) -> None:
        """summary.json's `lost_nodes`: each lost rank, its node and when."""
        if 0 <= rank < len(getattr(self, "rank_nodes", [])):
            node_id, ip = self.rank_nodes[rank]
            self.static_extras.setdefault("lost_nodes", []).append(
                {"rank": rank, "node": node_id, "address": ip, "during": what})

    def _stop_workers(self) -> None:
        """Kill every actor (a survivor may be blocked on a lost peer) and free the placement group."""
        for actor in self.actors:
            self._ray.kill(actor, no_restart=True)
        self.actors = []
        if self._pg is not None:
            self._remove_pg(self._pg)
            self._pg = None

    def restart_workers(self) -> None:
        """Fresh actors and process group on the same Ray instance, without any injected failure."""
        self._stop_workers()
        self._start_workers(None)

    def _get(self, refs: list, what: str) -> list:
        """The results of `refs` (one per rank, in rank order), waiting at most the pipeline timeout.
        A dead actor becomes WorkerLost naming its rank as soon as Ray reports it."""
        ray = self._ray
        deadline = time.monotonic() + self.timeout_s + 30.0
        pending = list(refs)
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WorkerLost(-1, f"stage actors did not finish {what} within {self.timeout_s:.0f} s")
            ready, pending = ray.wait(pending, num_returns=1, timeout=min(remaining, 1.0))
            for ref in ready:
                self._raise_if_failed(refs, refs.index(ref), what)
        return ray.get(refs)

    def _raise_if_failed(self, refs: list, rank: int, what: str) -> None:
        ray = self._ray
        try:
            ray.get(refs[rank], timeout=self.timeout_s)
        except ray.exceptions.RayActorError as error:
            self._note_lost(rank, what)
            raise WorkerLost(rank, f"{self._where(rank)} stopped answering (its actor died) during {what}: "
                                   f"{error}") from error
        except ray.exceptions.RayTaskError as error:
            # A peer's death often shows first as this rank's failed receive: name the dead one.
            others = [ref for r, ref in enumerate(refs) if r != rank]
            ready, _ = ray.wait(others, num_returns=len(others), timeout=_DEATH_GRACE_S) if others else ([], [])
            for ref in ready:
                try:
                    ray.get(ref, timeout=1.0)
                except ray.exceptions.RayActorError:
                    dead = refs.index(ref)
                    self._note_lost(dead, what)
                    raise WorkerLost(dead, f"{self._where(dead)} stopped answering (its actor died) during "
                                           f"{what}") from error
                except Exception:  # another rank's own failure: the first one is reported below
                    pass
            raise RuntimeError(f"rank {rank} failed during {what}:\n{error}") from error

    def train_step(self, step: int, inputs_BT: torch.Tensor | None, targets_BT: torch.Tensor | None,
                   lr: float) -> StepResult:
        """`inputs_BT`/`targets_BT` None: every actor reads its own share of step `step`."""
        want_events = self._wants_events(step)
        args = [(step, lr, self._rank_batch(rank, inputs_BT, targets_BT), want_events)
                for rank in range(self.world_size)]
        replies = self._get([a.train_step.remote(*a_args) for a, a_args in zip(self.actors, args, strict=True)],
                            f"step {step + 1}")
        # What Ray serialises for these calls: their arguments and results, pickled.
        driver_bytes = sum(len(pickle.dumps(x)) for x in args) + sum(len(pickle.dumps(r)) for r in replies)
        if not self._transport_bytes_known:  # the same every step (one plan): asked once per set of actors
            by_rank = self._get([a.transport_bytes.remote() for a in self.actors], "the transport byte counts")
            self.static_extras["bytes_sent_per_step_by_transport"] = {
                way: sum(counts.get(way, 0) for counts in by_rank) for way in ("shm", "gloo")}
            self._transport_bytes_known = True
        return self._step_result(step, replies, driver_bytes)

    def eval_loss(self, inputs_BT: torch.Tensor, targets_BT: torch.Tensor) -> float:
        """Forward-only pipeline over one driver-given batch."""
        return mean_eval_loss(self._get([a.evaluate.remote([self._rank_batch(rank, inputs_BT, targets_BT)])
                                         for rank, a in enumerate(self.actors)], "evaluation"))

    def evaluate(self) -> float:
        """Mean loss over the run's validation batches, each actor reading its own share."""
        return mean_eval_loss(self._get([a.evaluate.remote() for a in self.actors], "evaluation"))

    def routing_metrics(self) -> dict:
        """Routing scalars per site on validation batch 0, summed by the actors that own the sites."""
        return routing_metrics(self._get([a.routing_sums.remote() for a in self.actors], "routing statistics"))

    def save_checkpoint(self, step_dir) -> None:
        """Every actor writes its own shard into `step_dir`, on the filesystem all nodes share."""
        self._get([a.save_shard.remote(_absolute(step_dir)) for a in self.actors], "checkpoint save")

    def load_checkpoint(self, step_dir) -> None:
        """Every actor loads the parameters it holds, whatever split saved them."""
        self._get([a.load_shard.remote(_absolute(step_dir)) for a in self.actors], "checkpoint load")

    def close(self) -> None:
        """Kill the actors, free the placement group and stop a Ray instance this engine started.
        Safe to call twice and after a failed start."""
        ray = self._ray
        try:
            # A Ray instance this engine started goes down whole with ray.shutdown(), actors included.
            # Killing actors one by one first would need its GCS, which a Ctrl-C sent to the whole
            # process group may already have stopped: those calls then retry for a minute.
            if ray.is_initialized() and not self.started_ray:
                self._stop_workers()
        finally:
            if self.started_ray and ray.is_initialized():
                ray.shutdown()
            self.started_ray = False


def _absolute(step_dir) -> str:
    """A checkpoint folder as every rank can open it (a rank's working directory need not be the driver's)."""
    return str(Path(step_dir).resolve())
