"""A rank's gradients after its backward, made into the whole run's (docs/spec.md section 6, section 1.4):

- every parameter's gradient is averaged over the rank's D data-parallel replicas, in flat buckets
  (one all-reduce per bucket of up to BUCKET_BYTES, not one per parameter);
- MSAR's tied stream convolutions, which every rank holds, are summed over the P ranks of a replica
  (each rank adds what its own reads contributed) and averaged over the D replicas: one all-reduce
  over every rank, divided by D;
- tied embeddings whose embedding and LM head sit on two pipeline ranks (`comm.partition.tied_copy_ranks`)
  have one copy of the matrix on each; once each copy is averaged over the replicas (or
  reduce-scattered by fsdp, which gives both ranks the same rows), the two are summed between the
  two ranks (the "embed" group: Megatron's embedding group), so both hold the single process's gradient;
- under expert parallelism a routed expert's gradient on its holder already sums the contributions
  of every token of its EP group (the all-to-all's backward brought them), so the D / EP ranks that
  hold the same experts sum theirs ("edp") and divide by D: the mean over the global batch;
- the clipping norm is the whole model's: each rank's squared norm of its own untied gradients is
  summed over its replica (the D replicas hold equal averaged gradients, so one replica counts
  each once), and the tied gradients, equal on every rank after their reduction, are added once;
  of a tied embedding's two copies only the first rank's counts (`grad_norm.norm_groups`).

Each replica's loss is the mean over its m microbatches, so averaging over D gives the mean over
every token of the global batch: the single process's loss and gradients.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from attnres_pp.comm.partition import Partition, tied_copy_ranks
from attnres_pp.pipeline.mesh import Collectives
from attnres_pp.train.optim import local_shard, sum_of_squares

BUCKET_BYTES = 25 * 2**20  # DDP's default bucket size

# Why not DistributedDataParallel, which buckets the same all-reduce: DDP reduces from hooks on
# AccumulateGrad inside one backward call, but a rank here runs one engine call per chunk and
# microbatch, and under the split two (I, then W, which writes linear weights' gradients into .grad
# itself, past AccumulateGrad). Measured (tests/distributed/test_grad_sync_ddp.py, two gloo ranks): under one
# fused backward DDP's ranks agree exactly; under I then W their gradients stay unaveraged (max
# difference 2.15) and DDP refuses the next forward ("Expected to have finished reduction in the
# prior iteration"), while `sync_gradients` after the same split leaves them equal.

def ensure_grads(params: list[nn.Parameter]) -> None:
    """Zero gradients where autograd left none (a tied conv whose source this rank never reads), so
    every rank's buckets have the same layout."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)


def flat_buckets(params: list[nn.Parameter], bucket_bytes: int = BUCKET_BYTES) -> list[list[nn.Parameter]]:
    """Consecutive parameters grouped into buckets of at most `bucket_bytes` (a larger parameter gets
    a bucket of its own); one dtype and device per bucket."""
    buckets: list[list[nn.Parameter]] = []
    size = 0
    for p in params:
        n_bytes = p.numel() * p.element_size()
        same_kind = buckets and (buckets[-1][0].dtype, buckets[-1][0].device) == (p.dtype, p.device)
        if not same_kind or size + n_bytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += n_bytes
    return buckets


