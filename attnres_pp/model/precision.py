"""Mixed precision (`--dtype`): which dtype the model computes and keeps its activations in.

fp32 runs as written. bf16 runs every forward under `torch.autocast(dtype=bfloat16)` while the
parameters, their gradients and the optimiser state stay fp32 (master weights), and every tensor
that flows between sublayers (the embedding, block sums, partials, the standard residual) is kept
in bf16 (`to_activation`), in the single-process model and in pipeline chunks alike: hops, cache
entries and their gradient deposits then carry bf16, half the bytes of fp32, and a pipelined step
computes what the single process computes. Norms and the depth-attention math run in fp32 after
their loads (the kernels and their torch twin), the loss in fp32.
"""

from __future__ import annotations

import contextlib

import torch

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16}


def compute_context(precision: str, device_type: str):
    """The context a forward runs in: autocast to bf16, or nothing for fp32."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is invalid: choose one of {', '.join(PRECISIONS)}")
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=PRECISIONS[precision])


def activation_dtype(precision: str, param_dtype: torch.dtype = torch.float32) -> torch.dtype:
    """The dtype of hops, cache entries and deposits: bf16 under bf16, else the parameters' dtype."""
    return PRECISIONS[precision] if precision != "fp32" else param_dtype


def to_activation(x: torch.Tensor) -> torch.Tensor:
    """`x` in the activation dtype: the autocast dtype while autocast is on, else unchanged."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return x.to(torch.get_autocast_dtype(device_type))
    return x
