"""Shape features of one chunk's activation memory (pure Python, no torch): the columns that the
units of `memory_units.json` multiply (`attnres_lab.memory_units` fits them, `simulator.memory` uses them).

- `activation_features` (FEATURES): without activation checkpointing, the chunk's forward is one
  depth-attention pass over its sublayers (one source buffer, phase-1 segments per block);
- `checkpoint_features` (CHECKPOINT_FEATURES): under `full` / `selective` checkpointing every
  transformer layer runs as its own pass (`pipeline.chunk._checkpointed_layers`), with its own
  source buffers of n_blocks + 1 rows and its own segments: `all_*` sums the layers' passes (what
  the forward keeps, what I recomputes and keeps until W), `last_*` is the chunk's last layer (the
  one a backward recomputes first, with the most sources), `out_*` what runs outside the layers
  (the embedding; the final read, norm and LM head);
- `recompute_passes`: the same columns with each layer's pass in turn as `last_*`, for the
  recomputation of an earlier layer (I's peak in a chunk of several layers, `simulator.memory`).
"""

from __future__ import annotations

import functools

from attnres_pp.comm.partition import Partition
from attnres_pp.model.config import ModelConfig, block_of, block_stop, completed_blocks, has_partial_before
from attnres_pp.simulator.layer_recipe import layer_ff, layer_matmul_elements

# The layer recipe's columns (docs/spec.md section 11), per layer: the kv heads' width; q and k as
# new tensors (rotated, or normalised by QK-norm) and, with grouped heads, the query projection's
# storage that no v view then keeps; QK-norm's own saves; rotary's cos and sin; SwiGLU's two more
# hidden-unit tensors (gate output, SiLU output) beside GELU's.
RECIPE_FEATURES = ("layer_tkv", "newqk_tqk", "newqk_grouped_td", "qkn_tqk", "qkn_th", "qkn_grouped_td", "rope_te",
                   "glu_tf")
FEATURES = ("layer_td", "layer_th", "layer_tf", "sub_tw", "sub_t", "sub_tr", "seg_ntw", "seg_nkt", "seg_ktd",
            "seg_nt", "seg_ntr", "seg_nbd", "merge_td", "merge_t", "merge_tr", "merge_bd", "head_tv", "head_td",
            "head_t", "embed_t", "embed_td", "matmul_params", "sub_1", "seg_1", "seg_kq", "sub_d",
            "buf_tw", "buf_tk", *RECIPE_FEATURES, "embed_pos")


def recipe_layer_features(cfg: ModelConfig, *, tokens: int, split: int = 1, layer: int | None = None
                          ) -> dict[str, int]:
    """The `RECIPE_FEATURES` of one transformer layer for `tokens` tokens; `split` divides what is
    per head or per hidden unit (tp without sequence parallelism). An MoE layer's MLP part is its
    shared experts (SwiGLU of width S F, `layer_recipe.layer_ff`)."""
    t, d, kv = tokens, cfg.d_model, cfg.kv_heads * cfg.head_dim
    new_qk = cfg.positions == "rope" or cfg.qk_norm
    grouped = cfg.kv_heads != cfg.n_heads  # grouped query heads are a copy (`Attention._heads`)
    return {
        "layer_tkv": t * kv // split, "newqk_tqk": new_qk * t * (d + kv) // split,
        "newqk_grouped_td": (new_qk and grouped) * t * d // split,
        "qkn_tqk": cfg.qk_norm * t * (d + kv) // split,
        "qkn_th": cfg.qk_norm * t * (cfg.n_heads + cfg.kv_heads) // split,
        "qkn_grouped_td": (cfg.qk_norm and grouped) * t * d // split,
        # cos and sin [T, E], made once per layer and pass (whole on every tp rank)
        "rope_te": (cfg.positions == "rope") * cfg.seq_len * cfg.head_dim,
        "glu_tf": (cfg.mlp == "swiglu" or layer is not None and cfg.is_moe_layer(layer)) * t * layer_ff(cfg, layer)
        // split,
    }


def _chunk_layers(cfg: ModelConfig, partition: Partition, chunk_index: int) -> list[int | None]:
    """The layers whose features differ: each of the chunk's under MoE, else one `None` standing for all."""
    return list(partition.layer_range(chunk_index)) if cfg.moe else [None]


def matmul_parameters(cfg: ModelConfig, partition: Partition, chunk_index: int, tensor_parallel: int = 1) -> int:
    """Elements of the weights a chunk multiplies with (bf16 autocast keeps a bf16 copy of each); a
    tp rank holds 1/T of each layer's split matrices and the whole (replicated) key projection and head."""
    d = cfg.d_model
    if cfg.moe:
        count = sum(layer_matmul_elements(cfg, tensor_parallel, layer) for layer in partition.layer_range(chunk_index))
    else:
        count = partition.layers_per_chunk[chunk_index] * layer_matmul_elements(cfg, tensor_parallel)
    if chunk_index == 0:
        count += cfg.projected_key_rank * d
    if chunk_index == partition.n_chunks - 1:
        count += cfg.vocab_size * d
    return count


