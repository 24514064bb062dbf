"""`--launcher ray`: one Ray actor per pipeline rank, placed by a placement group.

The actor is a thin shell around `StageWorker` (the same runtime as the local launcher). The
process-group rendezvous follows Ray Train: rank 0 picks its node address and a free port, then
every actor initialises concurrently against it (nccl when every bundle has a GPU, gloo otherwise).

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
import socket
import time

import torch

from attnres_pp.pipeline.config import PLACEMENTS
from attnres_pp.pipeline.errors import WorkerLost
from attnres_pp.pipeline.stage_setup import check_split
from attnres_pp.train.checkpoint import read_checkpoint, write_rank_file
from attnres_pp.train.config import RunConfig
from attnres_pp.train.devices import decide_device, resolve_train
from attnres_pp.train.loop import StepResult
from attnres_pp.train.pipeline_engine import PipelineEngineBase, model_from_parameters
from attnres_pp.train.stage_worker import StageWorker

# After one rank's task fails, how long to wait for Ray to report a dead peer that caused it.
_DEATH_GRACE_S = 5.0


class StageActor(StageWorker):
    """Ray prefixes each actor's log lines with its repr, so they read `(StageActor rank=0 ...)`."""

    def __init__(self, run_cfg_dict: dict, pp_rank: int, fail_at_step: int | None = None) -> None:
        super().__init__(run_cfg_dict, pp_rank)
        self.fail_at_step = fail_at_step

    def __repr__(self) -> str:
        return f"StageActor rank={self.pp_rank}"

    def master_address(self) -> tuple[str, int]:
        """This node's address and a free TCP port, for the tcp:// rendezvous (Ray Train's way)."""
        import ray

        address = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind(("", 0))
            return address, probe.getsockname()[1]

    def join_process_group(self, init_method: str, world_size: int) -> str:
        backend = super().join_process_group(init_method, world_size)
        print(f"chunks {sorted(self.chunks)} on {self.device} of {socket.gethostname()}, {backend} group of "
              f"{world_size} via {init_method}", flush=True)
        return backend


