"""Parameter shapes per rank and chunk, and the bytes they cost (docs/spec.md section 8): the fp32
parameters, gradients and AdamW moments of a rank (`state_bytes`; FSDP2's padded dim-0 shards over D
replicas, MSAR's stream convolutions whole on every rank), and the compute-dtype copies FSDP2
all-gathers (`gathered_parameter_bytes`, `chunk_gathered_bytes`). On one of T tensor-parallel ranks
the split matrices are its local shards (docs/spec.md section 10)."""

from __future__ import annotations

import math

from attnres_pp.comm.partition import Partition
from attnres_pp.model.config import ModelConfig
from attnres_pp.simulator.layer_recipe import (
    embedding_shapes,
    head_shapes,
    layer_parameter_shapes,
    routed_expert_shapes,
)
from attnres_pp.simulator.memory_setup import DTYPE_BYTES


def _read_shapes(cfg: ModelConfig) -> list[tuple[int, ...]]:
    """The parameters of one reading site (model.depth.DepthRead): its query (MSAR: per stream, and the
    gate's weight, scale and bias), and with `key_norm_gain` the key gain, shaped as the query."""
    if cfg.residual == "standard":
        return []
    if cfg.residual == "msar":
        m, d = cfg.n_streams, cfg.d_model
        return [(m, d), (m * d, m), (), (m,)] + [(m, d)] * cfg.key_norm_gain
    return [(cfg.query_dim,)] * (1 + cfg.key_norm_gain)


def chunk_layer_shapes(cfg: ModelConfig, partition: Partition, chunk_index: int, read: list[tuple[int, ...]],
                       tensor_parallel: int = 1, expert_parallel: int = 1) -> list[tuple[int, ...]]:
    """The parameters of chunk `chunk_index`'s transformer layers, layer by layer (an MoE layer's
    experts are `layer_recipe.moe_parameter_shapes`, E / EP routed ones)."""
    if not cfg.moe:  # every layer alike
        return layer_parameter_shapes(cfg, read, tensor_parallel) * partition.layers_per_chunk[chunk_index]
    return [shape for layer in partition.layer_range(chunk_index)
            for shape in layer_parameter_shapes(cfg, read, tensor_parallel, layer, expert_parallel)]


def rank_moe_shapes(cfg: ModelConfig, partition: Partition, pp_rank: int,
                    expert_parallel: int = 1) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """(routed, frozen) shapes among rank `pp_rank`'s parameters: the routed experts' (E / EP per MoE
    layer, replicated over the D / EP replicas that hold the same experts) and the aux-free selection
    biases (no gradient, no AdamW state)."""
    if not cfg.moe:
        return [], []
    layers = sum(1 for c in partition.chunks_of(pp_rank) for layer in partition.layer_range(c)
                 if cfg.is_moe_layer(layer))
    return routed_expert_shapes(cfg, expert_parallel) * layers, [(cfg.moe_experts,)] * layers


