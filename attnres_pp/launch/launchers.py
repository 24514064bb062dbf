"""Which rank group each `--launcher` names: `make_rank_group`, the one place that maps the
launcher to a `RankGroup` implementation. The thread and Ray groups are imported only when named,
so a run that uses neither never imports their dependencies (Ray)."""

from __future__ import annotations

from attnres_pp.launch.process_rank_group import ProcessRankGroup
from attnres_pp.launch.rank_group import RankGroup
from attnres_pp.pipeline.config import PipelineConfig


def make_rank_group(pipe: PipelineConfig, world_size: int, *, name: str, address: str | None = None,
                    placement: str | None = None, ledger=None) -> RankGroup:
    """The rank group of `pipe.launcher` for `world_size` ranks (not yet started). `name` prefixes
    local rank processes; `address` and `placement` (default `pipe.placement`) are Ray's; `ledger`
    records the in-process ranks' hops."""
    if pipe.launcher == "local":
        return ProcessRankGroup(world_size, pipe.timeout_s, name=name)
    if pipe.launcher == "inprocess":
        from attnres_pp.launch.thread_rank_group import ThreadRankGroup

        return ThreadRankGroup(world_size, stages=pipe.stages, timeout_s=pipe.timeout_s,
                               tensor_parallel=pipe.tensor_parallel,
                               nccl_rules=pipe.resolved_p2p("loopback") == "nccl", ledger=ledger)
    if pipe.launcher == "ray":
        from attnres_pp.launch.ray_rank_group import RayRankGroup

        return RayRankGroup(world_size, pipe.timeout_s, address=address, placement=placement or pipe.placement,
                            tensor_parallel=pipe.tensor_parallel)
    raise ValueError(f"launcher={pipe.launcher!r} is unknown: choose local, inprocess or ray")
