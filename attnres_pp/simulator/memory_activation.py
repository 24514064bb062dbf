"""What one chunk's microbatch holds for its backward (`activation_bytes` -> `ChunkActivation`), in
bytes, from the shape features of `simulator.memory_features` and the units fitted to the runtime's
meter (`memory_units.json`: per variant and dtype, and per checkpointing policy, a linear form in the
features, fitted on tiny chunks by `attnres_lab.memory_units`): without checkpointing what F saves; under
`full` and `selective` also the peak inside B, the peak inside I and what I keeps until W. Derived
from shapes rather than fitted: the split backward's W store (`stored_bytes`), I's peak over several
recomputed layers (`input_peak_bytes`), the math attention kernel (`attention_correction`) and the
cache entries two chunks of a rank both keep (`shared_cache_bytes`). Pure Python: no torch."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path

from attnres_pp.comm.partition import Partition
from attnres_pp.comm.plan import PayloadPlan
from attnres_pp.model.config import ModelConfig, completed_blocks
from attnres_pp.model.weight_store_rule import GRADIENTS, OPERANDS, weight_store_kind
from attnres_pp.simulator.layer_recipe import kv_width, qkv_rows
from attnres_pp.simulator.memory_features import activation_features, checkpoint_features, recompute_passes
from attnres_pp.simulator.memory_setup import ATTENTION_KERNELS, DTYPE_BYTES
from attnres_pp.simulator.moe import (
    chunk_moe_layers,
    moe_saved_bytes,
    moe_store_correction,
    moe_weight_store_bytes,
)

UNITS_PATH = Path(__file__).with_name("memory_units.json")
# What the checkpointing units predict per chunk and microbatch (the fields of ChunkActivation).
CHECKPOINT_TARGETS = ("saved", "transient", "input_transient", "input_kept")


@cache
def load_units(path: str = str(UNITS_PATH)) -> dict:
    with open(path) as handle:
        return json.load(handle)


def units_key(cfg: ModelConfig, dtype: str) -> str:
    variant = f"lr_attnres_{cfg.key_mode}" if cfg.residual == "lr_attnres" else cfg.residual
    return f"{variant}/{dtype}"


def _linear(features: dict[str, float], coefficients: dict[str, float]) -> float:
    # A feature without a coefficient adds 0.0: skipping it leaves the sum, in the same order, unchanged.
    return sum(coefficients[name] * value for name, value in features.items() if name in coefficients)


@dataclass(frozen=True)
class ChunkActivation:
    """Bytes one chunk's microbatch holds for backward: `saved` from F until B (or W); `transient`
    the extra bytes alive at the peak inside its B (a checkpointed layer's recomputation; under a
    split backward inside the W of chunk 0, whose I has no inputs and leaves all of it to W);
    `input_transient` what the peak inside its I exceeds both B's peak and the W store by, and
    `input_kept` (checkpointing units) and `stored` what I leaves for W: the W store, fitted under
    checkpointing, else `stored_bytes`."""

    saved: int
    transient: int = 0
    input_transient: int = 0
    input_kept: int = 0
    stored: int = 0  # the W store I leaves (a split backward frees the graph at I): until W
    store: str = OPERANDS  # or GRADIENTS: `stored` holds the layer frames' inputs (`model.weight_store_rule`)


def stored_bytes(cfg: ModelConfig, partition: Partition, chunk_index: int, *, tokens: int, dtype: str,
                 tensor_parallel: int = 1, sequence_parallel: bool = False) -> int:
    """What I leaves in the W store of one chunk and microbatch (`pipeline.weight_store`): each
    linear layer's input and output gradient, per token and layer (d + (H + 2G) E) for the q, k and v
    projections (one input storage, fused or not), (d + width) for the output projection,
    (d + 2 f) for SwiGLU's gate and up (one input; GELU's up: d + f) and (f + width) for the down
    projection, plus (d + vocab) for the last chunk's head; the small weights' gradients (norm gains,
    queries) that I computes are left out. Chunk 0 keeps none: its I has no inputs and leaves the
    whole backward to W.

    On a tp rank (derived): under sequence parallelism all of it for the rank's tokens / T (the
    all-gathered inputs are gathered again for W, as Megatron does); without it the split operands
    1/T: the projections' outputs, the output projection's input and the hidden units."""
    if chunk_index == 0:
        return 0
    layer, head = store_bytes_per_layer(cfg, tokens=tokens, dtype=dtype, tensor_parallel=tensor_parallel,
                                        sequence_parallel=sequence_parallel)
    return partition.layers_per_chunk[chunk_index] * layer + (chunk_index == partition.n_chunks - 1) * head


def store_bytes_per_layer(cfg: ModelConfig, *, tokens: int, dtype: str, tensor_parallel: int = 1,
                          sequence_parallel: bool = False) -> tuple[int, int]:
    """(one transformer layer's, the head's) share of `stored_bytes` for one microbatch."""
    d, f, width, t = cfg.d_model, cfg.ff_dim, cfg.source_width, tensor_parallel
    hidden_outputs = 2 if cfg.mlp == "swiglu" else 1  # gate and up, or up
    if sequence_parallel and t > 1:
        tokens //= t
        t = 1
    per_layer = ((d + qkv_rows(cfg) // t) + (d // t + width) + (d + hidden_outputs * f // t) + (f // t + width))
    return tokens * per_layer * DTYPE_BYTES[dtype], tokens * (d + cfg.vocab_size) * DTYPE_BYTES[dtype]


def operand_bytes_per_layer(cfg: ModelConfig, *, tokens: int, dtype: str, tensor_parallel: int = 1,
                            sequence_parallel: bool = False) -> tuple[int, int]:
    """(one transformer layer's, the head's) linear input operands within `store_bytes_per_layer`:
    d for q, k, v, d / T for the output projection, d for gate and up, f / T for down; d for the
    head. The rest of the store is the output gradients, which both stores keep."""
    d, f, t = cfg.d_model, cfg.ff_dim, tensor_parallel
    if sequence_parallel and t > 1:
        tokens //= t
        t = 1
    return tokens * (d + d // t + d + f // t) * DTYPE_BYTES[dtype], tokens * d * DTYPE_BYTES[dtype]


def chunk_store_kind(cfg: ModelConfig, partition: Partition, chunk_index: int, *, tokens: int, dtype: str,
                     checkpoint_bytes: float | None, tensor_parallel: int = 1,
                     sequence_parallel: bool = False) -> tuple[str, int]:
    """The W store chunk `chunk_index`'s I leaves (`model.weight_store_rule`, the runtime's rule):
    the operands counted per product as the runtime counts them, against `checkpoint_bytes` (what F
    kept under checkpointing: the layers' inputs and the selective policy's outputs; None: none).
    Returns (kind, the layers' operand bytes: the head's, outside any layer, are stashed either way)."""
    layer, head = operand_bytes_per_layer(cfg, tokens=tokens, dtype=dtype, tensor_parallel=tensor_parallel,
                                          sequence_parallel=sequence_parallel)
    layers = partition.layers_per_chunk[chunk_index] * layer
    operands = layers + (chunk_index == partition.n_chunks - 1) * head
    return weight_store_kind(operands, None if checkpoint_bytes is None else round(checkpoint_bytes)), layers


def checkpoint_input_bytes(features: dict[str, float], dtype: str) -> float:
    """What a checkpointed chunk's layer frames keep as their inputs (`checkpoint_features`): the
    blocks they hold, one storage each, and each layer's input partial or residual."""
    return (features["out_held_blocks_tw"] + features["all_in_partial_tw"]) * DTYPE_BYTES[dtype]


