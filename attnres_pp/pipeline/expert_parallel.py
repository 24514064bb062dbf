"""Expert parallelism (docs/spec.md section 12): the EP ranks of one stage, taken along the
data-parallel axis (`mesh.RankCoords.ep_rank`), share each MoE sublayer's E routed experts, E / EP
each; the router, the shared experts and everything else stay replicated.

`ExpertSlice` replaces a sublayer's `model.moe.RoutedExperts` on a rank: it holds experts
`[first_expert, first_expert + E / EP)` under the same parameter names (`gate_up`, `down`, rows of
the whole model's tensors; each expert's initial value is drawn from its own stream by global index,
so the rows equal the single process's), and its forward sends each token-choice to the rank of
its expert and back:

1. the token-choices sorted by expert (a stable sort: ties keep the order of choice), so the rows
   for EP member j are one run (its experts are consecutive);
2. the counts first: an all-to-all of `[EP, E / EP]` counts, so each rank knows how many rows of
   each of its experts every member sends;
3. the rows by a differentiable all-to-all (`_AllToAll`; its backward is the reverse all-to-all),
   regrouped by local expert and computed as one grouped matmul (`RoutedExperts.compute`);
4. the outputs back by the reverse all-to-all, in the order of choice: `[N, K, W]`, as
   `RoutedExperts.forward` returns them, so the gate-weighted sum is the same for any EP.
`sent_bytes` counts the token rows (and their gradients) a slice sent to other EP ranks, forward
and backward: docs/spec.md section 12's dispatch and combine bytes, as measured; `exchange_s` the
seconds its all-to-alls took (counts and rows, forward and backward, waits included), which the
rank reports with each step (`take_exchange`).

Every rank of an EP group runs the same schedule, so the group meets in the same all-to-alls in the
same order, forward, backward (the dispatch's and combine's backward are all-to-alls too, run in I
under the split backward: they are on the input-gradient chain) and activation checkpointing's
recomputation. The gradient of an expert on its holder sums every token of its EP group; the D / EP
holders of the same experts sum theirs and divide by D (`train.grad_sync`).
"""

from __future__ import annotations

import time

import torch
from torch import nn

from attnres_pp.model.config import ModelConfig
from attnres_pp.model.moe import MoE, RoutedExperts, _compute_dtype
from attnres_pp.pipeline.mesh import Collectives

AXIS = "ep"