def depth_segments(cfg: ModelConfig, partition: Partition, chunk_index: int) -> tuple[list[tuple[int, int]], int]:
    """(phase-1 segments as (sources n, queries k), merges) of a chunk, as `model.stack` runs them;
    the last chunk's final read is one more segment."""
    if not cfg.uses_depth_attention:
        return [], 0
    sublayers = partition.sublayer_range(chunk_index)
    segments, merges = _segments(cfg, sublayers)
    if chunk_index == partition.n_chunks - 1:
        segments.append((cfg.n_blocks + 1, 1))
    return segments, merges


def _segments(cfg: ModelConfig, sublayers: range) -> tuple[list[tuple[int, int]], int]:
    """Phase-1 segments (sources n, queries k) and merges of a run of sublayers: a segment ends with
    its block (`ModelConfig.block_ends`: every block_size sublayers, or where --blocks N puts them),
    and a sublayer with an open partial before it merges."""
    ends, segments, l = cfg.block_ends, [], sublayers.start
    while l < sublayers.stop:
        stop = min(sublayers.stop, block_stop(l, ends))
        segments.append((block_of(l, ends), stop - l))
        l = stop
    return segments, sum(1 for l in sublayers if has_partial_before(l, ends))


def activation_features(cfg: ModelConfig, partition: Partition, chunk_index: int, *, tokens: int,
                        n_sequences: int, dtype: str, tensor_parallel: int = 1,
                        sequence_parallel: bool = False) -> dict[str, float]:
    """The shape features of `FEATURES` of one chunk and microbatch (`tokens` = n_sequences x seq).

    On one of T tensor-parallel ranks (docs/spec.md section 10; derived, not fitted): under sequence
    parallelism every per-token feature counts the rank's tokens / T (inside a layer the heads and
    hidden units are split instead: t H / T and t f / T either way); without it only the split parts
    scale, `layer_th` and `layer_tf` by 1/T, and `layer_td` (the norms' inputs with the q, k, v) is
    kept whole, an upper bound. `matmul_params` counts 1/T of the split matrices."""
    sp = sequence_parallel and tensor_parallel > 1
    t, d, f, width = (tokens // tensor_parallel if sp else tokens), cfg.d_model, cfg.ff_dim, cfg.source_width
    split = 1 if sp else tensor_parallel
    r = cfg.key_rank if cfg.residual == "lr_attnres" else 0
    n_layers = partition.layers_per_chunk[chunk_index]
    n_sub = 2 * n_layers
    segments, n_merges = depth_segments(cfg, partition, chunk_index)
    is_first, is_last = chunk_index == 0, chunk_index == partition.n_chunks - 1
    source_rows = (cfg.n_blocks + 1) if cfg.uses_depth_attention else 0
    streams = cfg.n_streams if cfg.residual == "msar" else 1
    key_width = cfg.key_rank if cfg.residual == "lr_attnres" else d
    layers = _chunk_layers(cfg, partition, chunk_index)
    per_layer = n_layers // len(layers)  # every layer alike (None), or each its own
    recipe = [recipe_layer_features(cfg, tokens=t, split=split, layer=layer) for layer in layers]
    return {
        "layer_td": n_layers * t * d, "layer_th": n_layers * t * cfg.n_heads // split,
        "layer_tf": per_layer * sum(t * (f if layer is None else layer_ff(cfg, layer)) // split for layer in layers),
        "sub_tw": n_sub * t * width, "sub_t": n_sub * t, "sub_tr": n_sub * t * r,
        "seg_ntw": sum(n * t * width for n, _k in segments), "seg_nkt": sum(n * k * t for n, k in segments),
        "seg_ktd": sum(k * t * d for _n, k in segments), "seg_nt": sum(n * t for n, _k in segments),
        "seg_ntr": sum(n * t * r for n, _k in segments),
        "seg_nbd": sum(n * n_sequences * d for n, _k in segments),
        "merge_td": n_merges * t * d, "merge_t": n_merges * t, "merge_tr": n_merges * t * r,
        "merge_bd": n_merges * n_sequences * d,
        "head_tv": is_last * t * cfg.vocab_size, "head_td": is_last * t * d, "head_t": is_last * t,
        "embed_t": is_first * t, "embed_td": is_first * t * d,
        "matmul_params": matmul_parameters(cfg, partition, chunk_index, tensor_parallel) if dtype == "bf16" else 0,
        "sub_1": n_sub, "seg_1": len(segments),
        "seg_kq": sum(k * cfg.query_dim * cfg.n_streams for _n, k in segments), "sub_d": n_sub * d,
        # A pass's sources live in preallocated buffers of n_blocks + 1 rows (model.depth.DepthSources)
        # that phase 1 reads as views: autograd saves the whole storage, values and normalised keys.
        "buf_tw": source_rows * t * width * streams, "buf_tk": source_rows * t * key_width * streams,
        # a learned position table's lookup saves its T indices
        "embed_pos": is_first * (cfg.positions == "learned") * cfg.seq_len,
    } | {name: per_layer * sum(r[name] for r in recipe) for name in RECIPE_FEATURES}


# Per layer pass, under checkpointing; each name is used as all_<name> and last_<name>.
_PASS = ("layer_td", "layer_th", "layer_tf", "sub_tw", "sub_t", "sub_tr", "sub_1", "seg_ntw", "seg_nkt",
         "seg_ktd", "seg_ntr", "seg_nbd", "seg_kq", "merge_td", "merge_tr", "merge_bd", "buf_tw", "buf_tk",
         "matmul_params", "in_partial_tw", *RECIPE_FEATURES)
_OUTSIDE = ("out_single_tw", "out_held_blocks_tw",
            "out_head_tv", "out_head_td", "out_head_t", "out_embed_t", "out_embed_td", "out_final_ntw",
            "out_final_buf", "out_matmul_params", "out_embed_pos")
CHECKPOINT_FEATURES = tuple(f"all_{n}" for n in _PASS) + tuple(f"last_{n}" for n in _PASS) + _OUTSIDE


def _layer_pass(cfg: ModelConfig, sublayers: range, *, tokens: int, n_sequences: int, dtype: str,
                split: int = 1, tensor_parallel: int = 1) -> dict[str, float]:
    """The `_PASS` features of one transformer layer run as its own pass (sublayers 2i, 2i + 1);
    `tokens` are the rank's, `split` divides the heads' and hidden units' features (tp without SP).
    A copy: the planner asks for the same few passes tens of thousands of times."""
    return dict(_layer_pass_cached(cfg, sublayers, tokens=tokens, n_sequences=n_sequences, dtype=dtype, split=split,
                                   tensor_parallel=tensor_parallel))


@functools.lru_cache(maxsize=4096)
def _layer_pass_cached(cfg: ModelConfig, sublayers: range, *, tokens: int, n_sequences: int, dtype: str,
                       split: int, tensor_parallel: int) -> dict[str, float]:
    layer = sublayers.start // 2 if cfg.moe else None
    t, d, f, width = tokens, cfg.d_model, layer_ff(cfg, layer), cfg.source_width
    r = cfg.key_rank if cfg.residual == "lr_attnres" else 0
    n_sub = len(sublayers)
    segments, merges = _segments(cfg, sublayers) if cfg.uses_depth_attention else ([], 0)
    rows = (cfg.n_blocks + 1) if cfg.uses_depth_attention else 0
    streams = cfg.n_streams if cfg.residual == "msar" else 1
    key_width = cfg.key_rank if cfg.residual == "lr_attnres" else d
    return {
        "layer_td": t * d, "layer_th": t * cfg.n_heads // split, "layer_tf": t * f // split,
        "sub_tw": n_sub * t * width, "sub_t": n_sub * t, "sub_tr": n_sub * t * r, "sub_1": n_sub,
        "seg_ntw": sum(n * t * width for n, _k in segments), "seg_nkt": sum(n * k * t for n, k in segments),
        "seg_ktd": sum(k * t * d for _n, k in segments), "seg_ntr": sum(n * t * r for n, _k in segments),
        "seg_nbd": sum(n * n_sequences * d for n, _k in segments),
        "seg_kq": sum(k * cfg.query_dim * cfg.n_streams for _n, k in segments),
        "merge_td": merges * t * d, "merge_tr": merges * t * r, "merge_bd": merges * n_sequences * d,
        "buf_tw": rows * t * width * streams, "buf_tk": rows * t * key_width * streams,
        "matmul_params": layer_matmul_elements(cfg, tensor_parallel, layer) if dtype == "bf16" else 0,
        # The pass's input partial (or residual) is saved as it is, by the norm and merge that read it.
        "in_partial_tw": t * width if cfg.residual == "standard" or has_partial_before(sublayers.start,
                                                                                       cfg.block_ends) else 0,
    } | recipe_layer_features(cfg, tokens=t, split=split, layer=layer)


def checkpoint_features(cfg: ModelConfig, partition: Partition, chunk_index: int, *, tokens: int,
                        n_sequences: int, dtype: str, tensor_parallel: int = 1,
                        sequence_parallel: bool = False) -> dict[str, float]:
    """The `CHECKPOINT_FEATURES` of one chunk and microbatch under full or selective checkpointing
    (on a tp rank as `activation_features` says)."""
    sp = sequence_parallel and tensor_parallel > 1
    t, d, width = (tokens // tensor_parallel if sp else tokens), cfg.d_model, cfg.source_width
    split = 1 if sp else tensor_parallel
    sublayers = partition.sublayer_range(chunk_index)
    passes = [_layer_pass(cfg, range(s, min(sublayers.stop, s + 2)), tokens=t, n_sequences=n_sequences, dtype=dtype,
                          split=split, tensor_parallel=tensor_parallel)
              for s in range(sublayers.start, sublayers.stop, 2)]
    features = {f"all_{n}": float(sum(p[n] for p in passes)) for n in _PASS}
    features |= {f"last_{n}": float(passes[-1][n]) for n in _PASS}
    is_first, is_last = chunk_index == 0, chunk_index == partition.n_chunks - 1
    rows = (cfg.n_blocks + 1) if cfg.uses_depth_attention else 0
    streams = cfg.n_streams if cfg.residual == "msar" else 1
    # A pass that starts with one completed source (inside block 0) normalises that source's view of
    # its own storage (more sources are stacked into a copy): the chunk keeps b_0 itself, once.
    single = cfg.uses_depth_attention and cfg.residual != "msar" and sublayers.start < cfg.block_ends[0]
    last_start = sublayers.start + 2 * ((len(sublayers) - 1) // 2)
    held_blocks = (1 + completed_blocks(last_start, cfg.block_ends)) if cfg.uses_depth_attention else 0
    features |= {
        "out_single_tw": single * t * width,
        # Each layer's frame holds its input blocks as they are (one storage each, shared by the
        # passes that read them): every block completed before the last pass starts, not a sum
        # over passes, so no per-pass column can stand for it once a chunk has several layers.
        "out_held_blocks_tw": held_blocks * t * width,
        "out_head_tv": is_last * t * cfg.vocab_size, "out_head_td": is_last * t * d, "out_head_t": is_last * t,
        "out_embed_t": is_first * t, "out_embed_td": is_first * t * d,
        "out_final_ntw": is_last * rows * t * width, "out_final_buf": is_last * rows * t * width * streams,
        "out_matmul_params": (is_last * cfg.vocab_size * d + is_first * cfg.projected_key_rank * d)
        if dtype == "bf16" else 0,
        "out_embed_pos": is_first * (cfg.positions == "learned") * cfg.seq_len,
    }
    return features


def recompute_passes(cfg: ModelConfig, partition: Partition, chunk_index: int, *, tokens: int, n_sequences: int,
                     dtype: str, tensor_parallel: int = 1,
                     sequence_parallel: bool = False) -> list[tuple[dict[str, float], int]]:
    """Per transformer layer j of the chunk, first to last: (the `CHECKPOINT_FEATURES` with j's pass
    as the `last_*` columns, the elements of the chunk's inputs that only the layers after j keep).

    A backward recomputes the layers last to first; the units' `transient` prices the recomputation
    of the last one above what F saved. The same form with layer j's pass in its place prices layer
    j's, less what the layers after j no longer keep by then: their frames' inputs that j does not
    read (the blocks completed inside the chunk before them, and their input partials or residuals)."""
    sp = sequence_parallel and tensor_parallel > 1
    t, width = (tokens // tensor_parallel if sp else tokens), cfg.source_width
    split = 1 if sp else tensor_parallel
    chunk = checkpoint_features(cfg, partition, chunk_index, tokens=tokens, n_sequences=n_sequences, dtype=dtype,
                                tensor_parallel=tensor_parallel, sequence_parallel=sequence_parallel)
    sublayers = partition.sublayer_range(chunk_index)
    starts = list(range(sublayers.start, sublayers.stop, 2))
    passes = [_layer_pass(cfg, range(s, min(sublayers.stop, s + 2)), tokens=t, n_sequences=n_sequences, dtype=dtype,
                          split=split, tensor_parallel=tensor_parallel) for s in starts]

    def held(start: int) -> int:  # blocks a layer starting at sublayer `start` keeps as its inputs
        return 1 + completed_blocks(start, cfg.block_ends) if cfg.uses_depth_attention else 0

    result = []
    for j, layer in enumerate(passes):
        features = chunk | {f"last_{n}": float(layer[n]) for n in _PASS}
        blocks = (held(starts[-1]) - held(starts[j])) * t * width
        result.append((features, blocks + sum(p["in_partial_tw"] for p in passes[j + 1:])))
    return result
