"""One training rank's part in tensor and sequence parallelism (docs/spec.md section 10): what a
`StageWorker` does differently when its chunks are shared by T ranks of a tp group.

- its chunks' layers are split over the tp mesh (`pipeline.tensor_parallel.parallelize_layers`);
- under sequence parallelism it holds tokens `[t T_seq / T, (t + 1) T_seq / T)` of every sequence:
  its microbatches are cut to that shard before the runtime sees them, so every hop, cache entry and
  deposit is the shard (`comm.plan.shard_tokens`: the simulator's rule for a hop pair's bytes), the
  embedding runs from the shard's first position and the head scores the shard's tokens;
- each rank's loss is its shard's mean, so its backward is scaled by 1 / T more (the T shares sum to
  the microbatch's mean loss) and the gradients of what every tp rank holds whole are summed over tp;
- the clipping norm counts each split matrix's shards once each and each replicated parameter once;
- checkpoints hold the fused qkv weight whole (`whole_strided`, `whole_targets`), so they load at any T.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from attnres_pp.comm.plan import shard_tokens
from attnres_pp.model.config import ModelConfig
from attnres_pp.pipeline.config import PipelineConfig
from attnres_pp.pipeline.mesh import Collectives


def is_sharded(param: nn.Parameter) -> bool:
    """A DTensor: a split weight, or a sequence-parallel norm's gain (replicated over tp)."""
    from torch.distributed.tensor import DTensor

    return isinstance(param, DTensor)


def _tp_placement(param: nn.Parameter):
    """The placement of `param` (a DTensor) over the tp mesh dimension, or None on a mesh without one
    (an FSDP2 shard over dp of a tensor every tp rank holds whole)."""
    names = param.device_mesh.mesh_dim_names or ()
    return param.placements[names.index("tp")] if "tp" in names else None


def is_split(param: nn.Parameter) -> bool:
    """A DTensor of which this rank's tp group holds parts (a split weight; under FSDP2 its mesh is
    (dp, tp)), not one every tp rank holds whole."""
    if not is_sharded(param):
        return False
    placement = _tp_placement(param)
    return placement is not None and not placement.is_replicate()


def held_over_tp(param: nn.Parameter) -> int:
    """Elements of `param` this rank holds of its stage's copy: a tensor-parallel weight's shard
    (about 1/T of a split matrix), else the whole parameter (replicated over tp; an FSDP2 shard over
    dp counts as the whole parameter its replica holds, so a (dp, tp) shard counts as its tp shard)."""
    if not is_split(param):
        return param.numel()
    if param.device_mesh.mesh_dim_names == ("tp",):
        return param.to_local().numel()
    tp_mesh, dim = param.device_mesh["tp"], _tp_placement(param).dim
    # torch.chunk's sizes: what a Shard(dim) placement gives each tp rank
    sizes = [len(piece) for piece in torch.arange(param.shape[dim]).chunk(tp_mesh.size())]
    rank = tp_mesh.get_local_rank()
    return param.numel() // param.shape[dim] * (sizes[rank] if rank < len(sizes) else 0)