class RayEngine(PipelineEngineBase):
    def __init__(self, run_cfg: RunConfig, out_dir=None, *, address: str | None = None,
                 placement: str | None = None, fail_at: tuple[int, int] | None = None) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        super().__init__(run_cfg, out_dir)
        # A bad split fails here, in one line, before Ray starts.
        self.partition = check_split(run_cfg.model.n_layers, run_cfg.pipeline, run_cfg.train.microbatches)
        self.placement = placement or run_cfg.pipeline.placement
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement={self.placement!r} is invalid: choose one of {', '.join(PLACEMENTS)}")
        self._ray, self._remove_pg = ray, remove_placement_group
        pipe = run_cfg.pipeline
        self.timeout_s = pipe.timeout_s
        self.actors, self._pg, self._eval_model = [], None, None
        self.started_ray = False
        if not ray.is_initialized():
            address = address or os.environ.get("RAY_ADDRESS")
            if address:
                ray.init(address=address, log_to_driver=True)
            else:
                ray.init(address="local", num_cpus=max(pipe.stages, os.cpu_count() or 1), include_dashboard=False,
                         log_to_driver=True)
                self.started_ray = True
        try:
            gpus = 0 if os.environ.get("ATTNRES_PP_FORCE_CPU") == "1" else int(ray.cluster_resources().get("GPU", 0))
            decision = decide_device(run_cfg.train.device, n_ranks=pipe.stages, one_process=False, gpus=gpus,
                                     where="in the Ray cluster")
            self.run_cfg = dataclasses.replace(run_cfg, train=resolve_train(run_cfg.train, decision.device))
            self.use_gpu = decision.device == "cuda"
            self._start_workers(fail_at)
        except BaseException:
            self.close()
            raise

    def _start_workers(self, fail_at: tuple[int, int] | None) -> None:
        """Placement group, one actor per rank in its bundle, rendezvous and process group."""
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ray, pipe = self._ray, self.run_cfg.pipeline
        bundle = {"CPU": 1, **({"GPU": 1} if self.use_gpu else {})}
        self._pg = placement_group([bundle] * pipe.stages, strategy=self.placement)
        ready, _ = ray.wait([self._pg.ready()], timeout=self.timeout_s)
        if not ready:
            raise RuntimeError(
                f"Ray could not place {pipe.stages} bundles of {bundle} with {self.placement} within "
                f"{self.timeout_s:.0f} s: the cluster has {ray.cluster_resources()}; add resources or use "
                "--placement PACK/SPREAD for several nodes"
            )
        actor_cls = ray.remote(num_cpus=1, num_gpus=1 if self.use_gpu else 0, max_restarts=0)(StageActor)
        self.actors = [
            actor_cls.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self._pg, placement_group_bundle_index=rank)).remote(
                    self.run_cfg.to_dict(), rank, fail_at[1] if fail_at is not None and fail_at[0] == rank else None)
            for rank in range(pipe.stages)
        ]
        host, port = self._get([self.actors[0].master_address.remote()], "rendezvous")[0]
        init_method = f"tcp://{host}:{port}"
        self.backend = self._get([a.join_process_group.remote(init_method, pipe.stages) for a in self.actors],
                                 "process-group setup")[0]
        self._eval_model = None

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
            raise WorkerLost(rank, f"rank {rank} actor died during {what}: {error}") from error
        except ray.exceptions.RayTaskError as error:
            # A peer's death often shows first as this rank's failed receive: name the dead one.
            others = [ref for r, ref in enumerate(refs) if r != rank]
            ready, _ = ray.wait(others, num_returns=len(others), timeout=_DEATH_GRACE_S) if others else ([], [])
            for ref in ready:
                try:
                    ray.get(ref, timeout=1.0)
                except ray.exceptions.RayActorError:
                    dead = refs.index(ref)
                    raise WorkerLost(dead, f"rank {dead} actor died during {what}") from error
                except Exception:  # another rank's own failure: the first one is reported below
                    pass
            raise RuntimeError(f"rank {rank} failed during {what}:\n{error}") from error

    def train_step(self, step: int, inputs_BT: torch.Tensor, targets_BT: torch.Tensor, lr: float) -> StepResult:
        pipe = self.run_cfg.pipeline
        last_rank = self.partition.rank_of(pipe.n_chunks - 1)
        refs = [actor.train_step.remote(step, inputs_BT if rank == 0 else None,
                                        targets_BT if rank == last_rank else None, lr)
                for rank, actor in enumerate(self.actors)]
        self._eval_model = None
        return self._step_result(step, self._get(refs, f"step {step + 1}"))

    @torch.no_grad()
    def eval_loss(self, inputs_BT: torch.Tensor, targets_BT: torch.Tensor) -> float:
        if self._eval_model is None:
            named = {}
            for part in self._get([a.named_parameters.remote() for a in self.actors], "evaluation"):
                named.update(part)
            self._eval_model = model_from_parameters(self.run_cfg, named)
        return float(self._eval_model(inputs_BT, targets_BT))

    def save_checkpoint(self, step_dir) -> None:
        """The actors send their state here and the driver writes it: no shared file system needed."""
        states = self._get([a.checkpoint_state.remote() for a in self.actors], "checkpoint save")
        for rank, state in enumerate(states):
            write_rank_file(step_dir, rank, state)

    def load_checkpoint(self, step_dir) -> None:
        merged, rng_by_rank = read_checkpoint(step_dir)
        merged_ref = self._ray.put(merged)  # one copy in the object store, read by every actor
        self._get([a.load_checkpoint_state.remote(merged_ref, rng_by_rank.get(rank))
                   for rank, a in enumerate(self.actors)], "checkpoint load")
        self._eval_model = None

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