def rank_parameter_shapes(cfg: ModelConfig, partition: Partition, pp_rank: int,
                          tensor_parallel: int = 1, expert_parallel: int = 1) -> list[tuple[int, ...]]:
    """Shapes of every parameter rank `pp_rank` holds (`pipeline.chunk.rank_parameters`), in the
    modules' order (`simulator.layer_recipe`); on one of `tensor_parallel` tp ranks (docs/spec.md
    section 10) the local shards of the split matrices (q, k, v, SwiGLU's gate and the MLP's up
    projection column-parallel, dim 0 / T; the attention output and the MLP's down projection
    row-parallel, dim 1 / T) and every other parameter whole (replicated over tp: norms, QK-norm's
    gains, depth-attention parameters, embedding, positions, key projection, head). Under tied
    embeddings the LM head is the embedding's matrix, held once where one rank holds both, and a copy
    on the last rank where the first holds the embedding (`comm.partition.tied_copy_ranks`). An MoE
    layer holds E / EP of its routed experts (docs/spec.md section 12)."""
    shapes: list[tuple[int, ...]] = []
    chunks = partition.chunks_of(pp_rank)
    if 0 in chunks:
        shapes += embedding_shapes(cfg)
    for c in chunks:
        shapes += chunk_layer_shapes(cfg, partition, c, _read_shapes(cfg), tensor_parallel, expert_parallel)
    if partition.n_chunks - 1 in chunks:
        shapes += head_shapes(cfg, _read_shapes(cfg), holds_embedding=0 in chunks)
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
                whole: list[tuple[int, ...]] = (), routed: list[tuple[int, ...]] = (),
                frozen: list[tuple[int, ...]] = (), expert_parallel: int = 1) -> dict[str, int]:
    """param/grad/optimizer bytes of one rank (fp32 throughout; optimizer: AdamW's two moments).
    `whole`: parameters among `shapes` that stay unsharded under FSDP2 (`tied_parameter_shapes`);
    `routed`: routed experts' (`rank_moe_shapes`): FSDP2 shards them over dp as the others without
    expert parallelism, and under EP > 1 over the D / EP replicas that hold the same experts ("edp",
    `train.fsdp`; this replica's index among them is dp_rank // EP; whole at D = EP); `frozen`:
    parameters without gradient or AdamW state (the aux-free selection bias), which FSDP2 leaves whole.

    Under FSDP2 a parameter's shard storage and the reduce-scattered gradient buffer are padded to
    ceil(dim0 / D) rows on every replica, while AdamW's moments are made like the unpadded local
    shard (`zeros_like`), so replica `dp_rank`'s optimizer state can be smaller than its parameters."""
    kept_whole, by_edp = [*whole, *frozen], list(routed) if expert_parallel > 1 else []
    sharded = list(shapes)
    for shape in kept_whole + by_edp:
        sharded.remove(shape)
    held = sum(math.prod(s) for s in kept_whole)
    edp, edp_rank = data_parallel // expert_parallel, dp_rank // expert_parallel
    numel = (sum(shard_numel(s, data_parallel, dp_shard) for s in sharded) + held
             + sum(shard_numel(s, edp, dp_shard) for s in by_edp))
    local = (sum(local_numel(s, data_parallel, dp_shard, dp_rank) for s in sharded) + held
             + sum(local_numel(s, edp, dp_shard, edp_rank) for s in by_edp))
    # The frozen ones hold parameters but no gradient and no moments.
    no_grad = no_moments = sum(math.prod(s) for s in frozen)
    return {"param_bytes": 4 * numel, "grad_bytes": 4 * (numel - no_grad), "optimizer_bytes": 8 * (local - no_moments)}


def rank_state_bytes(cfg: ModelConfig, partition: Partition, pp_rank: int, *, data_parallel: int, dp_shard: str,
                     dp_rank: int = 0, tensor_parallel: int = 1, expert_parallel: int = 1) -> dict[str, int]:
    """`state_bytes` of rank (dp_rank, pp_rank): its parameters, MSAR's whole convolutions, the routed
    experts over D / EP and the selection biases without gradient or moments."""
    routed, frozen = rank_moe_shapes(cfg, partition, pp_rank, expert_parallel)
    return state_bytes(rank_parameter_shapes(cfg, partition, pp_rank, tensor_parallel, expert_parallel),
                       data_parallel=data_parallel, dp_shard=dp_shard, dp_rank=dp_rank,
                       whole=tied_parameter_shapes(cfg), routed=routed, frozen=frozen,
                       expert_parallel=expert_parallel)



def saved_parameter_shapes(cfg: ModelConfig, partition: Partition, chunk_index: int,
                           tensor_parallel: int = 1, expert_parallel: int = 1) -> list[tuple[int, ...]]:
    """Shapes of chunk `chunk_index`'s parameters that its autograd nodes save (a matrix product's
    weight, a norm's gain, MSAR's gate weights): all but the embedding tables (a lookup saves the
    indices), the AttnRes / LR-AttnRes pseudo-queries (their reads save the stacked queries, a copy)
    and MSAR's gate scalars; MSAR's per-stream queries, a few d-vectors, are counted. With
    `key_norm_gain` the scoring query's product (query x gain, `model.depth.DepthRead`) saves both."""
    d, t = cfg.d_model, tensor_parallel
    read = [(cfg.n_streams, d), (cfg.n_streams * d, cfg.n_streams)] if cfg.residual == "msar" else []
    if cfg.key_norm_gain and cfg.uses_depth_attention:
        read += [(cfg.n_streams, d)] if cfg.residual == "msar" else [(cfg.query_dim,)] * 2
    shapes = chunk_layer_shapes(cfg, partition, chunk_index, read, t, expert_parallel)
    if chunk_index == 0 and cfg.projected_key_rank:
        shapes.append((cfg.projected_key_rank, d))
    if chunk_index == partition.n_chunks - 1:  # the LM head's product saves its matrix, tied or not
        shapes += [*read, (d,), (cfg.vocab_size, d)]
    return shapes