class RankTensorParallel:
    """The tp side of one rank: `tp_rank` of `pipe.tensor_parallel` ranks sharing its chunks."""

    def __init__(self, cfg: ModelConfig, pipe: PipelineConfig, tp_rank: int) -> None:
        self.cfg, self.size, self.sp, self.tp_rank = cfg, pipe.tensor_parallel, pipe.sp, tp_rank
        self.seq_len = shard_tokens(cfg.seq_len, self.size, self.sp)  # tokens of each sequence this rank holds
        self.first_position = tp_rank * self.seq_len if self.sp else 0

    @property
    def active(self) -> bool:
        return self.size > 1

    def split(self, chunks: dict, stream_convs: nn.Module | None, tp_mesh) -> None:
        """Split the layers of this rank's chunks over `tp_mesh`, in place (their weights become
        DTensors: the caller rebuilds its parameter list and optimizer), and give MSAR's
        `stream_convs` their halo under SP."""
        from attnres_pp.pipeline.tensor_parallel import install_halo, parallelize_layers

        layers = [layer for chunk in chunks.values() for layer in chunk.layers.values()]
        parallelize_layers(self.cfg, layers, tp_mesh, sequence_parallel=self.sp)
        install_halo(stream_convs, tp_mesh, sequence_parallel=self.sp)
        for chunk in chunks.values():
            chunk.position_start = self.first_position

    def shard(self, microbatches: list[torch.Tensor] | None) -> list[torch.Tensor] | None:
        """This rank's tokens `[B, T_seq / T]` of each microbatch `[B, T_seq]` (all of them without SP)."""
        if microbatches is None or not self.sp:
            return microbatches
        tokens = slice(self.first_position, self.first_position + self.seq_len)
        return [mb[:, tokens].contiguous() for mb in microbatches]

    def loss_scale(self, n_microbatches: int) -> float:
        """The factor of each microbatch loss in the backward: its share of the step's mean loss."""
        return 1.0 / (n_microbatches * (self.size if self.sp else 1))

    def sum_partial_grads(self, params: list[nn.Parameter], collectives: Collectives) -> None:
        """Under SP, add the T ranks' gradients of the parameters each holds whole (each computed on
        its own tokens). The sequence-parallel norms' gains, and QK-norm's gains (applied to each
        rank's heads, with or without SP), are replicated DTensors whose gradients DTensor leaves as
        partial sums (`Partial`): they are reduced to their parameters' placement here, so that
        every later step (the dp sync, the clipping norm, AdamW) reads whole values.
        Under FSDP2 call it after the reduce-scatter (`FsdpShards.reduce`), which has reduced those
        gains itself (FSDP2 redistributes a partial gradient to its parameter's tp placement)."""
        from attnres_pp.pipeline.tensor_parallel import sum_replicated_grads

        if self.sp:
            sum_replicated_grads(params, collectives)
        for p in params:
            if p.grad is None or not is_sharded(p):
                continue
            if _tp_placement(p) is None:
                if not self.sp:  # computed on whole sequences: every tp rank's gradient is already whole
                    continue
                # FSDP2's shard over dp of a tensor every tp rank holds whole: the T ranks hold the same
                # rows of it, each with its tokens' part (summing after the reduce-scatter over dp is
                # the same sum: both are linear)
                collectives.all_reduce(p.grad.to_local(), "tp")
            elif any(pl.is_partial() for pl in p.grad.placements):
                p.grad = p.grad.redistribute(placements=p.placements)

    @property
    def tied_copies(self) -> int:
        """Ranks of a stage whose tied (MSAR convolution) gradients are the same: the T tp ranks on
        whole sequences; under SP each computed its own tokens' part (`grad_sync.sync_gradients`)."""
        return 1 if self.sp else self.size


def _strided(value) -> bool:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import _StridedShard

    return isinstance(value, DTensor) and any(isinstance(p, _StridedShard) for p in value.placements)


def whole_strided(state: dict) -> dict:
    """`state` (a checkpoint's flat state dict) with the fused qkv weights' strided tp shards, and their
    AdamW moments, made whole: DCP stores a DTensor as contiguous chunks of the global tensor, and a
    rank's q, k and v rows are three pieces, not one. Every tp rank then holds the same whole tensor,
    and DCP writes it once, as it writes the replicas' copies. A collective over tp (every tp rank
    calls it with the same keys, in order)."""
    return {key: value.full_tensor() if _strided(value) else value for key, value in state.items()}


def whole_dtensors(state: dict) -> dict:
    """`state` with every DTensor made whole: what a thread rank hands to rank 0, which writes the
    states of all the in-process ranks as one process's (a DTensor's value there would be one tp
    rank's shard). A collective over tp, as `whole_strided`."""
    from torch.distributed.tensor import DTensor

    return {key: value.full_tensor() if isinstance(value, DTensor) else value for key, value in state.items()}


def whole_targets(state: dict) -> Callable[[dict], dict]:
    """Replace, in place, each strided DTensor target of a checkpoint load by a whole tensor of its
    global shape (what `whole_strided` saved, and what a T = 1 run saves); returns the function that,
    after the load, puts each loaded whole tensor back as this rank's strided shard."""
    from torch.distributed.tensor import distribute_tensor

    layouts = {}
    for key, value in list(state.items()):
        if _strided(value):
            layouts[key] = (value.device_mesh, value.placements)
            state[key] = torch.empty(value.shape, dtype=value.dtype, device=value.to_local().device)

    def restore(loaded: dict) -> dict:
        for key, (mesh, placements) in layouts.items():
            # src_data_rank None: every tp rank read the same whole tensor and keeps its rows, no collective
            loaded[key] = distribute_tensor(loaded[key], mesh, placements, src_data_rank=None)
        return loaded

    return restore
