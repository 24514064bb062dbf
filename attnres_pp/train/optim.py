"""The optimiser side of a step: AdamW with weight decay on matrices only, the learning-rate
schedule (linear warmup, cosine to a floor) and deterministic gradient-norm clipping that can be
summed across pipeline ranks."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch

from attnres_pp.train.config import TrainConfig

# Parameter names containing one of these never decay, whatever their shape: norms' gains and
# pseudo-queries are per-channel vectors even if a module stores several of them as one matrix.
_NO_DECAY_NAME_PARTS = ("norm", "query", "queries", "bias")


def decays(name: str, shape: tuple[int, ...] | torch.Size) -> bool:
    """True if the parameter called `name` with `shape` gets weight decay. A pure function of the
    name and shape, so a model split into pipeline chunks groups its parameters the same way."""
    lowered = name.lower()
    return len(shape) >= 2 and not any(part in lowered for part in _NO_DECAY_NAME_PARTS)


def is_router(name: str) -> bool:
    """An MoE sublayer's router weight (docs/spec.md section 12), by its name."""
    return name.endswith("router.weight")


def build_optimizer(
    params: torch.nn.Module | Iterable[tuple[str, torch.nn.Parameter]] | Iterable[torch.nn.Parameter],
    train_cfg: TrainConfig,
    fused: bool = False,
    router_lr_scale: float = 1.0,
) -> torch.optim.AdamW:
    """AdamW over `params` (a module, `named_parameters()` pairs, or bare parameters, which are
    grouped by shape alone), two groups: decayed matrices and undecayed vectors; with
    `router_lr_scale` != 1 the MoE routers' weights form a third, decayed group whose learning rate
    is that fraction of the run's (`set_lr`). `fused` (for parameters on a CUDA GPU) runs one fused
    kernel per step instead of per-parameter updates."""
    if isinstance(params, torch.nn.Module):
        params = params.named_parameters()
    named = [item if isinstance(item, tuple) else ("", item) for item in params]
    apart = router_lr_scale != 1.0
    router = [p for name, p in named if p.requires_grad and apart and is_router(name)]
    named = [(name, p) for name, p in named if not (apart and is_router(name))]
    decay = [p for name, p in named if p.requires_grad and decays(name, p.shape)]
    no_decay = [p for name, p in named if p.requires_grad and not decays(name, p.shape)]
    groups = [
        {"params": decay, "weight_decay": train_cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
        {"params": router, "weight_decay": train_cfg.weight_decay, "lr_scale": router_lr_scale},
    ]
    groups = [group for group in groups if group["params"]]
    if not groups:
        raise ValueError("build_optimizer got no trainable parameters")
    implementation = {"fused": True} if fused else {"foreach": False}
    return torch.optim.AdamW(groups, lr=train_cfg.lr, betas=(train_cfg.beta1, train_cfg.beta2), eps=1e-8,
                             **implementation)


def lr_at(step: int, train_cfg: TrainConfig) -> float:
    """Learning rate of 0-based `step`: linear warmup from lr / w up to lr over the first
    w = `warmup_length(train_cfg)` steps, then a cosine from lr (at step w) down to min_lr_ratio * lr
    at the last step, steps - 1. A run too short for its warmup keeps half of it for the decay, so
    every run ends on the floor (a 1-step run trains at the floor rate)."""
    peak = train_cfg.lr
    floor = peak * train_cfg.min_lr_ratio
    warmup = warmup_length(train_cfg)
    if step < warmup:
        return peak * (step + 1) / warmup
    decay_steps = train_cfg.steps - 1 - warmup
    progress = 1.0 if decay_steps <= 0 else min(1.0, (step - warmup) / decay_steps)
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def warmup_length(train_cfg: TrainConfig) -> int:
    """The warmup steps a run takes: `warmup_steps`, but at most half of the run (`steps // 2`), so
    a run shorter than its warmup still decays to the floor by its last step."""
    return min(train_cfg.warmup_steps, train_cfg.steps // 2)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """`lr` for every group, times the group's `lr_scale` where it has one (the routers')."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)


def clip_grad_norm_(
    params: Iterable[torch.nn.Parameter],
    max_norm: float,
    reduce_sq: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> float:
    """Scale the gradients of `params` in place so that their global L2 norm is at most
    `max_norm` (0 disables the scaling) and return the norm before scaling.

    The local squared norm is summed in float64 in parameter order (deterministic) from one
    `_foreach_norm` per device, so a GPU rank synchronises with the host once, not once per
    parameter. `reduce_sq`, if given, maps that 0-dim float64 tensor (on the gradients' device)
    to the sum over all pipeline ranks (an all-reduce);
    every rank then applies the same scale. Tied parameters replicated on several ranks must be
    counted once by the caller's choice of `params`."""
    # a tp weight's gradient as this rank's shard: the caller's `reduce_sq` sums the squares over tp
    grads = [local_shard(p.grad.detach()) for p in params if p.grad is not None]
    local_sq = sum_of_squares(grads)
    total_sq = reduce_sq(local_sq) if reduce_sq is not None else local_sq
    total_norm = float(total_sq.sqrt())  # the one host synchronisation of the step's clipping
    if max_norm > 0 and total_norm > max_norm and grads:
        torch._foreach_mul_(grads, max_norm / (total_norm + 1e-6))
    return total_norm


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor (a tensor-parallel weight, its gradient or an AdamW moment) as this rank's local shard,
    an alias of its storage (writing it writes the DTensor); a plain tensor as it is."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def sum_of_squares(grads: list[torch.Tensor]) -> torch.Tensor:
    """sum of squared gradient norms as a 0-dim float64 tensor on the gradients' device: one
    `_foreach_norm` per device and one stacked sum in parameter order (deterministic, and no
    host synchronisation per parameter)."""
    if not grads:
        return torch.zeros((), dtype=torch.float64)
    device = grads[0].device
    norms: list = [None] * len(grads)
    for group_device in dict.fromkeys(g.device for g in grads):
        indices = [i for i, g in enumerate(grads) if g.device == group_device]
        for i, norm in zip(indices, torch._foreach_norm([grads[i] for i in indices]), strict=True):
            norms[i] = norm.to(device)
    return torch.stack(norms).to(torch.float64).square().sum()


def optimizer_step(optimizer: torch.optim.Optimizer, params: Iterable[torch.nn.Parameter], lr: float,
                   max_norm: float, reduce_sq: Callable[[torch.Tensor], torch.Tensor] | None = None) -> float:
    """The one optimiser step every engine runs: clip the gradients of `params` to the global norm
    `max_norm` (summed over ranks by `reduce_sq`, see `clip_grad_norm_`), set the learning rate,
    step, and drop the gradients. Returns the norm before clipping."""
    grad_norm = clip_grad_norm_(params, max_norm, reduce_sq)
    set_lr(optimizer, lr)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm
