"""`--launcher ray`: one Ray actor per pipeline rank, placed by a placement group.

The actor is a thin shell around `StageWorker` (the same runtime as the local launcher). The
process-group rendezvous follows Ray Train: rank 0 picks its node address and a free port, then
every actor initialises concurrently against it (nccl when every bundle has a GPU, gloo otherwise).
A local Ray instance is started when none is reachable (and stopped on close); `address` or
RAY_ADDRESS joins an existing cluster. Every wait on an actor is bounded by the pipeline timeout.
"""

from __future__ import annotations

import os
import socket

import torch

from attnres_pp.pipeline.engines import PipelineEngineBase, model_from_parameters
from attnres_pp.pipeline.local_launcher import WorkerLost
from attnres_pp.pipeline.worker import StageWorker
from attnres_pp.train.config import RunConfig
from attnres_pp.train.loop import StepResult

PLACEMENTS = ("STRICT_PACK", "PACK", "SPREAD")


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


class RayEngine(PipelineEngineBase):
    def __init__(self, run_cfg: RunConfig, out_dir=None, *, address: str | None = None,
                 placement: str = "STRICT_PACK", fail_at: tuple[int, int] | None = None) -> None:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        super().__init__(run_cfg, out_dir)
        if placement not in PLACEMENTS:
            raise ValueError(f"placement={placement!r} is invalid: choose one of {', '.join(PLACEMENTS)}")
        self._ray, self._remove_pg = ray, remove_placement_group
        pipe = run_cfg.pipeline
        self.timeout_s = pipe.timeout_s
        self.started_ray = False
        if not ray.is_initialized():
            address = address or os.environ.get("RAY_ADDRESS")
            if address:
                ray.init(address=address, log_to_driver=True)
            else:
                ray.init(num_cpus=max(pipe.stages, os.cpu_count() or 1), include_dashboard=False,
                         log_to_driver=True)
                self.started_ray = True
        gpus = int(ray.cluster_resources().get("GPU", 0))
        self.use_gpu = gpus >= pipe.stages and os.environ.get("ATTNRES_PP_FORCE_CPU") != "1"
        bundle = {"CPU": 1, **({"GPU": 1} if self.use_gpu else {})}
        self._pg = placement_group([bundle] * pipe.stages, strategy=placement)
        ready, _ = ray.wait([self._pg.ready()], timeout=self.timeout_s)
        if not ready:
            self.close()
            raise RuntimeError(
                f"Ray could not place {pipe.stages} bundles of {bundle} with {placement} within "
                f"{self.timeout_s:.0f} s: the cluster has {ray.cluster_resources()}; add resources or use "
                "--placement PACK/SPREAD for several nodes"
            )
        actor_cls = ray.remote(num_cpus=1, num_gpus=1 if self.use_gpu else 0, max_restarts=0)(StageActor)
        self.actors = [
            actor_cls.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self._pg, placement_group_bundle_index=rank)).remote(
                    run_cfg.to_dict(), rank, fail_at[1] if fail_at is not None and fail_at[0] == rank else None)
            for rank in range(pipe.stages)
        ]
        host, port = self._get([self.actors[0].master_address.remote()], "rendezvous")[0]
        init_method = f"tcp://{host}:{port}"
        self.backend = self._get([a.join_process_group.remote(init_method, pipe.stages) for a in self.actors],
                                 "process-group setup")[0]
        self._eval_model = None

    def _get(self, refs: list, what: str) -> list:
        """ray.get with the pipeline timeout; a dead actor becomes WorkerLost naming its rank."""
        ray = self._ray
        try:
            return ray.get(refs, timeout=self.timeout_s + 30.0)
        except ray.exceptions.RayActorError as error:
            rank = next((r for r, ref in enumerate(refs) if _actor_died(ray, ref)), -1)
            raise WorkerLost(rank, f"rank {rank} actor died during {what}: {error}") from error
        except ray.exceptions.GetTimeoutError as error:
            raise WorkerLost(-1, f"stage actors did not finish {what} within {self.timeout_s:.0f} s") from error
        except ray.exceptions.RayTaskError as error:
            # A peer's death often shows first as another rank's failed receive: name the dead one.
            dead = [r for r, ref in enumerate(refs) if _actor_died(ray, ref)]
            if dead:
                raise WorkerLost(dead[0], f"rank {dead[0]} actor died during {what}") from error
            raise RuntimeError(f"a stage actor failed during {what}:\n{error}") from error

    def train_step(self, step: int, inputs_BT: torch.Tensor, targets_BT: torch.Tensor, lr: float) -> StepResult:
        pipe = self.run_cfg.pipeline
        last_rank = (pipe.n_chunks - 1) % pipe.stages
        refs = [actor.train_step.remote(step, inputs_BT if rank == 0 else None,
                                        targets_BT if rank == last_rank else None, lr)
                for rank, actor in enumerate(self.actors)]
        self._eval_model = None
        return self._step_result(step, self._get(refs, f"step {step}"))

    @torch.no_grad()
    def eval_loss(self, inputs_BT: torch.Tensor, targets_BT: torch.Tensor) -> float:
        if self._eval_model is None:
            named = {}
            for part in self._get([a.named_parameters.remote() for a in self.actors], "evaluation"):
                named.update(part)
            self._eval_model = model_from_parameters(self.run_cfg, named)
        return float(self._eval_model(inputs_BT, targets_BT))

    def close(self) -> None:
        ray = self._ray
        for actor in getattr(self, "actors", []):
            ray.kill(actor, no_restart=True)
        if getattr(self, "_pg", None) is not None:
            self._remove_pg(self._pg)
            self._pg = None
        if self.started_ray and ray.is_initialized():
            ray.shutdown()


def _actor_died(ray, ref) -> bool:
    """True if the task behind `ref` failed because its actor process died."""
    try:
        ray.get(ref, timeout=0.5)
    except ray.exceptions.RayActorError:
        return True
    except Exception:  # a task error or an unfinished task: the actor itself is alive
        return False
    return False
