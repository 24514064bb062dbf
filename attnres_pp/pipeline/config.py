"""PipelineConfig: how a run is split over ranks and launched. Frozen and validated."""

from __future__ import annotations

from dataclasses import dataclass

from attnres_pp.config_tables import from_table, to_table

SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved_1f1b")
LAUNCHERS = ("local", "ray", "inprocess")  # inprocess: loopback transport, for debugging
# Ray placement-group strategies: STRICT_PACK keeps every rank on one node (fastest links); PACK
# and SPREAD let a pipeline span nodes (PACK fills a node before the next, SPREAD balances).
PLACEMENTS = ("STRICT_PACK", "PACK", "SPREAD")
# Point-to-point rules the runtime obeys (SPEC section 5): "gloo" matches by tag and buffers sends;
# "nccl" matches in issue order with rendezvous sends, so the runtime issues batched groups in the
# order validate_nccl proves; "auto" follows the process group's backend (the loopback: gloo).
P2P_SEMANTICS = ("auto", "gloo", "nccl")


@dataclass(frozen=True, kw_only=True)
class PipelineConfig:
    """stages = P physical ranks, virtual = V chunks per rank, cache = the cross-stage block cache,
    placement = how the ray launcher places the ranks' bundles on nodes."""

    stages: int = 1
    virtual: int = 1
    schedule: str = "interleaved_1f1b"
    cache: bool = True
    launcher: str = "ray"
    layer_counts: tuple[int, ...] | None = None
    timeout_s: float = 120.0
    placement: str = "STRICT_PACK"
    p2p_semantics: str = "auto"

    def __post_init__(self) -> None:
        if not isinstance(self.stages, int) or self.stages < 1:
            raise ValueError(f"PipelineConfig.stages={self.stages!r} is invalid: must be an integer >= 1")
        if not isinstance(self.virtual, int) or self.virtual < 1:
            raise ValueError(f"PipelineConfig.virtual={self.virtual!r} is invalid: must be an integer >= 1")
        if self.schedule not in SCHEDULE_NAMES:
            raise ValueError(
                f"PipelineConfig.schedule={self.schedule!r} is invalid: choose one of {', '.join(SCHEDULE_NAMES)}"
            )
        if self.launcher not in LAUNCHERS:
            raise ValueError(
                f"PipelineConfig.launcher={self.launcher!r} is invalid: choose one of {', '.join(LAUNCHERS)}"
            )
        if self.placement not in PLACEMENTS:
            raise ValueError(
                f"PipelineConfig.placement={self.placement!r} is invalid: choose one of {', '.join(PLACEMENTS)} "
                "(PACK or SPREAD to span several nodes)"
            )
        if self.p2p_semantics not in P2P_SEMANTICS:
            raise ValueError(
                f"PipelineConfig.p2p_semantics={self.p2p_semantics!r} is invalid: choose one of "
                f"{', '.join(P2P_SEMANTICS)} (nccl: NCCL's in-order, rendezvous point-to-point rules)"
            )
        if self.timeout_s <= 0:
            raise ValueError(f"PipelineConfig.timeout_s={self.timeout_s!r} is invalid: must be > 0 seconds")
        if self.layer_counts is not None and len(self.layer_counts) != self.stages * self.virtual:
            raise ValueError(
                f"PipelineConfig.layer_counts={list(self.layer_counts)} is invalid: give one layer count per "
                f"chunk, stages x virtual = {self.stages * self.virtual} of them"
            )

    @property
    def n_chunks(self) -> int:
        return self.stages * self.virtual

    @property
    def is_single_process(self) -> bool:
        return self.n_chunks == 1

    def resolved_p2p(self, backend: str) -> str:
        """The rules the runtime obeys over `backend` ("gloo", "nccl", or "loopback")."""
        if self.p2p_semantics == "auto":
            return "nccl" if backend == "nccl" else "gloo"
        if backend == "nccl" and self.p2p_semantics == "gloo":
            raise ValueError("PipelineConfig.p2p_semantics='gloo' is invalid on the nccl backend: NCCL cannot match "
                             "messages by tag; use 'auto' or 'nccl'")
        return self.p2p_semantics

    @classmethod
    def from_dict(cls, values: dict) -> PipelineConfig:
        return from_table(cls, values, table="pipeline", tuple_fields=("layer_counts",))

    def to_dict(self) -> dict:
        return to_table(self, list_fields=("layer_counts",))
