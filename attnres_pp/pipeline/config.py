"""PipelineConfig: how a run is split over ranks and launched. Frozen and validated."""

from __future__ import annotations

import math
from dataclasses import dataclass

from attnres_pp.comm.link import LinkModel
from attnres_pp.config_tables import from_table, to_table

SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "interleaved_zb", "zbv", "dualpipev",
                  "v_half", "v_min")
LAUNCHERS = ("local", "ray", "inprocess", "torchrun")  # inprocess: loopback transport, for debugging; torchrun:
# every process torchrun started is one rank (`launch.torchrun_rank_group`)
# Ray placement-group strategies: STRICT_PACK keeps every rank on one node (fastest links); PACK
# and SPREAD let a pipeline span nodes (PACK fills a node before the next, SPREAD balances).
PLACEMENTS = ("STRICT_PACK", "PACK", "SPREAD")
# Point-to-point rules the runtime obeys (docs/spec.md section 5): "gloo" matches by tag and buffers sends;
# "nccl" matches in issue order with rendezvous sends, so the runtime issues batched groups in the
# order validate_nccl proves; "auto" follows the process group's backend (the loopback: gloo).
P2P_SEMANTICS = ("auto", "gloo", "nccl")
# How the D replicas hold parameters, gradients and optimizer state: whole copies, or FSDP2 shards.
DP_SHARDS = ("replicate", "fsdp")
RESHARD_AFTER_FORWARD = ("never", "always")
# How each transformer layer's forward is checkpointed (`pipeline.activation_checkpoint`).
AC_POLICIES = ("none", "full", "selective")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, kw_only=True)
class PipelineConfig:
    """stages = P physical ranks, virtual = V chunks per rank, data_parallel = D replicas of the
    pipeline, tensor_parallel = T ranks sharing each chunk (D x P x T ranks in all; docs/spec.md
    section 10), sequence_parallel = whether those T ranks also split every sequence between layers
    (None: on when T > 1), expert_parallel = EP ranks of one stage, taken along the data-parallel
    axis, that share each MoE sublayer's routed experts (docs/spec.md section 12), cache = the
    cross-stage block cache, placement = how the ray launcher places the ranks' bundles on nodes.
    link_gbps (Gb/s) and link_latency_us emulate a slow link on one host (`comm.link`; off when link_gbps is None)."""

    stages: int = 1
    virtual: int = 1
    schedule: str = "interleaved_1f1b"
    cache: bool = True
    launcher: str = "ray"
    layer_counts: tuple[int, ...] | None = None
    timeout_s: float = 120.0
    placement: str = "STRICT_PACK"
    data_parallel: int = 1
    p2p_semantics: str = "auto"
    link_gbps: float | None = None
    link_latency_us: float = 0.0
    dp_shard: str = "replicate"
    # None: "never" under fsdp; only fsdp may set it. With data_parallel = 1 fsdp is a no-op sharding
    # (each rank keeps whole tensors, as under replicate).
    fsdp_reshard_after_forward: str | None = None
    tensor_parallel: int = 1
    sequence_parallel: bool | None = None
    expert_parallel: int = 1

    def __post_init__(self) -> None:
        if not _is_int(self.stages) or self.stages < 1:
            raise ValueError(f"PipelineConfig.stages={self.stages!r} is invalid: must be an integer >= 1")
        if not _is_int(self.virtual) or self.virtual < 1:
            raise ValueError(f"PipelineConfig.virtual={self.virtual!r} is invalid: must be an integer >= 1")
        if not isinstance(self.data_parallel, int) or isinstance(self.data_parallel, bool) or self.data_parallel < 1:
            raise ValueError(f"PipelineConfig.data_parallel={self.data_parallel!r} is invalid: must be an integer >= 1 "
                             "(replicas of the pipeline; 1 = no data parallelism)")
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
        if not isinstance(self.cache, bool):
            raise ValueError(f"PipelineConfig.cache={self.cache!r} is invalid: must be True or False")
        # Every wait on a rank is bounded by this: nan or inf would let a lost rank hang the run.
        timeout_ok = isinstance(self.timeout_s, int | float) and not isinstance(self.timeout_s, bool)
        if not timeout_ok or not math.isfinite(self.timeout_s) or self.timeout_s <= 0:
            raise ValueError(f"PipelineConfig.timeout_s={self.timeout_s!r} is invalid: give a finite number of "
                             "seconds > 0, e.g. 120 (--timeout 120)")
        if self.layer_counts is not None and any(not _is_int(n) or n < 1 for n in self.layer_counts):
            raise ValueError(f"PipelineConfig.layer_counts={list(self.layer_counts)} is invalid: every chunk "
                             "needs an integer number of layers >= 1")
        self._check_link()
        self._check_dp_shard()
        self._check_tensor_parallel()
        self._check_expert_parallel()
        if self.layer_counts is not None and len(self.layer_counts) != self.stages * self.virtual:
            raise ValueError(
                f"PipelineConfig.layer_counts={list(self.layer_counts)} is invalid: give one layer count per "
                f"chunk, stages x virtual = {self.stages * self.virtual} of them"
            )

    def _check_link(self) -> None:
        def is_number(value) -> bool:
            return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)

        if self.link_gbps is not None and not (is_number(self.link_gbps) and self.link_gbps > 0):
            raise ValueError(f"PipelineConfig.link_gbps={self.link_gbps!r} is invalid: the emulated link's bandwidth "
                             "must be a finite number of Gb/s > 0, e.g. --link-gbps 0.2 (or leave it out: no "
                             "emulation)")
        if not (is_number(self.link_latency_us) and self.link_latency_us >= 0):
            raise ValueError(f"PipelineConfig.link_latency_us={self.link_latency_us!r} is invalid: must be a finite "
                             "number of microseconds >= 0, e.g. --link-latency-us 20")
        if self.link_latency_us and self.link_gbps is None:
            raise ValueError(f"PipelineConfig.link_latency_us={self.link_latency_us!r} needs an emulated link: "
                             "give its bandwidth too, e.g. --link-gbps 0.2")
        if self.link_gbps is not None and self.launcher == "inprocess":
            raise ValueError("PipelineConfig.link_gbps: the link emulation delays messages between rank "
                             "processes; use --launcher local or ray (inprocess runs every rank in one process)")

    def _check_dp_shard(self) -> None:
        if self.dp_shard not in DP_SHARDS:
            raise ValueError(f"PipelineConfig.dp_shard={self.dp_shard!r} is invalid: choose one of "
                             f"{', '.join(DP_SHARDS)} (fsdp: FSDP2 shards over the D replicas)")
        reshard = self.fsdp_reshard_after_forward
        if reshard is not None and reshard not in RESHARD_AFTER_FORWARD:
            raise ValueError(f"PipelineConfig.fsdp_reshard_after_forward={reshard!r} is invalid: choose one of "
                             f"{', '.join(RESHARD_AFTER_FORWARD)}")
        if reshard is not None and self.dp_shard != "fsdp":
            raise ValueError(f"PipelineConfig.fsdp_reshard_after_forward={reshard!r} needs dp_shard='fsdp' "
                             "(--dp-shard fsdp); drop it under replicate")
        if self.dp_shard == "fsdp" and self.launcher == "inprocess":
            raise ValueError("PipelineConfig.dp_shard='fsdp' needs a torch.distributed process group per rank: use "
                             "--launcher local or ray (inprocess ranks are threads of one process)")

    def _check_tensor_parallel(self) -> None:
        if not _is_int(self.tensor_parallel) or self.tensor_parallel < 1:
            raise ValueError(f"PipelineConfig.tensor_parallel={self.tensor_parallel!r} is invalid: must be an integer "
                             ">= 1 (the ranks that share each chunk; 1 = no tensor parallelism)")
        if self.sequence_parallel is not None and not isinstance(self.sequence_parallel, bool):
            raise ValueError(f"PipelineConfig.sequence_parallel={self.sequence_parallel!r} is invalid: must be true "
                             "or false (or left out: on when tensor_parallel > 1)")

    def _check_expert_parallel(self) -> None:
        ep = self.expert_parallel
        if not _is_int(ep) or ep < 1:
            raise ValueError(f"--expert-parallel {ep!r} is invalid: give an integer >= 1 (the ranks of a stage that "
                             "share each MoE sublayer's routed experts; 1 = every rank holds them all)")
        if self.data_parallel % ep:
            raise ValueError(f"--expert-parallel {ep} does not divide --data-parallel {self.data_parallel}: the "
                             "expert-parallel ranks are taken along the data-parallel axis; choose EP dividing D")

    def check_tensor_parallel_fits_node(self, ranks_per_node: int, what: str) -> None:
        """ValueError unless a tp group of T ranks fits on one node of `ranks_per_node` ranks (`what`
        names them, e.g. "GPUs visible on this node"): its collectives run on the intra-node link."""
        if self.tensor_parallel > ranks_per_node:
            raise ValueError(f"--tensor-parallel {self.tensor_parallel} is larger than a node's {ranks_per_node} "
                             f"ranks ({what}): a tp group must sit on one node; use --tensor-parallel "
                             f"{max(1, ranks_per_node)} or fewer")

    @property
    def sp(self) -> bool:
        """Sequence parallelism in effect: asked for (or left to its default) with T > 1."""
        return self.tensor_parallel > 1 and self.sequence_parallel is not False

    @property
    def link(self) -> LinkModel | None:
        """The emulated link, or None (no emulation)."""
        if self.link_gbps is None:
            return None
        return LinkModel(gbps=float(self.link_gbps), latency_s=float(self.link_latency_us) * 1e-6)

    @property
    def n_chunks(self) -> int:
        return self.stages * self.virtual

    @property
    def world_size(self) -> int:
        """Ranks in all: D replicas x P stages x T tensor-parallel ranks."""
        return self.data_parallel * self.stages * self.tensor_parallel

    @property
    def is_single_process(self) -> bool:
        return self.n_chunks == 1 and self.data_parallel == 1 and self.tensor_parallel == 1

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
        return from_table(cls, values, table="pipeline")

    def to_dict(self) -> dict:
        return to_table(self, list_fields=("layer_counts",))
