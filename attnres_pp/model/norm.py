"""RMSNorm, the norm of every sublayer, of MoE's input and of the output (docs/spec.md section 1)."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm with a learned gain (the sublayers' and the output norm)."""

    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # At least fp32 math (a bf16 activation under autocast), back in the input's dtype.
        math = x.to(torch.promote_types(x.dtype, torch.float32))
        return (math * torch.rsqrt(math.pow(2).mean(dim=-1, keepdim=True) + self.eps) * self.weight).to(x.dtype)
