"""Tensor and sequence parallelism of the transformer layers (docs/spec.md section 10): each layer
split over the T ranks of a tp mesh with torch's DTensor tensor-parallel API, and what every rank
then does with the rest of the model on its sequence shard.

The plan per layer (`layer_plan`), as Megatron-LM and torchtitan split a layer:
    attn.qkv, mlp.gate_up (mlp.up)   column-parallel: each rank 1/T of the heads or of the hidden units
    attn.proj, mlp.down              row-parallel: each rank's partial output, summed over tp
    attn.q_norm, attn.k_norm         QK-norm's gains, replicated, applied to the rank's heads
    attn.norm, mlp.norm              under sequence parallelism, sequence-parallel (the rank's shard)
Without sequence parallelism a row-parallel output is all-reduced and every rank holds the whole
`[B, T_seq, d]` between layers; with it the output is reduce-scattered along the sequence and the
next column-parallel input all-gathered, so between the two rank t holds tokens
`[t T_seq / T, (t + 1) T_seq / T)` of every tensor. That is where depth attention runs: it is per
token, so it needs no communication, and the embedding and the head run on the shard too.

The fused qkv weight (`group + 2` equal row blocks of kv_heads heads: the query blocks, k, v; see
`layers.Attention`) is not split into T contiguous row blocks (rank 0 would get all the queries):
`_StridedShard(0, split_factor=group + 2)` splits each block over tp, so rank t holds the rows of
its kv heads and of the query heads that read them, and the projection's output is those blocks'
slices side by side, which `Attention.forward` views as `n_heads / T` query heads. SwiGLU's
`gate_up` is split the same way over its two blocks.

Under sequence parallelism the parameters every tp rank holds whole (embedding, positions, depth
attention's pseudo-queries and key norms, the head) get from each rank the gradient of its own
tokens only; `sum_replicated_grads` adds the T partial gradients. The sequence-parallel norms'
gains are replicated DTensors, whose gradients DTensor leaves as partial sums (`Partial`, reduced
where they are read: `full_grads`, `train.tp_rank`). MSAR's causal convolutions read the
kappa_max - 1 tokens before the shard: `SequenceHalo` brings them from the previous tp rank, and
their gradient back to it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module
from torch.distributed.tensor.placement_types import _StridedShard

from attnres_pp.model.config import ModelConfig
from attnres_pp.model.depth import StreamConvs
from attnres_pp.model.layers import TransformerLayer
from attnres_pp.model.moe import MoE
from attnres_pp.model.precision import compute_context
from attnres_pp.model.stack import forward_sublayers
from attnres_pp.model.transformer import Transformer, embed_state, lm_loss
from attnres_pp.pipeline.mesh import Collectives
from attnres_pp.pipeline.tp_bytes import count_outside_dispatch

SWIGLU_PARTS = 2  # SwiGLU's fused projection: its gate and up row blocks


class BlockwiseColwiseParallel(ColwiseParallel):
    """Column-parallel for a projection of `parts` equal row blocks (attention's fused qkv:
    n_heads / kv_heads query blocks, k and v; SwiGLU's gate and up): each rank holds its slice of
    every block (`_StridedShard` over the blocks: its heads' rows, its hidden units' rows), and its
    output is its slices side by side, `parts` blocks as the whole output has."""

    def __init__(self, parts: int, *, input_layouts=None) -> None:
        super().__init__(input_layouts=input_layouts, output_layouts=_StridedShard(-1, split_factor=parts))
        self.parts = parts

    def _partition_linear_fn(self, name, module, device_mesh):
        for param_name, param in module.named_parameters():
            placements = [_StridedShard(0, split_factor=self.parts)]
            sharded = distribute_tensor(param, device_mesh, placements, src_data_rank=self.src_data_rank)
            module.register_parameter(param_name, nn.Parameter(sharded, requires_grad=param.requires_grad))


def layer_plan(cfg: ModelConfig, sequence_parallel: bool, moe: bool = False) -> dict:
    """The `parallelize_module` plan of one `TransformerLayer` (module name -> ParallelStyle). The
    fused qkv and SwiGLU's gate_up are split block by block (`BlockwiseColwiseParallel`): since T
    divides the kv heads, rank t holds kv heads t G / T .. and the query heads that read them.
    `moe`: the layer's MLP is an MoE sublayer, which is not split: every tp rank holds it whole and
    runs it on the tokens it holds (its shard under sequence parallelism, whose gradients are then
    summed over tp as every plain parameter's are)."""
    sequence = Shard(1) if sequence_parallel else None
    column = {"input_layouts": sequence} if sequence_parallel else {}
    row = {"output_layouts": sequence} if sequence_parallel else {}
    plan = {"attn.qkv": BlockwiseColwiseParallel(cfg.qkv_parts, **column), "attn.proj": RowwiseParallel(**row)}
    if not moe:
        plan["mlp.down"] = RowwiseParallel(**row)
        if cfg.mlp == "swiglu":
            plan["mlp.gate_up"] = BlockwiseColwiseParallel(SWIGLU_PARTS, **column)
        else:
            plan["mlp.up"] = ColwiseParallel(**column)
    if cfg.qk_norm:  # per-head gains every tp rank holds whole, applied to its heads (dim 1 of [B, H, T, E]):
        # a replicated DTensor whose gradient (its heads' part) is a partial sum, reduced as the
        # sequence-parallel norms' are (`train.tp_rank.sum_partial_grads`)
        heads = SequenceParallel(sequence_dim=1, use_local_output=True)
        plan |= {"attn.q_norm": heads, "attn.k_norm": heads}
    if sequence_parallel:
        plan |= {"attn.norm": SequenceParallel()} if moe else {"attn.norm": SequenceParallel(),
                                                               "mlp.norm": SequenceParallel()}
    return plan


def parallelize_layers(cfg: ModelConfig, layers: Iterable[TransformerLayer], tp_mesh, *,
                       sequence_parallel: bool) -> None:
    """Split every layer of `layers` over the 1-D `tp_mesh` in place (its parameters become DTensors).
    Every tp rank must hold the same values first (`layers.init_weights` from the same seed)."""
    cfg.check_tensor_split(tp_mesh.size(), sequence_parallel=sequence_parallel)
    for layer in layers:
        parallelize_module(layer, tp_mesh, layer_plan(cfg, sequence_parallel, moe=isinstance(layer.mlp, MoE)))


class _HaloExchange(torch.autograd.Function):
    """Forward: every tp rank's last tokens, all-gathered; rank t keeps rank t - 1's (zeros on rank
    0). Backward: the halos' gradients, all-gathered; rank t takes rank t + 1's, the gradient of the
    tokens it lent. Two all-gathers of kappa_max - 1 tokens rather than point-to-point sends: every
    backend has them, and every tp rank calls them in the same order (they run the same schedule)."""

    @staticmethod
    def forward(ctx, tail_NBKD: torch.Tensor, group, tp_rank: int, size: int) -> torch.Tensor:
        ctx.group, ctx.tp_rank, ctx.size = group, tp_rank, size
        pieces = [torch.empty_like(tail_NBKD) for _ in range(size)]
        dist.all_gather(pieces, tail_NBKD.contiguous(), group=group)
        count_outside_dispatch((size - 1) * tail_NBKD.numel() * tail_NBKD.element_size(), c10d_op=True)
        return pieces[tp_rank - 1] if tp_rank > 0 else torch.zeros_like(tail_NBKD)

    @staticmethod
    def backward(ctx, grad_halo_NBKD: torch.Tensor):
        pieces = [torch.empty_like(grad_halo_NBKD) for _ in range(ctx.size)]
        dist.all_gather(pieces, grad_halo_NBKD.contiguous(), group=ctx.group)
        count_outside_dispatch((ctx.size - 1) * grad_halo_NBKD.numel() * grad_halo_NBKD.element_size(), c10d_op=True)
        lent = pieces[ctx.tp_rank + 1] if ctx.tp_rank + 1 < ctx.size else torch.zeros_like(grad_halo_NBKD)
        return lent, None, None, None


class SequenceHalo:
    """`StreamConvs.halo` of tp rank `tp_rank` on the 1-D `tp_mesh`: the tokens before its shard."""

    def __init__(self, tp_mesh, tp_rank: int) -> None:
        self.group, self.tp_rank, self.size = tp_mesh.get_group(), tp_rank, tp_mesh.size()

    def __call__(self, tail_NBKD: torch.Tensor) -> torch.Tensor:
        return _HaloExchange.apply(tail_NBKD, self.group, self.tp_rank, self.size)


def install_halo(stream_convs: StreamConvs | None, tp_mesh, *, sequence_parallel: bool) -> None:
    """Give MSAR's convolutions the halo of this rank's sequence shard (nothing to do otherwise)."""
    if stream_convs is not None and sequence_parallel and tp_mesh.size() > 1:
        stream_convs.halo = SequenceHalo(tp_mesh, tp_mesh.get_local_rank())


def sequence_shard(seq_len: int, tp_rank: int, tensor_parallel: int) -> slice:
    """The tokens tp rank `tp_rank` holds under sequence parallelism."""
    width = seq_len // tensor_parallel
    return slice(tp_rank * width, (tp_rank + 1) * width)


def rank_loss(model: Transformer, idx_BT: torch.Tensor, targets_BT: torch.Tensor, *, tp_rank: int,
              tensor_parallel: int, sequence_parallel: bool) -> torch.Tensor:
    """This tp rank's share of the whole model's mean loss on `idx_BT` (`[B, T_seq]`, every rank the
    same batch), its layers split by `parallelize_layers`: the T shares sum to the loss, and their
    backward passes together give every gradient of it. Under sequence parallelism the rank embeds,
    reads and scores its own tokens (its share: their mean loss / T); without it each rank computes
    the whole loss, and its share is all of it (the tp collectives make every rank's backward
    complete, so it is not divided)."""
    cfg = model.cfg
    start = 0
    if sequence_parallel and tensor_parallel > 1:
        shard = sequence_shard(idx_BT.shape[1], tp_rank, tensor_parallel)
        idx_BT, targets_BT, start = idx_BT[:, shard], targets_BT[:, shard], shard.start
    with compute_context(model.precision, idx_BT.device.type):
        state = embed_state(cfg, model.embed, idx_BT, start)
        state = forward_sublayers(cfg, dict(enumerate(model.layers)), model.stream_convs, state,
                                  range(cfg.n_sublayers), model.backend)
        loss = lm_loss(model.head(state, model.stream_convs, model.backend), targets_BT)
    if sequence_parallel and tensor_parallel > 1:
        return loss / tensor_parallel
    return loss


def sum_replicated_grads(params: Iterable[nn.Parameter], collectives: Collectives) -> None:
    """Under sequence parallelism: add the tp ranks' partial gradients of every parameter of `params`
    they hold whole (plain tensors, not DTensors), in place, so each rank holds the gradient of every
    token."""
    for param in params:
        if param.grad is not None and not isinstance(param, DTensor):
            collectives.all_reduce(param.grad, "tp")


def full_grads(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's gradient as the whole tensor (a DTensor's gathered over tp), by name."""
    out = {}
    for name, param in module.named_parameters():
        if param.grad is None:
            continue
        out[name] = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
    return out
