"""The sublayers of one transformer layer (PreNorm attention and MLP) and the RMSNorm they use.

Each sublayer returns its output packed with its raw low-rank key when keys are projected:
`[B, T, d + r]`, so that block sums of values and keys are one addition (SPEC section 1.3). The key
is normalised where it is emitted into the depth state (`depth.emit_source`), not here, so these
modules stay plain projections.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from attnres_pp.model.config import ModelConfig
from attnres_pp.model.depth import DepthRead


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


class Attention(nn.Module):
    """Causal multi-head self-attention: d -> d (+ r key columns)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.source_width, bias=False)
        self.read = DepthRead(cfg)

    def forward(self, h_BTD: torch.Tensor) -> torch.Tensor:
        batch, seq, width = h_BTD.shape
        qkv = self.qkv(self.norm(h_BTD)).view(batch, seq, 3, self.n_heads, width // self.n_heads)
        q_BHTE, k_BHTE, v_BHTE = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        y_BHTE = F.scaled_dot_product_attention(q_BHTE, k_BHTE, v_BHTE, is_causal=True)
        return self.proj(y_BHTE.transpose(1, 2).reshape(batch, seq, width))


class MLP(nn.Module):
    """GELU MLP: d -> d_ff -> d (+ r key columns)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.up = nn.Linear(cfg.d_model, cfg.ff_dim, bias=False)
        self.down = nn.Linear(cfg.ff_dim, cfg.source_width, bias=False)
        self.read = DepthRead(cfg)

    def forward(self, h_BTD: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(self.norm(h_BTD))))


class TransformerLayer(nn.Module):
    """Two sublayers; sublayer 2i is layer i's attention, 2i + 1 its MLP."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn = Attention(cfg)
        self.mlp = MLP(cfg)

    def sublayer(self, which: int) -> Attention | MLP:
        return self.mlp if which else self.attn


class Embedding(nn.Module):
    """Token + learned position embedding; under projected keys also the embedding key (d -> r)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.key_proj = nn.Linear(cfg.d_model, cfg.projected_key_rank, bias=False) if cfg.projected_key_rank else None

    def forward(self, idx_BT: torch.Tensor) -> torch.Tensor:
        positions_T = torch.arange(idx_BT.shape[1], device=idx_BT.device)
        o_emb_BTD = self.tok(idx_BT) + self.pos(positions_T)
        if self.key_proj is None:
            return o_emb_BTD
        return torch.cat([o_emb_BTD, self.key_proj(o_emb_BTD)], dim=-1)


def init_weights(module: nn.Module, cfg: ModelConfig) -> None:
    """GPT-2 style init; output projections scaled by 1/sqrt(2 n_layers) so sums stay O(1).

    Pseudo-queries and gates keep their own (zero / moving-average) init from their constructors.
    """
    for name, sub in module.named_modules():
        if isinstance(sub, nn.Linear):
            std = cfg.init_std
            if name.endswith(("proj", "down")) and not name.endswith("key_proj"):
                std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
            nn.init.normal_(sub.weight, mean=0.0, std=std)
        elif isinstance(sub, nn.Embedding):
            nn.init.normal_(sub.weight, mean=0.0, std=cfg.init_std)