def gathered_numel(shape: tuple[int, ...], group: int) -> int:
    """Elements of FSDP2's all-gather buffer for one parameter sharded over `group` ranks: `group`
    padded dim-0 shards (ceil(dim0 / group) x group rows), what the unsharded parameter is a view of."""
    return shard_numel(shape, group, "fsdp") * group


def _gathered_sizes(cfg: ModelConfig, shapes: list[tuple[int, ...]], moe_layers: int, *, data_parallel: int,
                    expert_parallel: int) -> int:
    """Elements FSDP2 all-gathers for `shapes` (a chunk's, with `moe_layers` MoE layers among them):
    every parameter over the D replicas but those `train.fsdp` leaves out of its units (0-dim
    scalars, the selection bias [E]) and the routed experts under EP > 1, whose slices are units over
    "edp" (D / EP holders: padded over D / EP) or, at D = EP, whole on their one holder (the
    parameter's own storage: not gathered)."""
    shapes = [s for s in shapes if s]
    routed = routed_expert_shapes(cfg, expert_parallel) * moe_layers if expert_parallel > 1 else []
    for shape in [(cfg.moe_experts,)] * moe_layers + routed:
        shapes.remove(shape)
    edp = data_parallel // expert_parallel
    by_edp = sum(gathered_numel(s, edp) for s in routed) if edp > 1 else 0
    return sum(gathered_numel(s, data_parallel) for s in shapes) + by_edp


def _moe_layers(cfg: ModelConfig, partition: Partition, chunk_index: int) -> int:
    return sum(1 for layer in partition.layer_range(chunk_index) if cfg.moe and cfg.is_moe_layer(layer))


def gathered_parameter_bytes(cfg: ModelConfig, partition: Partition, chunk_index: int, *, data_parallel: int,
                             dtype: str, tensor_parallel: int = 1, expert_parallel: int = 1) -> int:
    """Bytes of the FSDP2 all-gathered (unsharded) parameters chunk `chunk_index`'s nodes save: each
    is a view of its all-gather buffer (`gathered_numel`); the routed experts' over the D / EP
    holders of their slice, none at D = EP (the slice is the parameter itself, which the meter does
    not count; under bf16 autocast its cast is `moe_saved_bytes`'s weight copy). Held to a counted
    D = 4, EP = 2 run by tests/distributed/test_sim_moe_fsdp_gathered.py."""
    shapes = saved_parameter_shapes(cfg, partition, chunk_index, tensor_parallel, expert_parallel)
    # Among them the selection bias, which FSDP2 leaves whole (and no product saves: it only selects).
    return _gathered_sizes(cfg, shapes, _moe_layers(cfg, partition, chunk_index), data_parallel=data_parallel,
                           expert_parallel=expert_parallel) * DTYPE_BYTES[dtype]


def chunk_gathered_bytes(cfg: ModelConfig, partition: Partition, chunk_index: int, *, dtype: str,
                         tensor_parallel: int = 1, expert_parallel: int = 1, data_parallel: int = 1) -> int:
    """Bytes of chunk `chunk_index`'s parameters all-gathered in the compute dtype while its FSDP2 units
    are unsharded (`train.fsdp`: its layers, the embedding on chunk 0, the head on the last chunk;
    MSAR's tied convolutions are not units), each the padded all-gather buffer (`gathered_numel`).
    Summed over a rank's chunks it is the copy that resharding never keeps through the step
    (`predict_ranks`). FSDP2 leaves the MoE selection bias and 0-dim scalars whole, and shards the
    expert slices over edp (whole at D = EP: not gathered)."""
    shapes: list[tuple[int, ...]] = []
    if chunk_index == 0:
        shapes += embedding_shapes(cfg)
    shapes += chunk_layer_shapes(cfg, partition, chunk_index, _read_shapes(cfg), tensor_parallel, expert_parallel)
    if chunk_index == partition.n_chunks - 1:  # tied: the embedding's matrix where one rank holds both,
        # else the head's own copy (`comm.partition.tied_copy_ranks`), gathered with the head
        shapes += head_shapes(cfg, _read_shapes(cfg), holds_embedding=partition.rank_of(0) == partition.rank_of(
            chunk_index))
    return _gathered_sizes(cfg, shapes, _moe_layers(cfg, partition, chunk_index), data_parallel=data_parallel,
                           expert_parallel=expert_parallel) * DTYPE_BYTES[dtype]