class _AllToAll(torch.autograd.Function):
    """`experts.collectives.all_to_all` along "ep" with autograd: the backward sends the gradients back
    the way the rows came. Both directions add the bytes they send off this rank to `experts.sent_bytes`."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, experts: ExpertSlice, send_splits: list[int],
                recv_splits: list[int]) -> torch.Tensor:
        ctx.experts, ctx.splits = experts, (send_splits, recv_splits)
        return experts.exchange(rows, send_splits, recv_splits)

    @staticmethod
    def backward(ctx, grad_rows: torch.Tensor):
        send_splits, recv_splits = ctx.splits
        return ctx.experts.exchange(grad_rows, recv_splits, send_splits), None, None, None


class ExpertSlice(RoutedExperts):
    """E / EP of a sublayer's routed experts (the slice of EP rank `ep_rank`), run on the token-choices
    of every member of the rank's EP group. `collectives` (with an "ep" axis) is set by
    `connect_experts` once the rank has joined its group."""

    def __init__(self, cfg: ModelConfig, ep_rank: int, ep_size: int) -> None:
        n_local = cfg.moe_experts // ep_size
        super().__init__(cfg, n_experts=n_local, first_expert=ep_rank * n_local)
        self.ep_size, self.ep_rank = ep_size, ep_rank
        self.collectives: Collectives | None = None
        self.sent_bytes = 0  # token rows and their gradients sent to other EP ranks (dispatch and combine)
        self.exchange_s = 0.0  # seconds in this slice's all-to-alls since the last `take_exchange`

    def exchange(self, rows: torch.Tensor, send_splits: list[int], recv_splits: list[int]) -> torch.Tensor:
        """One all-to-all of `rows` over the EP group, counted in `sent_bytes` and timed in `exchange_s`."""
        off_rank = sum(send_splits) - send_splits[self.ep_rank]
        self.sent_bytes += off_rank * rows[0].numel() * rows.element_size() if len(rows) else 0
        return self._timed_all_to_all(rows.contiguous(), send_splits, recv_splits)

    def _timed_all_to_all(self, tensor: torch.Tensor, send_splits: list[int], recv_splits: list[int]) -> torch.Tensor:
        started = time.perf_counter()
        try:
            return self.collectives.all_to_all(tensor, send_splits, recv_splits, AXIS)
        finally:
            self.exchange_s += time.perf_counter() - started

    def forward(self, x_ND: torch.Tensor, expert_NK: torch.Tensor) -> torch.Tensor:
        """`[N, K, W]`: each token's K chosen experts' outputs, in the order of choice."""
        if self.collectives is None:
            raise RuntimeError("ExpertSlice: no expert-parallel group (connect_experts was not called)")
        n_tokens, top_k = expert_NK.shape
        n_local, ep = self.gate_up.shape[0], self.ep_size
        expert_M = expert_NK.flatten()
        order_M = torch.argsort(expert_M, stable=True)  # token-choices grouped by expert, so by member
        counts_SL = torch.bincount(expert_M, minlength=n_local * ep).view(ep, n_local)
        # Row s of what arrives: member s's counts of this rank's experts.
        arrived_SL = self._timed_all_to_all(counts_SL, [1] * ep, [1] * ep)
        send_splits, recv_splits = counts_SL.sum(1).tolist(), arrived_SL.sum(1).tolist()
        x_MD = x_ND[order_M // top_k].to(_compute_dtype(self.gate_up))  # sent in the matmuls' dtype
        x_RD = _AllToAll.apply(x_MD, self, send_splits, recv_splits)
        # Rows arrive member by member, each member's sorted by local expert: group them by expert.
        local_R = torch.repeat_interleave(torch.arange(n_local, device=x_RD.device).repeat(ep),
                                          arrived_SL.flatten().to(x_RD.device))
        group_R = torch.argsort(local_R, stable=True)
        y_RW = self.compute(x_RD[group_R], arrived_SL.sum(0).tolist())
        if y_RW.grad_fn is None and x_RD.requires_grad:
            # No rows here and no graph through the experts: keep the dispatch on the backward's path,
            # so that this rank joins its reverse all-to-all as the members that sent rows do.
            y_RW = y_RW + x_RD.sum() * 0
        y_RW = y_RW[torch.argsort(group_R)]  # back in arrival order
        y_MW = _AllToAll.apply(y_RW, self, recv_splits, send_splits)
        return y_MW[torch.argsort(order_M)].view(n_tokens, top_k, -1)


def install_expert_slices(model: nn.Module, ep_rank: int, ep_size: int) -> None:
    """Replace every MoE sublayer's routed experts in `model` (still on the meta device, before its
    parameters are materialised and initialised) by EP rank `ep_rank`'s `ExpertSlice`."""
    for moe in (m for m in model.modules() if isinstance(m, MoE)):
        with torch.device("meta"):
            moe.experts = ExpertSlice(moe.cfg, ep_rank, ep_size)


def expert_slices(model: nn.Module) -> dict[str, ExpertSlice]:
    """The materialised `ExpertSlice` modules of `model` by whole-model name."""
    return {name: m for name, m in model.named_modules() if isinstance(m, ExpertSlice) and not m.gate_up.is_meta}


def take_exchange(model: nn.Module) -> tuple[float, int]:
    """(seconds, bytes sent off the rank) of `model`'s expert slices' all-to-alls since the last take;
    the seconds are zeroed for the next (`sent_bytes` keeps counting: the bytes are the difference)."""
    slices = expert_slices(model).values()
    seconds, sent = sum(s.exchange_s for s in slices), sum(s.sent_bytes for s in slices)
    for experts in slices:
        experts.exchange_s = 0.0
    before, model._exchange_bytes_taken = getattr(model, "_exchange_bytes_taken", 0), sent
    return seconds, sent - before


def connect_experts(model: nn.Module, collectives: Collectives) -> None:
    """Give every expert slice of `model` the rank's collectives (their "ep" axis is its EP group)."""
    for experts in expert_slices(model).values():
        experts.collectives = collectives


def expert_rows(model: nn.Module) -> dict[str, slice]:
    """Whole-model parameter name -> the rows of the whole tensor `[E, ...]` this rank holds, for
    every parameter of an expert slice (checkpoints save and load them whole: `train.shards`)."""
    rows = {}
    for name, experts in expert_slices(model).items():
        held = slice(experts.first_expert, experts.first_expert + experts.gate_up.shape[0])
        for param_name, _param in experts.named_parameters():
            rows[f"{name}.{param_name}"] = held
    return rows


def expert_parallel_size(model: nn.Module) -> int:
    """EP of `model`'s expert slices (1 without any)."""
    return next((m.ep_size for m in expert_slices(model).values()), 1)
