"""Shared pieces of the pipeline parity tests: configs, the single-process reference step, and
the comparison rule."""

from __future__ import annotations

import torch

from attnres_pp.model import ModelConfig, Transformer
from tests.reference_model import VARIANTS, randomize_depth_params

SEQ = 8
MICRO = 2  # sequences per microbatch


def model_config(variant: str, n_layers: int, **overrides) -> ModelConfig:
    return ModelConfig(**{**dict(vocab_size=32, n_layers=n_layers, d_model=16, n_heads=2, seq_len=SEQ),
                          **VARIANTS[variant], **overrides})


def build_model(cfg: ModelConfig, dtype=torch.float32, backend: str = "torch") -> Transformer:
    """Seeded model whose pseudo-queries and gates are non-zero, so every read is a real softmax."""
    torch.manual_seed(0)
    model = Transformer(cfg, backend=backend).to(dtype)
    randomize_depth_params(model, torch.Generator().manual_seed(1))
    return model


def batch(n_microbatches: int, seed: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (MICRO * n_microbatches, SEQ)
    return torch.randint(0, 32, shape, generator=g), torch.randint(0, 32, shape, generator=g)


def reference_step(cfg: ModelConfig, inputs, targets, n_microbatches: int, dtype=torch.float32):
    """Loss and every parameter gradient of the single-process model, accumulated over microbatches."""
    model = build_model(cfg, dtype)
    total = 0.0
    for i, t in zip(inputs.chunk(n_microbatches), targets.chunk(n_microbatches), strict=True):
        loss = model(i, t)
        (loss / n_microbatches).backward()
        total += float(loss.detach())
    return total / n_microbatches, {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_grads_match(got: dict, want: dict, rtol: float) -> None:
    """Per tensor: max |got - want| <= rtol * max |want| (+ a floor for gradients that cancel to ~0)."""
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    floor = 1e-8 if next(iter(want.values())).dtype == torch.float32 else 1e-14
    for name, w in want.items():
        g = got[name]
        assert g is not None, f"{name}: no gradient"
        err = (g - w).abs().max().item()
        scale = w.abs().max().item()
        assert err <= rtol * scale + floor, f"{name}: max abs err {err:.3e}, max |grad| {scale:.3e}"