def reduce_flat(params: list[nn.Parameter], reduce: Callable[[torch.Tensor], None], divisor: int = 1) -> None:
    """The gradients this rank holds of `params` (a tensor-parallel weight's: its shard, which its dp
    peers hold the same of) flattened into one tensor, reduced in place by `reduce`, divided by
    `divisor` and written back."""
    grads = [local_shard(p.grad) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    reduce(flat)
    if divisor != 1:
        flat.div_(divisor)
    for g, piece in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
        g.copy_(piece.view_as(g))


def _reduce_flat(params: list[nn.Parameter], collectives: Collectives, axis: str, divisor: int) -> None:
    reduce_flat(params, lambda flat: collectives.all_reduce(flat, axis), divisor)


def sync_gradients(untied: list[nn.Parameter], tied: list[nn.Parameter], collectives: Collectives,
                   data_parallel: int, bucket_bytes: int = BUCKET_BYTES, tied_copies: int = 1) -> None:
    """Average `untied` over the dp axis (in buckets); sum `tied` over each replica and average them
    over replicas (one all-reduce over every rank). Under fsdp `untied` is the parameters FSDP2
    leaves whole (`train.fsdp`); its reduce-scatter averages the shards. `tied_copies`: how many
    ranks of a stage computed the same tied gradients (T tp ranks on whole sequences, `train.tp_rank`),
    each counted once."""
    ensure_grads(untied + tied)
    if data_parallel > 1:
        for bucket in flat_buckets(untied, bucket_bytes):
            _reduce_flat(bucket, collectives, "dp", data_parallel)
    if tied:
        _reduce_flat(tied, collectives, "world", data_parallel * tied_copies)


class TiedEmbedding:
    """A rank's part in keeping a tied embedding's two copies equal (`comm.partition.tied_copy_ranks`):
    its copy is the embedding's on the first pipeline rank, the LM head's on the last; other ranks, and
    runs where one rank holds the one matrix, have none. `across_ranks`: the run has two copies (every
    rank then joins the making of the "embed" groups, `pipeline.mesh`)."""

    def __init__(self, tie_embeddings: bool, partition: Partition, pp_rank: int) -> None:
        self.ranks = tied_copy_ranks(tie_embeddings, partition)
        self.across_ranks = bool(self.ranks)
        self.pp_rank = pp_rank

    def copies(self, params: dict[str, nn.Parameter]) -> list[nn.Parameter]:
        """This rank's copy among its parameters (by whole-model name), or []."""
        if self.pp_rank not in self.ranks:
            return []
        return [params[n] for n in ("embed.tok.weight", "head.lm_head.weight") if n in params]

    def counted(self, params: dict[str, nn.Parameter], untied: list[nn.Parameter]) -> list[nn.Parameter]:
        """`untied` without the copy the clipping norm leaves to the first rank (the last rank's, equal
        to it after `sync`): the matrix counts once."""
        if not self.ranks or self.pp_rank != self.ranks[1]:
            return untied
        skip = {id(p) for p in self.copies(params)}
        return [p for p in untied if id(p) not in skip]

    def sync(self, params: dict[str, nn.Parameter], collectives: Collectives) -> None:
        """The embedding group: this rank's copy summed with the other rank's, after the dp reduction
        (fsdp's reduce-scatter gives the two ranks the same rows); both then hold the gradient of the
        one matrix, the single process's."""
        copies = self.copies(params)
        if copies:
            ensure_grads(copies)
            reduce_flat(copies, lambda flat: collectives.all_reduce(flat, "embed"))


def sync_expert_gradients(experts: list[nn.Parameter], collectives: Collectives, data_parallel: int,
                          bucket_bytes: int = BUCKET_BYTES) -> None:
    """Expert parallelism's routed experts (`pipeline.expert_parallel`): summed over the ranks that
    hold the same experts and divided by the D replicas whose tokens they computed (in buckets)."""
    ensure_grads(experts)
    for bucket in flat_buckets(experts, bucket_bytes):
        _reduce_flat(bucket, collectives, "edp", data_parallel)


def squared_norm(params: list[nn.Parameter], device: torch.device | None = None) -> torch.Tensor:
    """Sum of squared gradients as a 0-dim float64 tensor on `device` (default: the CPU), in parameter
    order (deterministic), computed the way `optim.clip_grad_norm_` computes a rank's own: one
    `_foreach_norm` per device, no host synchronisation."""
    grads = [p.grad.detach() for p in params if p.grad is not None]
    return sum_of_squares(grads).to(device or torch.device("cpu"))
