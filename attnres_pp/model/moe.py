"""The mixture-of-experts sublayer of docs/spec.md section 12: a router, routed SwiGLU experts run as
one grouped computation, shared experts, and the two ways of keeping the experts' loads balanced.

An MoE sublayer is one depth source like the MLP it replaces: it reads `h`, applies its RMSNorm
and writes one output `[B, T, d (+ r)]` (under projected low-rank keys each expert's down
projection emits the r key columns too, and the gate weights combine them with the values).

Per token the router's affinities `a = softmax(x W_r)` (or sigmoid) choose the top K of `a + bias`
(ties to the lower index: a stable sort); the chosen affinities, divided by their sum, weight the
chosen experts' outputs, summed in the order of choice (so the sum does not depend on where the
experts ran: expert parallelism, `pipeline.expert_parallel`, replaces `RoutedExperts` and gives the
same result). The bias only selects; `update_expert_bias` moves it after each optimiser step
(aux-free balancing). Under aux-loss balancing `coef E sum_e f_e P_e` enters the backward through
`_AttachAux`, scaled as the loss is (`aux_scale`, set by the engine).
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
import torch.nn.functional as F
from torch import nn

from attnres_pp.model.config import ModelConfig
from attnres_pp.model.depth import DepthRead
from attnres_pp.model.norm import RMSNorm

# Set while activation checkpointing recomputes a layer: the recomputation must not count the
# experts' loads or the aux loss a second time (`pipeline.activation_checkpoint`).
_RECOMPUTING = contextvars.ContextVar("moe_recomputing", default=False)


@contextlib.contextmanager
def recomputing():
    token = _RECOMPUTING.set(True)
    try:
        yield
    finally:
        _RECOMPUTING.reset(token)


def _grouped_mm_fits(x_MK: torch.Tensor, w_EKN: torch.Tensor) -> bool:
    """Whether torch's grouped matmul takes these operands: fp32 on the CPU or bf16 (CUDA: Hopper
    and later), rows 16-byte aligned."""
    if not hasattr(torch, "_grouped_mm") or x_MK.dtype != w_EKN.dtype:
        return False
    if x_MK.device.type == "cuda":
        if x_MK.dtype != torch.bfloat16 or torch.cuda.get_device_capability(x_MK.device)[0] < 9:
            return False
    elif x_MK.dtype not in (torch.float32, torch.bfloat16):
        return False
    per_row = 16 // x_MK.element_size()
    return x_MK.shape[-1] % per_row == 0 and w_EKN.shape[-1] % per_row == 0


def grouped_matmul(x_MK: torch.Tensor, w_ENK: torch.Tensor, counts_E: list[int]) -> torch.Tensor:
    """`[M, N]`: rows of `x_MK` grouped by expert (counts_E[e] consecutive rows for expert e) times
    their expert's `w_ENK[e]` transposed (weights stored out-by-in, as nn.Linear's). One grouped
    matmul where torch has one for the operands; else one matmul per expert (float64, odd widths),
    the slow twin it is tested against."""
    w_EKN = w_ENK.transpose(1, 2)
    if _grouped_mm_fits(x_MK, w_EKN):
        offsets_E = torch.tensor(counts_E, device=x_MK.device).cumsum(0).to(torch.int32)
        return _DenseGrad.apply(torch._grouped_mm(x_MK, w_EKN, offs=offsets_E))
    return grouped_matmul_loop(x_MK, w_ENK, counts_E)


class _DenseGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient: the grouped matmul's backward refuses
    an expanded one (zero strides, as `y.sum().backward()` gives), torch 2.13 on the CPU."""

    @staticmethod
    def forward(ctx, y: torch.Tensor) -> torch.Tensor:
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor) -> torch.Tensor:
        return grad_y.contiguous()


def grouped_matmul_loop(x_MK: torch.Tensor, w_ENK: torch.Tensor, counts_E: list[int]) -> torch.Tensor:
    """`grouped_matmul` by one matmul per expert that has rows."""
    parts = [x_Mk @ w_ENK[e].t() for e, x_Mk in enumerate(x_MK.split(counts_E)) if counts_E[e]]
    return torch.cat(parts) if parts else x_MK.new_zeros(0, w_ENK.shape[1])


