"""The simulator's terms for mixtures of experts (docs/spec.md section 12), pure Python, no torch:
parameter counts (total and active), what an MoE sublayer saves for its backward beyond the dense
MLP that stands for its shared experts, the dispatch and combine bytes of expert parallelism and the
all-to-all's time inside a node and across nodes.

An MoE layer is priced as a dense layer whose MLP is its S shared experts (one SwiGLU of width S F,
`layer_recipe.layer_ff`: the fitted units of `memory_units.json` price it, and its weights, FLOPs and
W store as any MLP's) plus the terms here for the router and the routed experts, derived from the
tensors `model.moe` saves (each storage once, as the runtime's meter counts them)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from attnres_pp.comm.partition import Partition, make_partition
from attnres_pp.model.config import ModelConfig
from attnres_pp.simulator.collectives import all_to_all_s
from attnres_pp.simulator.layer_recipe import routed_expert_shapes
from attnres_pp.simulator.memory_setup import DTYPE_BYTES
from attnres_pp.simulator.memory_state import rank_parameter_shapes


def parameter_counts(cfg: ModelConfig) -> tuple[int, int]:
    """(total, active) parameters, summed from the shapes the simulator prices (one rank holding every
    chunk, EP = 1); active counts K of each MoE layer's E routed experts. Equal to
    `model.transformer.parameter_count` and `active_parameter_count` (tests hold them so) without
    importing torch."""
    total = sum(math.prod(s) for s in rank_parameter_shapes(cfg, make_partition(cfg.n_layers, 1, 1), 0))
    if not cfg.moe:
        return total, total
    per_expert = sum(math.prod(s) for s in routed_expert_shapes(cfg)) // cfg.moe_experts
    return total, total - cfg.n_moe_layers * (cfg.moe_experts - cfg.moe_top_k) * per_expert


def chunk_moe_layers(cfg: ModelConfig, partition: Partition, chunk_index: int) -> int:
    """MoE layers in chunk `chunk_index`."""
    if not cfg.moe:
        return 0
    return sum(1 for layer in partition.layer_range(chunk_index) if cfg.is_moe_layer(layer))


def moe_saved_bytes(cfg: ModelConfig, *, tokens: int, dtype: str, expert_parallel: int = 1,
                    weight_copies: bool = True, rows_factor: float = 1.0) -> int:
    """Bytes one MoE sublayer saves for its backward per microbatch of `tokens` tokens, beyond the dense
    MLP of width S F that the units price (derived from `model.moe`, held to the meter by
    tests/unit/test_sim_moe.py). N tokens, M = N K token-choices, the E / EP local experts:

    - the router: the fp32 affinities N E (softmax or sigmoid output), the sort's indices N E int64
      (the top-K is a view of them, which `gather` saves), the chosen affinities N K and their sum
      N (fp32, the division's inputs), the gate weights N K (in the compute dtype: bf16 a new copy);
      under bf16 also the fp32 normalised input N d that the fp32 router product saves (the dense
      MLP's product saves its bf16 cast instead, which an MoE layer without shared experts lacks);
    - the routed experts on the M rows they receive: the gather index and its inverse (M int64
      each), the grouped rows M d, the gate_up output M 2F, SiLU's output M F and the product M F,
      the indexed outputs M width (compute dtype), and the two grouped matmuls' offsets (E / EP int32);
    - under bf16 autocast with fp32 weights, the experts' bf16 copies (`.to(dtype)` each forward):
      E / EP x (2 F d + width F) (`weight_copies`: False under FSDP2's bf16 parameters).

    Under expert parallelism (`pipeline.expert_parallel.ExpertSlice`) a rank's experts receive R
    rows, R = M under balanced routing (each of the EP ranks sends it M / EP of its own; a real router
    sends more to some ranks than others: `rows_factor` below): the grouped products' rows
    are R (d + 2F + F + F), and the received rows' regrouping by local expert saves its index and
    that index's inverse (R int64 each); the all-to-alls themselves save nothing (their buffers are
    the rows above or die in the forward), and the outputs come back as the M width rows above.
    `rows_factor`: R / M (1: balanced; `attnres-lab memory-predict --moe` prices a run's own routing)."""
    n, k, e, d, f, width = tokens, cfg.moe_top_k, cfg.moe_experts, cfg.d_model, cfg.expert_dim, cfg.source_width
    local, m, elem = e // expert_parallel, tokens * cfg.moe_top_k, DTYPE_BYTES[dtype]
    router = n * (4 * e + 8 * e + 4 * k + 4 + elem * k)
    if dtype == "bf16":
        router += n * d * 4 - (0 if cfg.moe_shared_experts else n * d * elem)
    rows = round(m * rows_factor)  # received by this rank's experts (balanced routing: M)
    regroup = 2 * 8 * rows if expert_parallel > 1 else 0
    experts = m * (8 + 8) + regroup + rows * elem * (d + 2 * f + f + f) + m * elem * width + 2 * 4 * local
    copies = local * (2 * f * d + width * f) * elem if dtype == "bf16" and weight_copies else 0
    return router + experts + copies


def moe_store_correction(cfg: ModelConfig, *, tokens: int, dtype: str, expert_parallel: int = 1,
                         rows_factor: float = 1.0) -> int:
    """What the split backward's W store of an MoE layer differs from a dense layer's (`stored_bytes`,
    whose MLP stores (d + 2 f) + (f + width) per token under SwiGLU, (d + f) + (f + width) under GELU)
    by (`pipeline.weight_store`: a linear layer's input and output gradient; any other weight edge
    its weight-sized flow):
    - the shared experts' two linear layers, (d + 2 S F) + (S F + width) per token, none without them;
    - the router's product (fp32): its output gradient N E, and its input N d where that is not the
      storage the shared experts' first product keeps already (without shared experts, or under bf16,
      where they read a bf16 cast);
    - the routed experts' two grouped products, whose weight gradients W forms as a linear layer's
      (`pipeline.weight_operands`): their inputs and output gradients, M ((d + 2 F) + (F + width))
      in the compute dtype, M = N K token-choices, and the two products' offsets."""
    d, f, width, shared = cfg.d_model, cfg.ff_dim, cfg.source_width, cfg.moe_shared_experts * cfg.expert_dim
    dense = (d + (2 if cfg.mlp == "swiglu" else 1) * f) + (f + width)
    moe = (d + 2 * shared) + (shared + width) if shared else 0
    return (tokens * (moe - dense) * DTYPE_BYTES[dtype]
            + moe_weight_store_bytes(cfg, tokens=tokens, dtype=dtype, expert_parallel=expert_parallel,
                                     rows_factor=rows_factor))


def moe_weight_store_bytes(cfg: ModelConfig, *, tokens: int, dtype: str, expert_parallel: int = 1,
                           rows_factor: float = 1.0) -> int:
    """The router's and the routed experts' part of an MoE layer's W store (`moe_store_correction`):
    the router product's output gradient N E and input N d (fp32; the input only where the shared
    experts do not keep that storage already) and the grouped products' operands. Under
    checkpointing it adds to the fitted units' store (`input_kept`), which price the shared experts."""
    d, shared, f, width = cfg.d_model, cfg.moe_shared_experts, cfg.expert_dim, cfg.source_width
    router = tokens * 4 * (cfg.moe_experts + (d if not shared or dtype == "bf16" else 0))
    rows = round(tokens * cfg.moe_top_k * rows_factor)  # received by a rank's experts (balanced: M)
    offsets = 2 * 4 * (cfg.moe_experts // expert_parallel)
    return router + rows * ((d + 2 * f) + (f + width)) * DTYPE_BYTES[dtype] + offsets


# ---- expert parallelism's all-to-all ----

@dataclass(frozen=True)
class AllToAll:
    """Bytes of one MoE layer's all-to-alls for one microbatch on one rank (docs/spec.md section 12):
    dispatch sends K copies of each token's d values, combine brings K outputs (width) back, forward
    and again backward (their gradients), (EP - 1) / EP of them to other ranks."""

    dispatch_bytes: int  # K copies of the microbatch's d values, per direction
    combine_bytes: int
    off_rank_share: float  # (EP - 1) / EP

    @property
    def forward_bytes(self) -> int:
        return self.dispatch_bytes + self.combine_bytes

    @property
    def off_rank_forward_bytes(self) -> float:
        return self.forward_bytes * self.off_rank_share


def all_to_all_bytes(cfg: ModelConfig, *, tokens: int, expert_parallel: int, dtype: str) -> AllToAll:
    elem = DTYPE_BYTES[dtype]
    choices = tokens * cfg.moe_top_k
    return AllToAll(dispatch_bytes=choices * cfg.d_model * elem, combine_bytes=choices * cfg.source_width * elem,
                    off_rank_share=(expert_parallel - 1) / expert_parallel)


def ep_peers_in_node(expert_parallel: int, *, stride: int, gpus_per_node: int) -> int:
    """How many of an EP group's ranks share a node with each: EP ranks are replicas d, d + 1, ...
    of one pipeline stage (global rank (dp x P + pp) x T + t: `stride` = P x T apart)."""
    if stride >= gpus_per_node:
        return 1
    return min(expert_parallel, gpus_per_node // stride)


def chunk_all_to_all_s(cfg: ModelConfig, partition: Partition, chunk_index: int, *, tokens: int, dtype: str,
                       expert_parallel: int, stride: int, gpus_per_node: int, intra_bytes_per_s: float,
                       inter_bytes_per_s: float, latency_s: float) -> float:
    """Seconds of one chunk's all-to-alls per microbatch in one direction (dispatch and combine of each
    MoE layer; the backward has the same again), not overlapped with compute."""
    layers = chunk_moe_layers(cfg, partition, chunk_index)
    if not layers or expert_parallel == 1:
        return 0.0
    moved = all_to_all_bytes(cfg, tokens=tokens, expert_parallel=expert_parallel, dtype=dtype)
    link = {"peers_in_node": ep_peers_in_node(expert_parallel, stride=stride, gpus_per_node=gpus_per_node),
            "intra_bytes_per_s": intra_bytes_per_s, "inter_bytes_per_s": inter_bytes_per_s, "latency_s": latency_s}
    return layers * (all_to_all_s(moved.dispatch_bytes, expert_parallel, **link)
                     + all_to_all_s(moved.combine_bytes, expert_parallel, **link))


def check_expert_parallel(cfg: ModelConfig, expert_parallel: int, data_parallel: int,
                          tensor_parallel: int = 1) -> None:
    """ValueError naming the rule when EP does not fit: EP divides E and D (EP ranks are replicas of
    one pipeline stage), needs experts, and T = 1 (the tp split of an MoE layer is not modelled)."""
    if isinstance(expert_parallel, bool) or not isinstance(expert_parallel, int) or expert_parallel < 1:
        raise ValueError(f"--expert-parallel {expert_parallel!r} is invalid: give an integer >= 1")
    if expert_parallel == 1:
        if cfg.moe and tensor_parallel > 1:
            raise ValueError(f"--tensor-parallel {tensor_parallel} with --moe-experts is not modelled: the "
                             "simulator prices MoE layers at T = 1 (use --tensor-parallel 1)")
        return
    if not cfg.moe:
        raise ValueError(f"--expert-parallel {expert_parallel} needs experts: give --moe-experts E")
    if cfg.moe_experts % expert_parallel:
        raise ValueError(f"--expert-parallel {expert_parallel} does not divide --moe-experts {cfg.moe_experts}: "
                         "each EP rank holds E / EP routed experts")
    if data_parallel % expert_parallel:
        raise ValueError(f"--expert-parallel {expert_parallel} does not divide --data-parallel {data_parallel}: "
                         "EP ranks are replicas of one pipeline stage")
    if tensor_parallel > 1:
        raise ValueError(f"--tensor-parallel {tensor_parallel} with --moe-experts is not modelled: the "
                         "simulator prices MoE layers at T = 1 (use --tensor-parallel 1)")