def input_peak_bytes(cfg: ModelConfig, partition: Partition, chunk_index: int, transient_units: dict[str, float], *,
                     tokens: int, dtype: str, transient_correction: int = 0, tensor_parallel: int = 1,
                     sequence_parallel: bool = False, kind: str = OPERANDS) -> float:
    """The peak inside I above what F saved, derived for a chunk of several layers under `full`
    checkpointing, fp32 or bf16 (the W store sees through autocast's weight casts and stashes the
    bf16 operands, `pipeline.weight_operands`).

    I recomputes the layers last to first and stashes each layer's linear operands as it goes
    (`store_bytes_per_layer`: the recomputed inputs and the output gradients, alive until W), so
    while layer j is recomputed the stores of the head and of every layer after j are alive beside
    it: the peak is the largest over j of layer j's recomputation (the units' `transient` with j's
    pass as the last, less the inputs only the later layers kept, `recompute_passes`) plus those
    stores. With several layers that is usually an early layer's, which no linear form of the
    chunk's features can follow (fitted, it was 25% off on chunks twice the grid's width).

    Under the gradient store (`kind`) a layer's store is its output gradients alone, and the later
    layers keep their inputs (W recomputes from them)."""
    n_sequences = max(1, tokens // cfg.seq_len)
    tp = {"tensor_parallel": tensor_parallel, "sequence_parallel": sequence_parallel}
    layer, head = store_bytes_per_layer(cfg, tokens=tokens, dtype=dtype, **tp)
    if kind == GRADIENTS:
        layer -= operand_bytes_per_layer(cfg, tokens=tokens, dtype=dtype, **tp)[0]
    store = head if chunk_index == partition.n_chunks - 1 else 0
    peak = 0.0
    for features, later_inputs in reversed(recompute_passes(cfg, partition, chunk_index, tokens=tokens,
                                                            n_sequences=n_sequences, dtype=dtype, **tp)):
        recompute = max(0.0, _linear(features, transient_units)) + transient_correction
        freed = 0 if kind == GRADIENTS else later_inputs * DTYPE_BYTES[dtype]
        peak = max(peak, recompute - freed + store)
        store += layer
    return peak


# ---- the attention kernel: measured (flash) and derived (math) ----
#
# The units are fitted on CPU runs, where torch's scaled_dot_product_attention runs its CPU flash
# kernel (`_scaled_dot_product_flash_attention_for_cpu`, as the CUDA flash / efficient kernels): it
# saves q, k, v (views of the projections' storages, or the rotated / normalised q and k), its output
# (a view whose storage the output projection saves too) and the log-sum-exp, fp32 H x T per
# sequence (the `layer_th` column). So the fitted units are flash's. The math path
# (`SDPBackend.MATH`) is derived from shapes, not fitted: it saves sqrt(scale) q and k and a
# contiguous v as new tensors, H heads wide, and the softmax probabilities H x T x T per sequence,
# all fp32 (it upcasts bf16 inputs unless `allow_fp16_bf16_reduction_math_sdp`), and no log-sum-exp;
# its output is a new tensor that the output projection's input replaces (a copy either way).

def flash_attention_saved(cfg: ModelConfig, *, seq_len: int, dtype: str) -> int:
    """Bytes one layer's flash attention saves per sequence beyond the output projection's input (its
    output's storage) and beyond what the layer saves anyway: q, k, v and the fp32 log-sum-exp. q and
    k are views of the fused projection's storage, unless rotary positions or QK-norm made them new
    tensors, H E + G E numbers per token; v is a view of that storage, which it keeps whole. Under
    fp32 QK-norm's RMSNorms save those storages themselves (their input), so the views add nothing."""
    t, elem = seq_len, DTYPE_BYTES[dtype]
    lse = 4 * cfg.n_heads * t
    held = cfg.qk_norm and dtype == "fp32"  # bf16: the norms save an fp32 copy of their input instead
    if cfg.positions == "rope" or cfg.qk_norm:
        return t * (cfg.d_model + kv_width(cfg)) * elem + (0 if held else t * qkv_rows(cfg) * elem) + lse
    # grouped heads: q is a copy in head order (`layers.Attention._heads`), saved beside the storage
    copied_q = t * cfg.d_model * elem if cfg.kv_heads != cfg.n_heads else 0
    return t * qkv_rows(cfg) * elem + copied_q + lse


def math_attention_saved(cfg: ModelConfig, *, seq_len: int, dtype: str) -> int:
    """Bytes one layer's math attention saves per sequence beyond the output projection's input:
    sqrt(scale) q and k and v, new fp32 tensors H heads wide (bf16 upcast; grouped kv heads repeated
    to the query heads; v made contiguous), and the fp32 probabilities H x T x T."""
    t, d = seq_len, cfg.d_model
    return 3 * 4 * t * d + 4 * cfg.n_heads * t * t


def attention_correction(cfg: ModelConfig, partition: Partition, chunk_index: int, *, tokens: int, dtype: str,
                         activation_checkpoint: str, attention_kernel: str) -> dict[str, int]:
    """Bytes to add to each fitted target (`saved`, and under checkpointing `transient`) for
    `attention_kernel`: 0 under flash (the units measure it), math's saves minus flash's under math.

    Per policy, where a layer's attention saves live: `none`, in what F saves, every layer; `full`,
    in B's recomputation of one layer (the `transient`, `last_layer_th`'s target); `selective`, F
    keeps flash's outputs (the SAC policy names the fused kernel) but no piece of math's (batched
    products and softmax are recomputed), so `saved` loses the log-sum-exp of every layer and the
    recomputation holds math's saves beside the kept qkv. I's targets are left as fitted: its
    recomputation is B's, and what it keeps for W are the linear layers' operands."""
    if attention_kernel not in ATTENTION_KERNELS:
        raise ValueError(f"--attention-kernel {attention_kernel!r} is invalid: choose one of "
                         f"{', '.join(ATTENTION_KERNELS)}")
    if attention_kernel == "flash":
        return {}
    n_sequences = max(1, tokens // cfg.seq_len)
    layers = partition.layers_per_chunk[chunk_index]
    flash = flash_attention_saved(cfg, seq_len=cfg.seq_len, dtype=dtype)
    math_ = math_attention_saved(cfg, seq_len=cfg.seq_len, dtype=dtype)
    if activation_checkpoint == "none":
        return {"saved": layers * n_sequences * (math_ - flash)}
    if activation_checkpoint == "full":
        return {"transient": n_sequences * (math_ - flash)}
    lse = 4 * cfg.n_heads * cfg.seq_len
    return {"saved": -layers * n_sequences * lse, "transient": n_sequences * math_}


def activation_bytes(cfg: ModelConfig, partition: Partition, chunk_index: int, *, tokens: int, dtype: str,
                     activation_checkpoint: str = "none", weight_copies: bool = True,
                     attention_kernel: str = "flash", tensor_parallel: int = 1,
                     sequence_parallel: bool = False, expert_parallel: int = 1,
                     expert_weight_copies: bool | None = None, rows_factor: float = 1.0) -> ChunkActivation:
    """What F(chunk_index, mb) saves for backward, in bytes (`dense_activation_bytes`), with each MoE
    layer's router and routed experts added (`simulator.moe.moe_saved_bytes`, derived): to what F
    saves without checkpointing; under `full` and `selective` to the recomputation inside B and I
    (the checkpointed layer saves its input only, and the selective policy keeps no grouped-matmul
    output), the last layer of a chunk with MoE layers being one of them (dense layers come first);
    the W store (`moe_store_correction`, `moe_weight_store_bytes`) under a split backward.
    `expert_weight_copies`: the routed experts' bf16 casts (None: as `weight_copies`; FSDP2 at D = EP
    leaves the slices whole); `rows_factor`: the rows this rank's experts receive over the balanced
    M (`MemorySetup.moe_load_factor`)."""
    unit = dense_activation_bytes(cfg, partition, chunk_index, tokens=tokens, dtype=dtype,
                                  activation_checkpoint=activation_checkpoint, weight_copies=weight_copies,
                                  attention_kernel=attention_kernel, tensor_parallel=tensor_parallel,
                                  sequence_parallel=sequence_parallel)
    layers = chunk_moe_layers(cfg, partition, chunk_index)
    if not layers:
        return unit
    copies = weight_copies if expert_weight_copies is None else expert_weight_copies
    extra = moe_saved_bytes(cfg, tokens=tokens, dtype=dtype, expert_parallel=expert_parallel,
                            weight_copies=copies, rows_factor=rows_factor)
    if activation_checkpoint == "none":
        store = 0 if chunk_index == 0 else layers * moe_store_correction(cfg, tokens=tokens, dtype=dtype,
                                                                          expert_parallel=expert_parallel,
                                                                          rows_factor=rows_factor)
        return replace(unit, saved=unit.saved + layers * extra, stored=max(0, unit.stored + store))
    # I recomputes the layer and leaves the router's and routed experts' store until W (chunk 0's I
    # has no inputs: W is its whole backward).
    kept = 0 if chunk_index == 0 else layers * moe_weight_store_bytes(cfg, tokens=tokens, dtype=dtype,
                                                                       expert_parallel=expert_parallel,
                                                                       rows_factor=rows_factor)
    return replace(unit, transient=unit.transient + extra, input_kept=unit.input_kept + kept,
                   stored=unit.stored + kept)


def dense_activation_bytes(cfg: ModelConfig, partition: Partition, chunk_index: int, *, tokens: int, dtype: str,
                           activation_checkpoint: str = "none", weight_copies: bool = True,
                           attention_kernel: str = "flash", tensor_parallel: int = 1,
                           sequence_parallel: bool = False) -> ChunkActivation:
    """What F(chunk_index, mb) saves for backward, in bytes (see the module docstring).

    `weight_copies`: bf16 autocast casts the fp32 weights in every forward and the backward keeps
    each microbatch's copy; False under FSDP2's bf16 parameters (all-gathered once, no casts).
    `attention_kernel`: flash (measured) or math (derived: `attention_correction`).
    `tensor_parallel`, `sequence_parallel`: one tp rank's share (derived, docs/spec.md section 10:
    `memory_features.activation_features` says which features scale; math's correction, per head, 1/T)."""
    n_sequences = max(1, tokens // cfg.seq_len)
    tp = {"tensor_parallel": tensor_parallel, "sequence_parallel": sequence_parallel}
    correction = attention_correction(cfg, partition, chunk_index, tokens=tokens, dtype=dtype,
                                      activation_checkpoint=activation_checkpoint, attention_kernel=attention_kernel)
    correction = {k: v // tensor_parallel for k, v in correction.items()}
    if activation_checkpoint == "none":
        features = activation_features(cfg, partition, chunk_index, tokens=tokens, n_sequences=n_sequences,
                                       dtype=dtype, **tp)
        if not weight_copies:
            features["matmul_params"] = 0
        units = load_units()["units"][units_key(cfg, dtype)]["coefficients"]
        return ChunkActivation(saved=round(max(0.0, _linear(features, units))) + correction.get("saved", 0),
                               stored=stored_bytes(cfg, partition, chunk_index, tokens=tokens, dtype=dtype, **tp))
    features = checkpoint_features(cfg, partition, chunk_index, tokens=tokens, n_sequences=n_sequences, dtype=dtype,
                                   **tp)
    if not weight_copies:
        features = {name: 0 if name.endswith("matmul_params") else value for name, value in features.items()}
    units = load_units()["checkpoint_units"][f"{activation_checkpoint}/{units_key(cfg, dtype)}"]["coefficients"]
    values = {target: max(0.0, max(0.0, _linear(features, units[target])) + correction.get(target, 0))
              for target in CHECKPOINT_TARGETS}
    kind = OPERANDS
    if chunk_index == 0:  # its I has no inputs: nothing runs there, W is the whole backward
        values["input_transient"] = values["input_kept"] = 0.0
    else:
        # The units price the operand store; the gradient store keeps the layer frames' inputs
        # instead of the layers' operands (derived: `chunk_store_kind`, the runtime's rule).
        frames_kept = checkpoint_input_bytes(features, dtype)
        if activation_checkpoint == "selective":
            frames_kept = max(frames_kept, values["saved"])  # and the policy's kept outputs
        kind, operands = chunk_store_kind(cfg, partition, chunk_index, tokens=tokens, dtype=dtype,
                                          checkpoint_bytes=frames_kept, **tp)
        if kind == GRADIENTS:
            values["input_kept"] = max(0.0, values["input_kept"] - operands + frames_kept)
    if chunk_index and activation_checkpoint == "full" and partition.layers_per_chunk[chunk_index] > 1:
        # Several layers: I peaks while an early layer is recomputed beside the later ones' stores
        # (derived, `input_peak_bytes`); with one, late, beside the whole store, as fitted.
        peak = input_peak_bytes(cfg, partition, chunk_index, units["transient"], tokens=tokens, dtype=dtype,
                                transient_correction=correction.get("transient", 0), kind=kind, **tp)
        values["input_transient"] = max(0.0, peak - max(values["transient"], values["input_kept"] - values["saved"]))
    # Under checkpointing the store is what the fitted units say I leaves (`input_kept`): the
    # linear layers' inputs there are recomputed tensors, some shared with what F kept; under the
    # gradient store, what F kept in their place.
    return ChunkActivation(**{target: round(value) for target, value in values.items()},
                           stored=round(values["input_kept"]), store=kind)


# ---- blocks two chunks of a rank both keep ----

def held_blocks(cfg: ModelConfig, partition: Partition, chunk_index: int) -> int:
    """Under checkpointing, the blocks 0 .. n - 1 a chunk's layer frames keep as their inputs: every
    block completed before its last layer starts (`memory_features.checkpoint_features`'s
    `out_held_blocks_tw`); a block the chunk completes with its last sublayer is its output only."""
    if not cfg.uses_depth_attention:
        return 0
    sublayers = partition.sublayer_range(chunk_index)
    last_start = sublayers.start + 2 * ((len(sublayers) - 1) // 2)
    return 1 + completed_blocks(last_start, cfg.block_ends)


def shared_cache_bytes(cfg: ModelConfig, partition: Partition, plan: PayloadPlan, chunk_index: int, schedule, *,
                       tensor_bytes: int) -> int:
    """Bytes of chunk `chunk_index`'s cache reads that the chunk of its rank which put them also keeps
    (checkpointing: a block a layer of the putting chunk reads is held by that layer's frame). The
    entry is one storage, saved by both forwards of a microbatch, so the meter counts it once: with
    the putter's F (earlier) and until its backward (later), both around this chunk's F and B. The
    units, fitted on single chunks whose every input is a tensor of its own, count it in both."""
    rank = schedule.rank_of(chunk_index)
    shared = 0
    for source in plan.chunks[chunk_index].cache_reads:
        putter = max((c for c in range(chunk_index) if schedule.rank_of(c) == rank
                      and source in plan.chunks[c].cache_puts), default=None)
        if putter is not None and source.kind == "block" and source.index < held_blocks(cfg, partition, putter):
            shared += tensor_bytes
    return shared