def _compute_dtype(weight: torch.Tensor) -> torch.dtype:
    """The matmul dtype: autocast's where it is on (bf16 training keeps fp32 master weights)."""
    device_type = weight.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return weight.dtype


class RoutedExperts(nn.Module):
    """E SwiGLU experts as two stacked weights: `gate_up` `[E, 2 F, d]` (rows [gate | up] of each)
    and `down` `[E, d + r, F]`. `first_expert`: the global index of expert 0 here (0 unless expert
    parallelism holds a slice)."""

    def __init__(self, cfg: ModelConfig, n_experts: int | None = None, first_expert: int = 0) -> None:
        super().__init__()
        n_experts = cfg.moe_experts if n_experts is None else n_experts
        self.first_expert = first_expert
        self.gate_up = nn.Parameter(torch.empty(n_experts, 2 * cfg.expert_dim, cfg.d_model))
        self.down = nn.Parameter(torch.empty(n_experts, cfg.source_width, cfg.expert_dim))

    def compute(self, x_MD: torch.Tensor, counts_E: list[int]) -> torch.Tensor:
        """`[M, W]`: the experts on rows grouped by expert (counts_E as `grouped_matmul`)."""
        dtype = _compute_dtype(self.gate_up)
        gate_MF, up_MF = grouped_matmul(x_MD.to(dtype), self.gate_up.to(dtype), counts_E).chunk(2, dim=-1)
        return grouped_matmul(F.silu(gate_MF) * up_MF, self.down.to(dtype), counts_E)

    def forward(self, x_ND: torch.Tensor, expert_NK: torch.Tensor) -> torch.Tensor:
        """`[N, K, W]`: each token's K chosen experts' outputs, in the order of choice."""
        n_tokens, top_k = expert_NK.shape
        expert_M = expert_NK.flatten()
        order_M = torch.argsort(expert_M, stable=True)  # token-choices grouped by expert
        counts_E = torch.bincount(expert_M, minlength=self.gate_up.shape[0]).tolist()
        y_MW = self.compute(x_ND[order_M // top_k], counts_E)
        return y_MW[torch.argsort(order_M)].view(n_tokens, top_k, -1)


class SharedExperts(nn.Module):
    """S shared SwiGLU experts of width F as one of width S F: the sum of their outputs is one down
    projection of their concatenated hidden units. `gate_up` rows are [gate (S F) | up (S F)]."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        width = cfg.moe_shared_experts * cfg.expert_dim
        self.gate_up = nn.Linear(cfg.d_model, 2 * width, bias=False)
        self.down = nn.Linear(width, cfg.source_width, bias=False)

    def forward(self, x_ND: torch.Tensor) -> torch.Tensor:
        gate_NF, up_NF = self.gate_up(x_ND).chunk(2, dim=-1)
        return self.down(F.silu(gate_NF) * up_NF)


class _AttachAux(torch.autograd.Function):
    """`out` unchanged; the backward also gives the aux loss the gradient `scale` (its factor in the
    step's objective), so the aux loss trains the router wherever in the pipeline its layer runs."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.aux_meta = (aux.shape, aux.dtype, aux.device)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        shape, dtype, device = ctx.aux_meta
        return grad_out, torch.full(shape, ctx.scale, dtype=dtype, device=device), None


def route(cfg: ModelConfig, x_ND: torch.Tensor, router_ED: torch.Tensor, bias_E: torch.Tensor
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Affinities `[N, E]` (at least fp32), the chosen experts `[N, K]` (top K of affinity + bias,
    ties to the lower index) and their gate weights `[N, K]` (chosen affinities over their sum)."""
    math_dtype = torch.promote_types(x_ND.dtype, torch.float32)
    with torch.autocast(x_ND.device.type, enabled=False):
        logits_NE = F.linear(x_ND.to(math_dtype), router_ED.to(math_dtype))
    affinity_NE = logits_NE.softmax(-1) if cfg.moe_router == "softmax" else logits_NE.sigmoid()
    with torch.no_grad():
        score_NE = affinity_NE + bias_E.to(math_dtype)
        expert_NK = torch.sort(score_NE, dim=-1, descending=True, stable=True).indices[:, :cfg.moe_top_k]
    chosen_NK = affinity_NE.gather(1, expert_NK)
    return affinity_NE, expert_NK, chosen_NK / chosen_NK.sum(-1, keepdim=True)


def aux_loss(cfg: ModelConfig, affinity_NE: torch.Tensor, expert_NK: torch.Tensor) -> torch.Tensor:
    """`coef E sum_e f_e P_e`: f_e the share of the token-choices that went to e, P_e e's mean affinity."""
    choices_E = torch.bincount(expert_NK.flatten(), minlength=cfg.moe_experts).to(affinity_NE.dtype)
    share_E = choices_E / expert_NK.numel()
    return cfg.moe_aux_loss_coef * cfg.moe_experts * (share_E * affinity_NE.mean(0)).sum()


def seq_aux_loss(cfg: ModelConfig, affinity_NE: torch.Tensor, expert_NK: torch.Tensor, batch: int) -> torch.Tensor:
    """`coef E mean_b sum_e f_be P_be` over the `batch` sequences of the N = batch T tokens (DeepSeek-V3's
    sequence-wise balance loss): f_be the share of sequence b's token-choices that went to e, P_be the
    mean over b's tokens of e's affinity divided by the token's affinities' sum."""
    n_experts = cfg.moe_experts
    affinity_BTE = affinity_NE.view(batch, -1, n_experts)
    normalised_BE = (affinity_BTE / affinity_BTE.sum(-1, keepdim=True)).mean(1)
    expert_BM = expert_NK.reshape(batch, -1)
    choices_BE = torch.zeros(batch, n_experts, dtype=affinity_NE.dtype, device=affinity_NE.device)
    choices_BE.scatter_add_(1, expert_BM, torch.ones_like(expert_BM, dtype=affinity_NE.dtype))
    share_BE = choices_BE / expert_BM.shape[1]
    return cfg.moe_seq_aux_coef * n_experts * (share_BE * normalised_BE).sum(-1).mean()


def balance_loss(cfg: ModelConfig, affinity_NE: torch.Tensor, expert_NK: torch.Tensor, batch: int
                 ) -> torch.Tensor | None:
    """The sublayer's differentiable balance losses: the aux loss under aux-loss balancing plus the
    sequence-wise one where its coefficient is > 0; None where neither is on."""
    losses = []
    if cfg.moe_balance == "aux_loss":
        losses.append(aux_loss(cfg, affinity_NE, expert_NK))
    if cfg.moe_seq_aux_coef > 0:
        losses.append(seq_aux_loss(cfg, affinity_NE, expert_NK, batch))
    return sum(losses[1:], losses[0]) if losses else None


class MoE(nn.Module):
    """An MoE sublayer: d -> d (+ r), in place of a layer's MLP (docs/spec.md section 12).

    `expert_bias` is a parameter without gradient so that checkpoints carry it; `load_E` counts the
    token-choices of each expert since the engine last took them (training forwards only: not
    evaluation under no_grad, not a checkpointed layer's recomputation);
    `aux_scale` is the aux loss's factor in the backward (the loss's: 1 / microbatches)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.router = nn.Linear(cfg.d_model, cfg.moe_experts, bias=False)
        self.expert_bias = nn.Parameter(torch.zeros(cfg.moe_experts), requires_grad=False)
        self.experts = RoutedExperts(cfg)
        self.shared = SharedExperts(cfg) if cfg.moe_shared_experts else None
        self.read = DepthRead(cfg)
        self.aux_scale = 1.0
        self.register_buffer("load_E", torch.zeros(cfg.moe_experts, dtype=torch.float64), persistent=False)
        self.aux_sum = 0.0  # aux losses of the forwards since the engine last took them
        self.aux_count = 0

    def forward(self, h_BTD: torch.Tensor) -> torch.Tensor:
        x_BTD = self.norm(h_BTD)
        x_ND = x_BTD.reshape(-1, x_BTD.shape[-1])
        affinity_NE, expert_NK, gate_NK = route(self.cfg, x_ND, self.router.weight, self.expert_bias)
        y_NKW = self.experts(x_ND, expert_NK)
        out_NW = (gate_NK.unsqueeze(-1).to(y_NKW.dtype) * y_NKW).sum(1)
        if self.shared is not None:
            out_NW = self.shared(x_ND).to(out_NW.dtype) + out_NW
        counted = self.training and torch.is_grad_enabled() and not _RECOMPUTING.get()
        if counted:
            with torch.no_grad():
                self.load_E += torch.bincount(expert_NK.flatten(), minlength=self.cfg.moe_experts).to(self.load_E)
        aux = balance_loss(self.cfg, affinity_NE, expert_NK, h_BTD.shape[0]) if torch.is_grad_enabled() else None
        if aux is not None:
            if counted:
                self.aux_sum += float(aux.detach())
                self.aux_count += 1
            out_NW = _AttachAux.apply(out_NW, aux, self.aux_scale)
        return out_NW.view(*h_BTD.shape[:-1], -1)


def moe_sublayers(model: nn.Module) -> dict[str, MoE]:
    """The MoE sublayers of `model` (or of a chunk) whose parameters are materialised, by name."""
    return {name: m for name, m in model.named_modules() if isinstance(m, MoE) and not m.router.weight.is_meta}


def set_aux_scale(model: nn.Module, scale: float) -> None:
    for moe in moe_sublayers(model).values():
        moe.aux_scale = scale


def take_loads(moes: dict[str, MoE]) -> torch.Tensor:
    """`[layers, E]` token-choices per expert since the last take (float64), zeroed for the next."""
    if not moes:
        return torch.zeros(0, 0, dtype=torch.float64)
    loads = torch.stack([m.load_E.detach().cpu() for m in moes.values()])
    for m in moes.values():
        m.load_E.zero_()
    return loads


def take_aux(moes: dict[str, MoE]) -> tuple[float, int]:
    """(sum, count) of the aux losses since the last take, zeroed for the next."""
    total = sum(m.aux_sum for m in moes.values()), sum(m.aux_count for m in moes.values())
    for m in moes.values():
        m.aux_sum, m.aux_count = 0.0, 0
    return total


@torch.no_grad()
def update_expert_bias(moes: dict[str, MoE], loads_LE: torch.Tensor) -> None:
    """Aux-free balancing after an optimiser step: `bias_e += gamma sign(mean(load) - load_e)` from
    the step's loads summed over the data-parallel group (`loads_LE`, one row per sublayer of
    `moes`, in its order), so every replica moves its bias the same way."""
    for moe, load_E in zip(moes.values(), loads_LE, strict=True):
        if moe.cfg.moe_balance != "aux_free":
            continue
        step_E = torch.sign(load_E.mean() - load_E) * moe.cfg.moe_bias_gamma
        moe.expert_bias.add_(step_E.to(moe.expert_bias))


def expert_load_stats(loads: dict[str, list[float]], aux: list[tuple[float, int]]) -> tuple[dict, dict]:
    """(summary extras, step metrics) of one step's MoE loads by sublayer name (`layers.<i>.mlp`)
    and (aux sum, count) pairs: `moe_expert_loads` {layer: tokens per expert},
    `moe_load_max_over_mean/<layer>` and its worst `moe_load_max_over_mean`, and `moe_aux_loss` (the
    mean over sublayers and microbatches) under aux-loss balancing. Empty without MoE sublayers."""
    if not loads:
        return {}, {}
    by_layer = {int(name.split(".")[1]): load for name, load in loads.items()}
    metrics = {}
    for layer in sorted(by_layer):
        load_E = torch.tensor(by_layer[layer], dtype=torch.float64)
        metrics[f"moe_load_max_over_mean/{layer}"] = float(load_E.max() / load_E.mean().clamp_min(1e-12))
    metrics["moe_load_max_over_mean"] = max(metrics.values())
    aux_count = sum(count for _sum, count in aux)
    if aux_count:
        metrics["moe_aux_loss"] = sum(total for total, _count in aux) / aux_count
    return {"moe_expert_loads": {str(layer): by_layer[layer] for layer in sorted(by_layer)}}, metrics
