"""What every rank of a pipelined run sets up the same way: the lowered, validated schedule, the
check that a split works (run by the driver before any worker starts) and the process group."""

from __future__ import annotations

import datetime

import torch

from attnres_pp.comm.partition import Partition, make_partition
from attnres_pp.pipeline.config import PipelineConfig
from attnres_pp.schedule.ir import Schedule
from attnres_pp.schedule.passes import insert_comm
from attnres_pp.schedule.schedules import build_schedule, schedule_placement
from attnres_pp.schedule.validate import validate


def lowered_schedule(pipe: PipelineConfig, n_microbatches: int) -> Schedule:
    """The validated, communication-lowered schedule of a run (identical on every rank); unless the
    run is pinned to gloo's rules, also proven deadlock-free under NCCL's (validate_nccl)."""
    schedule = insert_comm(build_schedule(pipe.schedule, pipe.stages, pipe.virtual, n_microbatches))
    validate(schedule, p2p_semantics="gloo" if pipe.p2p_semantics == "gloo" else "nccl")
    return schedule


def run_partition(n_layers: int, pipe: PipelineConfig) -> Partition:
    """The run's chunks, placed on ranks as its schedule declares."""
    return make_partition(n_layers, pipe.stages, pipe.virtual, pipe.layer_counts,
                          placement=schedule_placement(pipe.schedule))


def check_split(n_layers: int, pipe: PipelineConfig, n_microbatches: int) -> Partition:
    """Raise ValueError (before any worker starts) if the layers do not split into the run's chunks
    or the schedule does not validate; returns the partition."""
    partition = run_partition(n_layers, pipe)
    lowered_schedule(pipe, n_microbatches)
    return partition


def init_process_group(init_method: str, rank: int, world_size: int, timeout_s: float,
                       device: str = "cpu") -> tuple[str, torch.device]:
    """Join the run's process group on the device the driver decided (`train.devices`): "cuda" is
    nccl with this rank's own GPU (Ray gives each actor one GPU, device 0 in its view; local
    processes take GPU `rank` (their global rank) of the node), "cpu" is gloo. Every collective and
    p2p op times out after timeout_s."""
    import torch.distributed as dist

    if device not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r} is invalid here: the driver passes 'cpu' or 'cuda'")
    backend = "nccl" if device == "cuda" else "gloo"
    rank_device = torch.device("cpu")
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        rank_device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    if device == "cuda":
        # Initialise the NCCL communicator with every rank now: the first batched p2p call may
        # involve only some ranks, which torch documents as undefined behaviour for a first call.
        dist.all_reduce(torch.zeros(1, device=rank_device))
    return backend, rank_device
