"""The whole model's gradient norm on a rank, for global-norm clipping: one reducer for every layout
(whole parameters, tensor-parallel shards, FSDP2 shards, tied parameters). A rank's parameters fall
in groups by which ranks hold disjoint parts of them; each group's squared local norm is summed over
those mesh axes, so every parameter is counted once:

    tied (MSAR's convolutions, equal on every rank after their sync)   ()            counted once
    whole untied parameters (the replica's P ranks hold disjoint ones)  ("pp",)
    tensor-parallel shards (T ranks hold parts, P ranks disjoint ones)  ("tp", "pp")
    FSDP2 shards over dp (the T tp ranks hold them alike)               ("dp", "pp")
    FSDP2 shards of a tp-split weight ((dp, tp) shards)                 ("world",)
    expert-parallel routed experts (EP ranks hold disjoint experts)     ("ep", "pp")
    the same, FSDP2-sharded over edp (every dp rank a disjoint part)    ("dp", "pp")

Of a tied embedding held by two pipeline ranks the first rank's copy counts: the caller leaves the
last rank's, equal after the embedding group's sum, out of `untied` (`grad_sync.TiedEmbedding.counted`).
Partial sums whose remaining axes agree are added before they are reduced, so a layout costs one
all-reduce per axis (plain: one over pp). Every rank of a run builds the same groups, empty ones
included, so every rank calls the same collectives in the same order. Sums are float64; a DTensor
counts as its local shard."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from attnres_pp.pipeline.mesh import Collectives
from attnres_pp.train.optim import local_shard, sum_of_squares


@dataclass(frozen=True)
class NormGroup:
    """Parameters whose squared gradient norms are summed over the mesh `axes`, in order."""

    params: tuple[nn.Parameter, ...]
    axes: tuple[str, ...]


def norm_groups(untied: list[nn.Parameter], tied: list[nn.Parameter], *, is_split: Callable[[nn.Parameter], bool],
                tensor_parallel: bool = False, fsdp_replicated: list[nn.Parameter] | None = None,
                experts: list[nn.Parameter] | None = None, experts_sharded: bool = False) -> list[NormGroup]:
    """The groups of a rank's parameters: `is_split` says which are tensor-parallel shards (there are
    none unless `tensor_parallel`); `fsdp_replicated` (under fsdp) the untied parameters FSDP2 leaves
    whole, the rest of `untied` being its shards; `experts` (under expert parallelism, every rank's
    list, empty where it holds none) the expert slices, apart from `untied`; `experts_sharded`: they
    are FSDP2 shards over edp, so the D replicas' shards are disjoint (EP picks the slice, edp the rows)."""
    axes = ("dp", "pp") if experts_sharded else ("ep", "pp")
    expert_group = [] if experts is None else [NormGroup(tuple(experts), axes)]
    return expert_group + _groups(untied, tied, is_split=is_split, tensor_parallel=tensor_parallel,
                                  fsdp_replicated=fsdp_replicated)


def _groups(untied: list[nn.Parameter], tied: list[nn.Parameter], *, is_split: Callable[[nn.Parameter], bool],
            tensor_parallel: bool, fsdp_replicated: list[nn.Parameter] | None) -> list[NormGroup]:
    if fsdp_replicated is not None:
        whole = {id(p) for p in fsdp_replicated}
        sharded = [p for p in untied if id(p) not in whole]
        return [NormGroup(tuple(p for p in sharded if is_split(p)), ("world",)),
                NormGroup(tuple(p for p in sharded if not is_split(p)), ("dp", "pp")),
                NormGroup(tuple(fsdp_replicated), ("pp",)), NormGroup(tuple(tied), ())]
    split = [NormGroup(tuple(p for p in untied if is_split(p)), ("tp", "pp"))] if tensor_parallel else []
    return [*split, NormGroup(tuple(p for p in untied if not is_split(p)), ("pp",)), NormGroup(tuple(tied), ())]


def _squares(params: tuple[nn.Parameter, ...], device: torch.device) -> torch.Tensor:
    grads = [local_shard(p.grad.detach()) for p in params if p.grad is not None]
    return sum_of_squares(grads).to(device)


def norm_reducer(groups: list[NormGroup], collectives: Collectives,
                 device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
    """The `reduce_sq` of `optim.clip_grad_norm_`: the whole model's squared gradient norm (the
    rank's own, which it is given, is recomputed by group). Everything stays on `device`, so the
    step's one host synchronisation is the clip's reading of the norm."""
    def reduce_sq(_local_sq: torch.Tensor | None = None) -> torch.Tensor:
        pending: dict[tuple[str, ...], torch.Tensor] = {}
        for group in groups:
            squares = _squares(group.params, device)
            pending[group.axes] = pending[group.axes] + squares if group.axes in pending else squares
        # Reduce the longest remaining axes first: partial sums meet once their remaining axes agree.
        while any(pending):
            axes = max((a for a in pending if a), key=lambda a: (len(a), a))
            total = pending.pop(axes)
            collectives.all_reduce(total, axes[0])
            rest = axes[1:]
            pending[rest] = pending[rest] + total if rest in pending else total
        return pending.get((), torch.zeros((), dtype=torch.float64, device=device))

    return reduce_sq
