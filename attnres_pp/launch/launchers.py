"""Which rank group each `--launcher` names: `make_rank_group`, the one place that maps the
launcher to a `RankGroup` implementation. The thread and Ray groups are imported only when named,
so a run that uses neither never imports their dependencies (Ray); torchrun's group serves the
processes torchrun started."""

from __future__ import annotations

from attnres_pp.launch.process_rank_group import ProcessRankGroup
from attnres_pp.launch.rank_group import RankGroup
from attnres_pp.pipeline.config import LAUNCHERS, PipelineConfig


def make_rank_group(pipe: PipelineConfig, world_size: int, *, name: str, address: str | None = None,
                    placement: str | None = None, ledger=None, cpus: int | None = None) -> RankGroup:
    """The rank group of `pipe.launcher` for `world_size` ranks (not yet started). `name` prefixes
    local rank processes; `address` and `placement` (default `pipe.placement`) are Ray's, and `cpus`
    the CPUs a Ray instance this group starts must have (default `world_size`: more when later
    groups of the job share it); `ledger` records the in-process ranks' hops."""
    if pipe.launcher == "local":
        return ProcessRankGroup(world_size, pipe.timeout_s, name=name)
    if pipe.launcher == "inprocess":
        from attnres_pp.launch.thread_rank_group import ThreadRankGroup

        return ThreadRankGroup(world_size, stages=pipe.stages, timeout_s=pipe.timeout_s,
                               tensor_parallel=pipe.tensor_parallel, expert_parallel=pipe.expert_parallel,
                               nccl_rules=pipe.resolved_p2p("loopback") == "nccl", ledger=ledger)
    if pipe.launcher == "ray":
        from attnres_pp.launch.ray_rank_group import RayRankGroup

        return RayRankGroup(world_size, pipe.timeout_s, address=address, placement=placement or pipe.placement,
                            cpus=cpus, tensor_parallel=pipe.tensor_parallel)
    if pipe.launcher == "torchrun":  # the processes torchrun started; this one is rank 0
        from attnres_pp.launch.torchrun_rank_group import TorchrunRankGroup

        return TorchrunRankGroup(pipe)
    raise ValueError(f"launcher={pipe.launcher!r} is unknown: choose one of {', '.join(LAUNCHERS)}")
