"""`attnres-pp generate --launcher ray`: one Ray actor per rank, each a thin shell around the same
`GenerationWorker` as the local launcher's rank processes.

Placement and rendezvous follow the training launcher (`train.ray_engine`): the device is decided
against the cluster's GPUs (`train.devices`: one GPU per actor and nccl when there is one for
every rank, else gloo on the CPU; `--device cuda` without enough is refused), a placement group
holds one bundle per rank, rank 0 picks its node address and a free port, every actor joins the
torch.distributed group against it. `address` (or
RAY_ADDRESS) joins that cluster, "auto" the `ray start` cluster of this machine; otherwise a private
local instance is started and stopped on close. Every wait is bounded by the pipeline timeout.
"""

from __future__ import annotations

import os
import socket

import ray
import torch
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from attnres_pp.generate.engines import decide_generation_device, resolve_precision
from attnres_pp.generate.worker import GenerationWorker, pipeline_partition
from attnres_pp.model import ModelConfig
from attnres_pp.pipeline.config import PipelineConfig
from attnres_pp.pipeline.errors import WorkerLost


class GenerationActor(GenerationWorker):
    """Ray prefixes each actor's log lines with its repr: `(GenerationActor rank=0 ...)`."""

    def __repr__(self) -> str:
        return f"GenerationActor rank={self.pp_rank}"

    def master_address(self) -> tuple[str, int]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind(("", 0))
            return ray.util.get_node_ip_address(), probe.getsockname()[1]


class RayGenerator:
    def __init__(self, cfg: ModelConfig, pipe: PipelineConfig, named: dict | None, seed: int = 0,
                 threads: int = 1, *, address: str | None = None, device: str = "auto", dtype: str = "auto") -> None:
        self.cfg, self.pipe = cfg, pipe
        partition = pipeline_partition(cfg, pipe)  # a bad split fails before Ray starts
        self.last_rank = partition.rank_of(partition.n_chunks - 1)
        self.actors, self._pg, self.started_ray = [], None, False
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
            self.device = decide_generation_device(device, pipe, gpus=gpus)
            self.precision = resolve_precision(dtype, self.device)
            self._start(named, seed, threads)
        except BaseException:
            self.close()
            raise

    def _start(self, named: dict | None, seed: int, threads: int) -> None:
        pipe = self.pipe
        use_gpu = self.device == "cuda"
        bundle = {"CPU": 1, **({"GPU": 1} if use_gpu else {})}
        self._pg = placement_group([bundle] * pipe.stages, strategy=pipe.placement)
        if not ray.wait([self._pg.ready()], timeout=pipe.timeout_s)[0]:
            raise RuntimeError(f"Ray could not place {pipe.stages} bundles of {bundle} with {pipe.placement} within "
                               f"{pipe.timeout_s:.0f} s: the cluster has {ray.cluster_resources()}")
        actor_cls = ray.remote(num_cpus=1, num_gpus=1 if use_gpu else 0, max_restarts=0)(GenerationActor)
        self.actors = [
            actor_cls.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self._pg, placement_group_bundle_index=rank)).remote(
                    self.cfg.to_dict(), pipe.to_dict(), rank, seed, threads, device=self.device,
                    precision=self.precision)
            for rank in range(pipe.stages)
        ]
        host, port = self._get([self.actors[0].master_address.remote()], "rendezvous")[0]
        self._get([a.join_process_group.remote(f"tcp://{host}:{port}", pipe.stages) for a in self.actors],
                  "process-group setup")
        if named is not None:
            named_ref = ray.put(named)  # one copy in the object store, read by every actor
            self._get([a.load_parameters.remote(named_ref) for a in self.actors], "parameter load")

    def _get(self, refs: list, what: str) -> list:
        """Every result, within the pipeline timeout; a dead actor becomes WorkerLost naming its rank."""
        try:
            return ray.get(refs, timeout=self.pipe.timeout_s + 30.0)
        except ray.exceptions.GetTimeoutError:
            raise WorkerLost(-1, f"generation actors did not finish {what} within "
                                 f"{self.pipe.timeout_s:.0f} s") from None
        except ray.exceptions.RayActorError as error:
            dead = next((rank for rank, ref in enumerate(refs) if _died(ref)), -1)
            raise WorkerLost(dead, f"rank {dead} actor died during {what}: {error}") from error
        except ray.exceptions.RayTaskError as error:
            raise RuntimeError(f"a generation actor failed during {what}:\n{error}") from error

    def reset(self) -> None:
        self._get([a.reset.remote() for a in self.actors], "reset")

    def keep_rows(self, rows: list[int]) -> None:
        self._get([a.keep_rows.remote(rows) for a in self.actors], "dropping finished sequences")

    def forward(self, pieces: list[tuple[int, int]], tokens_BT: torch.Tensor, all_logits: bool = False) -> torch.Tensor:
        refs = [actor.run_pass.remote(tokens_BT.shape[0], pieces, tokens_BT if rank == 0 else None, all_logits)
                for rank, actor in enumerate(self.actors)]
        return self._get(refs, "a generation pass")[self.last_rank]

    def close(self) -> None:
        """Kill the actors and free the placement group; stop a Ray instance this generator started."""
        try:
            if ray.is_initialized() and not self.started_ray:
                for actor in self.actors:
                    ray.kill(actor, no_restart=True)
                if self._pg is not None:
                    remove_placement_group(self._pg)
        finally:
            self.actors, self._pg = [], None
            if self.started_ray and ray.is_initialized():
                ray.shutdown()
            self.started_ray = False


def _died(ref) -> bool:
    try:
        ray.get(ref, timeout=1.0)
    except ray.exceptions.RayActorError:
        return True
    except Exception:  # another failure, or still running: not the dead one
        return False
    return False
