"""Per-rank memory of a training step, predicted from shapes and the schedule's action order
(docs/spec.md section 8), with the keys a run counts in `summary.json`'s `memory_per_rank` (RSS excluded).

    param_bytes       fp32 master weights of the rank's chunks, by parameter shape (the module list
                      of `model.transformer` / `pipeline.chunk`; MSAR's stream convolutions on every
                      rank); under FSDP2 over D replicas ceil(dim0 / D) rows of each parameter but
                      those convolutions and 0-d scalars, which stay whole
    grad_bytes        the same shapes (fp32 gradients, sharded alike)
    optimizer_bytes   AdamW's two moments exp_avg and exp_avg_sq (fp32, sharded alike), as docs/spec.md section 8
                      and the runtime's count define it (its 0-d `step` tensors, 4 bytes each, left out)
    activation_peak   the peak over the rank's action order of the bytes saved for backward, as the
                      runtime's meter counts them (`pipeline.memory_meter`, the moments inside an
                      action included): F(c, mb) adds chunk c's saved bytes, B frees them; I frees
                      them too but leaves the W store (each linear layer's input and output
                      gradient, `stored_bytes`), which W frees (chunk 0's I has no inputs: its W is
                      the whole backward). Under activation checkpointing a backward recomputes
                      layers (a transient inside B or I, gone with it). Under FSDP2 the
                      all-gathered parameters that the forwards save count from the chunk's first F to
                      its last backward (one storage each, whatever the microbatch)
    cache_peak        entries put by F(c) live until the rank's last chunk's forward frees them; a
                      gradient deposit lives from the I/B of the rank's last chunk (the first backward
                      of that microbatch on the rank) until the I/B of the chunk that put the entry
    transport_buffer_bytes
                      the receive slots a shared-memory transport maps for the whole step (`--launcher
                      local` and `ray` on one host, `comm.shm_transport`): one slot per message the rank
                      receives from another rank in a step, its tensors' elements rounded up to 64, in
                      the hop dtype; not a saved tensor (a kept received hop is a view of its slot, which
                      the activation term counts too), 0 under the in-process launcher (`launcher`)
The moment of a rank's peak is that of activations + cache together (not the sum of their peaks);
the peak adds the held terms and the transport's slots, alive through the whole step.

A chunk's bytes per microbatch come from `memory_units.json`: per variant and dtype (and per
checkpointing policy) a linear form in the shape features of `simulator.memory_features` (tokens x
widths, per layer, per depth-read segment, per merge, the head, the bf16 weight copies), fitted to
the runtime's meter on tiny chunks (`bench.memory_units`, the command and the fitted cases are in
the JSON): without checkpointing what F saves; under `full` and `selective` also the peak inside B,
the peak inside I and what I keeps until W (`ChunkActivation`). Pure Python: no torch.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from functools import cache
from pathlib import Path

from attnres_pp.comm.partition import Partition
from attnres_pp.comm.plan import PayloadPlan
from attnres_pp.model.config import ModelConfig, completed_blocks
from attnres_pp.simulator.memory_features import (  # noqa: F401 (re-exported: attnres_lab.memory_units, tests)
    CHECKPOINT_FEATURES,
    FEATURES,
    activation_features,
    checkpoint_features,
    depth_segments,
    matmul_parameters,
    recompute_passes,
)

DTYPE_BYTES = {"fp32": 4, "bf16": 2}
AC_POLICIES = ("none", "full", "selective")
DP_SHARDS = ("replicate", "fsdp")
# train's --fsdp-reshard-after-forward (`pipeline.config.RESHARD_AFTER_FORWARD`; the simulator reads no pipeline)
RESHARD_AFTER_FORWARD = ("never", "always")
ATTENTION_KERNELS = ("flash", "math")
MEMORY_KEYS = ("param_bytes", "grad_bytes", "optimizer_bytes", "activation_peak_bytes", "cache_peak_bytes")
# Launchers whose ranks on one host hand hops over through shared-memory slots (`comm.shm_transport`).
LAUNCHERS = ("inprocess", "local", "ray")
SLOT_LAUNCHERS = ("local", "ray")
SLOT_ALIGN_ELEMENTS = 64  # comm.shm_transport.ALIGN_ELEMENTS (the simulator imports no torch)
UNITS_PATH = Path(__file__).with_name("memory_units.json")
# What the checkpointing units predict per chunk and microbatch (the fields of ChunkActivation).
CHECKPOINT_TARGETS = ("saved", "transient", "input_transient", "input_kept")

# ---- parameters, gradients, optimizer state ----

def _read_shapes(cfg: ModelConfig) -> list[tuple[int, ...]]:
    """The parameters of one reading site (model.depth.DepthRead): its query (MSAR: per stream, and the
    gate's weight, scale and bias), and with `key_norm_gain` the key gain, shaped as the query."""
    if cfg.residual == "standard":
        return []
    if cfg.residual == "msar":
        m, d = cfg.n_streams, cfg.d_model
        return [(m, d), (m * d, m), (), (m,)] + [(m, d)] * cfg.key_norm_gain
    return [(cfg.query_dim,)] * (1 + cfg.key_norm_gain)


def rank_parameter_shapes(cfg: ModelConfig, partition: Partition, pp_rank: int,
                          tensor_parallel: int = 1) -> list[tuple[int, ...]]:
    """Shapes of every parameter rank `pp_rank` holds (`pipeline.chunk.rank_parameters`); on one of
    `tensor_parallel` tp ranks (docs/spec.md section 10) the local shards of the split matrices (q, k, v
    and the MLP's first projection column-parallel, dim 0 / T; the attention output and the MLP's
    second projection row-parallel, dim 1 / T) and every other parameter whole (replicated over tp:
    norms, depth-attention parameters, embedding, positions, key projection, head)."""
    d, f, width, t = cfg.d_model, cfg.ff_dim, cfg.source_width, tensor_parallel
    shapes: list[tuple[int, ...]] = []
    chunks = partition.chunks_of(pp_rank)
    if 0 in chunks:
        shapes += [(cfg.vocab_size, d), (cfg.seq_len, d)]
        if cfg.projected_key_rank:
            shapes.append((cfg.projected_key_rank, d))
    layer = [(d,), (3 * d // t, d), (width, d // t), *_read_shapes(cfg), (d,), (f // t, d), (width, f // t),
             *_read_shapes(cfg)]
    for c in chunks:
        shapes += layer * partition.layers_per_chunk[c]
    if partition.n_chunks - 1 in chunks:
        shapes += [*_read_shapes(cfg), (d,), (cfg.vocab_size, d)]
    return shapes + tied_parameter_shapes(cfg)


def tied_parameter_shapes(cfg: ModelConfig) -> list[tuple[int, ...]]:
    """MSAR's stream convolutions (`model.depth.StreamConvs`), on every rank: FSDP2 leaves them whole
    (`train.fsdp` shards only the layers, embedding and head), so they are never split over D."""
    if cfg.residual != "msar":
        return []
    return [(k, cfg.d_model) for _source in range(cfg.n_blocks + 1) for k in cfg.stream_kernels]


def shard_numel(shape: tuple[int, ...], data_parallel: int, dp_shard: str) -> int:
    """Elements a rank holds of one parameter: all of it, or FSDP2's padded dim-0 shard."""
    numel = math.prod(shape)
    if dp_shard == "replicate" or data_parallel == 1 or not shape:
        return numel
    return -(-shape[0] // data_parallel) * (numel // shape[0])


def local_numel(shape: tuple[int, ...], data_parallel: int, dp_shard: str, dp_rank: int) -> int:
    """Elements of replica `dp_rank`'s unpadded shard (torch.chunk's rows; the last ranks may get fewer)."""
    if dp_shard == "replicate" or data_parallel == 1 or not shape:
        return math.prod(shape)
    rows = -(-shape[0] // data_parallel)
    return max(0, min(rows, shape[0] - dp_rank * rows)) * (math.prod(shape) // shape[0])


def state_bytes(shapes: list[tuple[int, ...]], *, data_parallel: int, dp_shard: str, dp_rank: int = 0,
                whole: list[tuple[int, ...]] = ()) -> dict[str, int]:
    """param/grad/optimizer bytes of one rank (fp32 throughout; optimizer: AdamW's two moments).
    `whole`: parameters among `shapes` that stay unsharded under FSDP2 (`tied_parameter_shapes`).

    Under FSDP2 a parameter's shard storage and the reduce-scattered gradient buffer are padded to
    ceil(dim0 / D) rows on every replica, while AdamW's moments are made like the unpadded local
    shard (`zeros_like`), so replica `dp_rank`'s optimizer state can be smaller than its parameters."""
    sharded = list(shapes)
    for shape in whole:
        sharded.remove(shape)
    numel = sum(shard_numel(s, data_parallel, dp_shard) for s in sharded) + sum(math.prod(s) for s in whole)
    local = sum(local_numel(s, data_parallel, dp_shard, dp_rank) for s in sharded) + sum(math.prod(s) for s in whole)
    return {"param_bytes": 4 * numel, "grad_bytes": 4 * numel, "optimizer_bytes": 8 * local}


@cache
def load_units(path: str = str(UNITS_PATH)) -> dict:
    with open(path) as handle:
        return json.load(handle)


def units_key(cfg: ModelConfig, dtype: str) -> str:
    variant = f"lr_attnres_{cfg.key_mode}" if cfg.residual == "lr_attnres" else cfg.residual
    return f"{variant}/{dtype}"


def _linear(features: dict[str, float], coefficients: dict[str, float]) -> float:
    return sum(coefficients.get(name, 0.0) * value for name, value in features.items())


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


def stored_bytes(cfg: ModelConfig, partition: Partition, chunk_index: int, *, tokens: int, dtype: str,
                 tensor_parallel: int = 1, sequence_parallel: bool = False) -> int:
    """What I leaves in the W store of one chunk and microbatch (`pipeline.weight_store`): each
    linear layer's input and output gradient, per token and layer (d + 3d) for qkv, (d + width)
    for the output projection, (d + ff) and (ff + width) for the MLP, plus (d + vocab) for the last
    chunk's head; the small weights' gradients (norm gains, queries) that I computes are left out.
    Chunk 0 keeps none: its I has no inputs and leaves the whole backward to W.

    On a tp rank (derived): under sequence parallelism all of it for the rank's tokens / T (the
    all-gathered inputs are gathered again for W, as Megatron does); without it the split operands
    1/T: (d + 3d/T), (d/T + width), (d + f/T), (f/T + width) per token and layer."""
    if chunk_index == 0:
        return 0
    layer, head = store_bytes_per_layer(cfg, tokens=tokens, dtype=dtype, tensor_parallel=tensor_parallel,
                                        sequence_parallel=sequence_parallel)
    return partition.layers_per_chunk[chunk_index] * layer + (chunk_index == partition.n_chunks - 1) * head


def store_bytes_per_layer(cfg: ModelConfig, *, tokens: int, dtype: str, tensor_parallel: int = 1,
                          sequence_parallel: bool = False) -> tuple[int, int]:
    """(one transformer layer's, the head's) share of `stored_bytes` for one microbatch."""
    d, f, width, t = cfg.d_model, cfg.ff_dim, cfg.source_width, tensor_parallel
    if sequence_parallel and t > 1:
        tokens //= t
        per_layer = (d + 3 * d) + (d + width) + (d + f) + (f + width)
    else:
        per_layer = (d + 3 * d // t) + (d // t + width) + (d + f // t) + (f // t + width)
    return tokens * per_layer * DTYPE_BYTES[dtype], tokens * (d + cfg.vocab_size) * DTYPE_BYTES[dtype]


def input_peak_bytes(cfg: ModelConfig, partition: Partition, chunk_index: int, transient_units: dict[str, float], *,
                     tokens: int, dtype: str, transient_correction: int = 0, tensor_parallel: int = 1,
                     sequence_parallel: bool = False) -> float:
    """The peak inside I above what F saved, derived for a chunk of several layers under `full`
    checkpointing where the linear layers' weights are the leaves themselves (fp32: under bf16
    autocast they enter through their casts, and I's engine call returns their weight-sized
    gradients at its end instead, `pipeline.weight_store`).

    I recomputes the layers last to first and stashes each layer's linear operands as it goes
    (`store_bytes_per_layer`: the recomputed inputs and the output gradients, alive until W), so
    while layer j is recomputed the stores of the head and of every layer after j are alive beside
    it: the peak is the largest over j of layer j's recomputation (the units' `transient` with j's
    pass as the last, less the inputs only the later layers kept, `recompute_passes`) plus those
    stores. With several layers that is usually an early layer's, which no linear form of the
    chunk's features can follow (fitted, it was 25% off on chunks twice the grid's width)."""
    n_sequences = max(1, tokens // cfg.seq_len)
    tp = {"tensor_parallel": tensor_parallel, "sequence_parallel": sequence_parallel}
    layer, head = store_bytes_per_layer(cfg, tokens=tokens, dtype=dtype, **tp)
    store = head if chunk_index == partition.n_chunks - 1 else 0
    peak = 0.0
    for features, later_inputs in reversed(recompute_passes(cfg, partition, chunk_index, tokens=tokens,
                                                            n_sequences=n_sequences, dtype=dtype, **tp)):
        recompute = max(0.0, _linear(features, transient_units)) + transient_correction
        peak = max(peak, recompute - later_inputs * DTYPE_BYTES[dtype] + store)
        store += layer
    return peak


# ---- the attention kernel: measured (flash) and derived (math) ----
#
# The units are fitted on CPU runs, where torch's scaled_dot_product_attention runs its CPU flash
# kernel (`_scaled_dot_product_flash_attention_for_cpu`, as the CUDA flash / efficient kernels): it
# saves q, k, v (views of the qkv projection's one storage), its output (a view whose storage the
# output projection saves too) and the log-sum-exp, fp32 H x T per sequence (the `layer_th` column).
# So the fitted units are flash's. The math path (`SDPBackend.MATH`) is derived from shapes, not
# fitted: it saves sqrt(scale) q and k as new tensors, the softmax probabilities H x T x T per
# sequence and v, all fp32 (it upcasts bf16 inputs unless `allow_fp16_bf16_reduction_math_sdp`),
# and no log-sum-exp.

def flash_attention_saved(cfg: ModelConfig, *, seq_len: int, dtype: str) -> int:
    """Bytes one layer's flash attention saves per sequence beyond the output projection's input:
    q, k, v (one qkv storage, compute dtype) and the fp32 log-sum-exp."""
    t, d = seq_len, cfg.d_model
    return 3 * t * d * DTYPE_BYTES[dtype] + 4 * cfg.n_heads * t


def math_attention_saved(cfg: ModelConfig, *, seq_len: int, dtype: str) -> int:
    """Bytes one layer's math attention saves per sequence beyond the output projection's input:
    scaled q and k, fp32 copies; the fp32 probabilities H x T x T; v, an fp32 copy under bf16, else a
    view that keeps the qkv storage (fp32) alive."""
    t, d = seq_len, cfg.d_model
    v = 4 * t * d if dtype == "bf16" else 3 * t * d * DTYPE_BYTES[dtype]
    return 4 * t * d + 4 * t * d + v + 4 * cfg.n_heads * t * t


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
    qkv_view = 0 if dtype == "bf16" else 3 * cfg.seq_len * cfg.d_model * DTYPE_BYTES[dtype]
    return {"saved": -layers * n_sequences * lse, "transient": n_sequences * (math_ - qkv_view)}


def activation_bytes(cfg: ModelConfig, partition: Partition, chunk_index: int, *, tokens: int, dtype: str,
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
    if chunk_index == 0:  # its I has no inputs: nothing runs there, W is the whole backward
        values["input_transient"] = values["input_kept"] = 0.0
    elif activation_checkpoint == "full" and dtype == "fp32" and partition.layers_per_chunk[chunk_index] > 1:
        # Several layers: I peaks while an early layer is recomputed beside the later ones' stores
        # (derived, `input_peak_bytes`); with one, late, beside the whole store, as fitted.
        peak = input_peak_bytes(cfg, partition, chunk_index, units["transient"], tokens=tokens, dtype=dtype,
                                transient_correction=correction.get("transient", 0), **tp)
        values["input_transient"] = max(0.0, peak - max(values["transient"], values["input_kept"] - values["saved"]))
    # Under checkpointing the store is what the fitted units say I leaves (`input_kept`): the
    # linear layers' inputs there are recomputed tensors, some shared with what F kept.
    return ChunkActivation(**{target: round(value) for target, value in values.items()},
                           stored=round(values["input_kept"]))


def saved_parameter_shapes(cfg: ModelConfig, partition: Partition, chunk_index: int,
                           tensor_parallel: int = 1) -> list[tuple[int, ...]]:
    """Shapes of chunk `chunk_index`'s parameters that its autograd nodes save (a matrix product's
    weight, a norm's gain, MSAR's gate weights): all but the embedding tables (a lookup saves the
    indices), the AttnRes / LR-AttnRes pseudo-queries (their reads save the stacked queries, a copy)
    and MSAR's gate scalars; MSAR's per-stream queries, a few d-vectors, are counted. With
    `key_norm_gain` the scoring query's product (query x gain, `model.depth.DepthRead`) saves both."""
    d, f, width, t = cfg.d_model, cfg.ff_dim, cfg.source_width, tensor_parallel
    read = [(cfg.n_streams, d), (cfg.n_streams * d, cfg.n_streams)] if cfg.residual == "msar" else []
    if cfg.key_norm_gain and cfg.uses_depth_attention:
        read += [(cfg.n_streams, d)] if cfg.residual == "msar" else [(cfg.query_dim,)] * 2
    shapes = [(d,), (3 * d // t, d), (width, d // t), *read, (d,), (f // t, d), (width, f // t), *read] * \
        partition.layers_per_chunk[chunk_index]
    if chunk_index == 0 and cfg.projected_key_rank:
        shapes.append((cfg.projected_key_rank, d))
    if chunk_index == partition.n_chunks - 1:
        shapes += [*read, (d,), (cfg.vocab_size, d)]
    return shapes


def gathered_parameter_bytes(cfg: ModelConfig, partition: Partition, chunk_index: int, *, data_parallel: int,
                             dtype: str, tensor_parallel: int = 1) -> int:
    """Bytes of the FSDP2 all-gathered (unsharded) parameters chunk `chunk_index`'s nodes save: each
    is a view of its all-gather buffer, whose storage holds D padded shards (ceil(dim0 / D) x D rows)."""
    return sum(shard_numel(s, data_parallel, "fsdp") * data_parallel for s in
               saved_parameter_shapes(cfg, partition, chunk_index, tensor_parallel)) * DTYPE_BYTES[dtype]


def chunk_gathered_bytes(cfg: ModelConfig, partition: Partition, chunk_index: int, *, dtype: str,
                         tensor_parallel: int = 1) -> int:
    """Bytes of chunk `chunk_index`'s parameters all-gathered in the compute dtype while its FSDP2 units
    are unsharded (`train.fsdp`: its layers, the embedding on chunk 0, the head on the last chunk;
    MSAR's tied convolutions are not units). Summed over a rank's chunks it is the copy that
    resharding never keeps through the step (`predict_ranks`)."""
    d, f, width, t = cfg.d_model, cfg.ff_dim, cfg.source_width, tensor_parallel
    shapes: list[tuple[int, ...]] = []
    if chunk_index == 0:
        shapes += [(cfg.vocab_size, d), (cfg.seq_len, d)]
        if cfg.projected_key_rank:
            shapes.append((cfg.projected_key_rank, d))
    shapes += [(d,), (3 * d // t, d), (width, d // t), *_read_shapes(cfg), (d,), (f // t, d), (width, f // t),
               *_read_shapes(cfg)] * partition.layers_per_chunk[chunk_index]
    if chunk_index == partition.n_chunks - 1:
        shapes += [*_read_shapes(cfg), (d,), (cfg.vocab_size, d)]
    return sum(math.prod(s) for s in shapes) * DTYPE_BYTES[dtype]


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


# ---- the shared-memory transport's receive slots ----

def transport_slot_bytes(schedule, plan: PayloadPlan, pp_rank: int, *, tokens: int, cfg: ModelConfig,
                         dtype: str) -> int:
    """Bytes of the receive slots rank `pp_rank` maps for the step (`comm.shm_transport._layout`):
    per message it receives from another rank (a hop whose sending chunk is on another rank), the
    hop's tensors (`pipeline.routes`: the chunk's received sources forward, its sent ones' gradients
    backward; [tokens, width] each, the residual's width for the standard stream) in one slot,
    rounded up to 64 elements, in the hop dtype."""
    from attnres_pp.comm.plan import RESIDUAL

    def width(source) -> int:
        return cfg.d_model if source == RESIDUAL else cfg.source_width

    # The compute order names the messages (the comm actions a lowered schedule adds match them):
    # F(c) receives chunk c - 1's hop, a backward (B or I) of c the gradients of the hop c sent.
    last = plan.partition.n_chunks - 1
    total = 0
    for action in schedule.rank_actions[pp_rank]:
        kind, c = action.kind.value, action.chunk_index
        if kind == "F" and c > 0 and schedule.rank_of(c - 1) != pp_rank:
            sources = plan.chunks[c].received
        elif kind in ("B", "I") and c < last and schedule.rank_of(c + 1) != pp_rank:
            sources = plan.chunks[c].sent
        else:
            continue
        numel = sum(tokens * width(s) for s in sources)
        total += -(-numel // SLOT_ALIGN_ELEMENTS) * SLOT_ALIGN_ELEMENTS
    return total * DTYPE_BYTES[dtype]


# ---- the walk over the action order ----

@dataclass(frozen=True, kw_only=True)
class RankMemory:
    """One rank's prediction: `terms` has the MEMORY_KEYS; `peak_action` is the action at whose end
    (or, for a recomputing backward, during which) activations + cache peak."""

    terms: dict[str, int]
    peak_bytes: int
    peak_action: str
    dominant: str = field(default="")
    gathered_bytes: int = 0  # fsdp: the all-gathered parameters inside peak_bytes (none unless fsdp)


def walk_rank(actions, *, saved_by_chunk: list[ChunkActivation], plan: PayloadPlan | None,
              tensor_bytes: int, resident_by_chunk: list[int] | None = None) -> tuple[int, int, int, str]:
    """(activation peak, cache peak, peak of both together, action of that peak) over one rank's
    actions (objects with kind, chunk_index, microbatch_index).

    `resident_by_chunk`: bytes the activation term counts from a chunk's first F to the end of its
    last backward whatever the microbatch (FSDP2's all-gathered parameters, saved by every forward:
    one storage each). They are not in the peak of both together, which the caller adds them to
    for the whole step (FSDP2 holds them from the first all-gather to the reduce-scatter)."""
    return walk_rank_gathered(actions, saved_by_chunk=saved_by_chunk, plan=plan, tensor_bytes=tensor_bytes,
                              resident_by_chunk=resident_by_chunk)[:4]


def walk_rank_gathered(actions, *, saved_by_chunk: list[ChunkActivation], plan: PayloadPlan | None,
                       tensor_bytes: int, resident_by_chunk: list[int] | None = None,
                       gathered_by_chunk: list[int] | None = None) -> tuple[int, int, int, str, int]:
    """`walk_rank`'s four figures and the all-gathered parameter bytes inside the peak of both together.

    `gathered_by_chunk` (fsdp, reshard after forward always; `chunk_gathered_bytes`): a chunk's
    units are unsharded by its first action that finds them sharded (every action of `train.fsdp`
    unshards first), stay so through any backward, and are resharded at the end of each F: the
    whole gathered copy of chunk c is in the peak of both together while c is unsharded, and the
    parameters its forwards saved (`resident_by_chunk`, views of that copy, freed with it) count as
    activations only while c is unsharded and a graph of c is alive. The step starts sharded.
    Without it, the fifth figure is 0 (resharding never: the caller adds the whole copy)."""
    ios = plan.chunks if plan is not None else None
    always = gathered_by_chunk is not None
    unsharded: set[int] = set()
    graphs: dict[int, int] = {}  # chunk -> microbatches whose graph (or W store) is alive
    gathered_at_peak = 0
    deposits: dict[int, set] = {}  # microbatch -> the sources whose gradient deposit is alive
    cache_entries: dict[int, int] = {}  # microbatch -> len(deposits[mb]) as counted in cache_live
    actions = list(actions)
    last_backward = {a.chunk_index: i for i, a in enumerate(actions) if a.kind.value in ("B", "W")}
    act = cache_live = resident = 0
    act_peak = cache_peak = total_peak = 0
    peak_action = ""
    started: set[int] = set()
    for position, action in enumerate(actions):
        kind, c, mb = action.kind.value, action.chunk_index, action.microbatch_index
        unit = saved_by_chunk[c]
        extra = 0  # bytes alive only inside this action (a recomputation)
        if always:
            unsharded.add(c)
        if kind == "F":
            if resident_by_chunk is not None and c not in started and not always:
                started.add(c)
                resident += resident_by_chunk[c]
            if always:
                graphs[c] = graphs.get(c, 0) + 1
            act += unit.saved
            if ios is not None:
                cache_live += len(ios[c].cache_puts) * tensor_bytes
            cache_peak = max(cache_peak, cache_live)
        elif kind in ("B", "I"):
            # I's peak comes early, as B's (the last layer recomputed, the head's gradients), late,
            # once the W store is whole and what F saved is gone, or in between, by `input_transient`
            # above the larger of those (`bench.memory_units` measures it so).
            extra = (unit.transient if kind == "B" else 0 if c == 0  # chunk 0's I runs nothing
                     else max(unit.transient, unit.stored - unit.saved) + unit.input_transient)
            moment = act + cache_live + extra  # before this backward's deposits change the cache
            if ios is not None:
                # Collect the deposits into the entries this chunk put, then deposit its cache reads
                # (a later deposit into a live one is added in place: no new tensor).
                alive = deposits.setdefault(mb, set())
                alive.difference_update(ios[c].cache_puts)
                alive.update(ios[c].cache_reads)
                cache_live = cache_live - cache_entries.get(mb, 0) * tensor_bytes
                cache_entries[mb] = len(alive)
                cache_live += len(alive) * tensor_bytes
                cache_peak = max(cache_peak, cache_live)
        elif c == 0:  # W of chunk 0: its whole backward (its I had no inputs to start from)
            extra = unit.transient
        if kind != "B" and kind != "I":
            moment = act + cache_live + extra
        gathered = 0
        if always:
            gathered = sum(gathered_by_chunk[k] for k in unsharded)
            resident = sum(resident_by_chunk[k] for k in unsharded if graphs.get(k)) if resident_by_chunk else 0
            moment += gathered
        act_peak = max(act_peak, act + extra + resident)
        if moment > total_peak:
            total_peak, peak_action, gathered_at_peak = moment, f"{kind}{c}.{mb}", gathered
        if kind == "F" and ios is not None:
            cache_live -= len(ios[c].frees) * tensor_bytes
        elif kind == "B":
            act -= unit.saved
        elif kind == "I" and c != 0:  # the graph dies with I; what W needs stays in the store
            act += unit.stored - unit.saved
        elif kind == "W":
            act -= unit.saved if c == 0 else unit.stored
        if always:
            # A microbatch's graph of c ends with B, or with W (the store I leaves); I ends none.
            if kind == "B" or kind == "W":
                graphs[c] -= 1
            if kind == "F":
                unsharded.discard(c)
        elif resident_by_chunk is not None and last_backward.get(c) == position:
            resident -= resident_by_chunk[c]
    return act_peak, cache_peak, total_peak, peak_action, gathered_at_peak


@dataclass(frozen=True, kw_only=True)
class MemorySetup:
    """What a memory prediction needs besides the model: the run's parallel layout and policies."""

    schedule: str
    n_stages: int
    n_virtual: int = 1
    n_microbatches: int
    tokens: int
    dtype: str = "bf16"
    cache: bool = True
    data_parallel: int = 1
    dp_shard: str = "replicate"
    activation_checkpoint: str = "none"
    layer_counts: tuple[int, ...] | None = None
    attention_kernel: str = "flash"
    reshard_after_forward: str = "never"  # fsdp: train's --fsdp-reshard-after-forward
    tensor_parallel: int = 1  # T, docs/spec.md section 10 (derived)
    sequence_parallel: bool | None = None  # None: on when T > 1
    launcher: str = "inprocess"  # train's --launcher: local and ray map shared-memory receive slots

    @property
    def sp(self) -> bool:
        return self.tensor_parallel > 1 and self.sequence_parallel is not False

    def __post_init__(self) -> None:
        for name in ("n_stages", "n_virtual", "n_microbatches", "tokens", "data_parallel", "tensor_parallel"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MemorySetup.{name}={value!r} is invalid: must be an integer >= 1")
        for name, allowed in (("dtype", tuple(DTYPE_BYTES)), ("dp_shard", DP_SHARDS),
                              ("activation_checkpoint", AC_POLICIES), ("attention_kernel", ATTENTION_KERNELS),
                              ("reshard_after_forward", RESHARD_AFTER_FORWARD), ("launcher", LAUNCHERS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"MemorySetup.{name}={getattr(self, name)!r} is invalid: choose one of "
                                 f"{', '.join(allowed)}")
        if self.reshard_after_forward != "never" and self.dp_shard != "fsdp":
            raise ValueError(f"--fsdp-reshard-after-forward {self.reshard_after_forward} needs --dp-shard fsdp "
                             f"(it is FSDP2's; --dp-shard is {self.dp_shard})")


def dominant_term(terms: dict[str, int]) -> str:
    """The largest of the terms, by its short name (params, grads, optimizer, activations, cache)."""
    names = {"param_bytes": "params", "grad_bytes": "grads", "optimizer_bytes": "optimizer",
             "activation_peak_bytes": "activations", "cache_peak_bytes": "cache"}
    return names[max(MEMORY_KEYS, key=lambda key: terms[key])]


def predict_ranks(cfg: ModelConfig, setup: MemorySetup, schedule, partition: Partition,
                  plan: PayloadPlan | None, *, dp_ranks: range | None = None) -> list[RankMemory]:
    """One RankMemory per global rank (dp_rank * P + pp_rank) for a built schedule and plan; only
    the replicas `dp_ranks` if given (replica 0 holds the most: FSDP2's first shards are full)."""
    from attnres_pp.comm.plan import shard_tokens

    copies = not (setup.dp_shard == "fsdp" and setup.data_parallel > 1)
    t = setup.tensor_parallel
    saved = [activation_bytes(cfg, partition, c, tokens=setup.tokens, dtype=setup.dtype,
                              activation_checkpoint=setup.activation_checkpoint, weight_copies=copies,
                              attention_kernel=setup.attention_kernel, tensor_parallel=t,
                              sequence_parallel=setup.sp)
             for c in range(partition.n_chunks)]
    uses_cache = plan is not None and plan.mode == "cached"
    # A cache entry or deposit is the rank's sequence shard under SP (docs/spec.md section 10).
    tensor_bytes = shard_tokens(setup.tokens, t, setup.sp) * cfg.source_width * DTYPE_BYTES[setup.dtype]
    if uses_cache and setup.activation_checkpoint != "none":
        saved = [replace(unit, saved=max(0, unit.saved - shared_cache_bytes(
            cfg, partition, plan, c, schedule, tensor_bytes=tensor_bytes))) for c, unit in enumerate(saved)]
    fsdp = setup.dp_shard == "fsdp" and setup.data_parallel > 1
    resident = [gathered_parameter_bytes(cfg, partition, c, data_parallel=setup.data_parallel, dtype=setup.dtype,
                                         tensor_parallel=t)
                for c in range(partition.n_chunks)] if fsdp else None
    always = fsdp and setup.reshard_after_forward == "always"
    gathered = [chunk_gathered_bytes(cfg, partition, c, dtype=setup.dtype, tensor_parallel=t)
                for c in range(partition.n_chunks)] if always else None
    # The slots' shapes are the hops' (the whole microbatch: the shared-memory transport is not
    # modelled under tensor parallelism, whose ranks keep their sequence shard).
    slots = [transport_slot_bytes(schedule, plan, pp_rank, tokens=setup.tokens, cfg=cfg, dtype=setup.dtype)
             if setup.launcher in SLOT_LAUNCHERS and setup.n_stages > 1 and plan is not None else 0
             for pp_rank in range(setup.n_stages)]
    walks = [walk_rank_gathered(schedule.rank_actions[pp_rank], saved_by_chunk=saved,
                                plan=plan if uses_cache else None, tensor_bytes=tensor_bytes,
                                resident_by_chunk=resident, gathered_by_chunk=gathered)
             for pp_rank in range(setup.n_stages)]
    ranks = []
    for dp_rank in dp_ranks if dp_ranks is not None else range(setup.data_parallel):
        for pp_rank, (act_peak, cache_peak, peak, action, gathered_at_peak) in enumerate(walks):
            shapes = rank_parameter_shapes(cfg, partition, pp_rank, t)
            terms = state_bytes(shapes, data_parallel=setup.data_parallel, dp_shard=setup.dp_shard, dp_rank=dp_rank,
                                whole=tied_parameter_shapes(cfg))
            terms.update(activation_peak_bytes=act_peak, cache_peak_bytes=cache_peak,
                         transport_buffer_bytes=slots[pp_rank])
            fixed = terms["param_bytes"] + terms["grad_bytes"] + terms["optimizer_bytes"] + slots[pp_rank]
            if fsdp and not always:
                # FSDP2 without resharding after forward (the pipeline default) keeps every parameter
                # all-gathered in the compute dtype through the step: part of the peak, not of
                # param_bytes (the activation term counts the saved ones while graphs hold them).
                gathered_at_peak = sum(math.prod(s) for s in shapes) * DTYPE_BYTES[setup.dtype]
                fixed += gathered_at_peak
            # Resharding always: the walk's peak holds the chunks unsharded at its moment (gathered_at_peak).
            ranks.append(RankMemory(terms=terms, peak_bytes=fixed + peak, peak_action=action,
                                    dominant=dominant_term(terms), gathered_bytes=gathered_at_peak))
    return ranks


def predict_memory(cfg: ModelConfig, setup: MemorySetup) -> list[RankMemory]:
    """Build the schedule, partition and payload plan `setup` names and predict every rank."""
    from attnres_pp.comm.partition import make_partition
    from attnres_pp.comm.plan import plan_for_model
    from attnres_pp.schedule.schedules import build_schedule, schedule_placement

    schedule = build_schedule(setup.schedule, setup.n_stages, setup.n_virtual, setup.n_microbatches)
    partition = make_partition(cfg.n_layers, setup.n_stages, setup.n_virtual, setup.layer_counts,
                               placement=schedule_placement(setup.schedule))
    plan = plan_for_model(cfg, partition, setup.cache)
    return predict_ranks(cfg, setup, schedule, partition, plan)
