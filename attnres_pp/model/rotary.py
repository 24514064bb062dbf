"""Rotary position embedding (docs/spec.md section 11): q and k of every head rotated by their
token's position, in the half-split convention of Llama and Hugging Face transformers, so that an
exported model's logits equal ours.

    inv_freq_i = theta^(-2i / E), i < E / 2;  angle_{t,i} = t inv_freq_i;  cos, sin over [angle, angle]
    rotate(x_t) = x_t cos_t + rotate_half(x_t) sin_t,   rotate_half([x1, x2]) = [-x2, x1]

The angles are computed in float32 (float64 for a float64 model) from integer positions on every
call: no table to size, so positions past the trained length rotate as any other (decoding keeps
going), and nothing lives in the state dict.
"""

from __future__ import annotations

import torch


def rotary_cos_sin(positions_T: torch.Tensor, head_dim: int, theta: float,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin `[T, E]` of `positions_T`, computed in at least float32, returned in `dtype`."""
    math_dtype = torch.promote_types(dtype, torch.float32)
    inv_freq_F = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions_T.device, dtype=torch.int64)
                                  .to(math_dtype) / head_dim))
    angles_TF = positions_T.to(math_dtype).unsqueeze(1) * inv_freq_F.unsqueeze(0)
    angles_TE = torch.cat([angles_TF, angles_TF], dim=-1)
    return angles_TE.cos().to(dtype), angles_TE.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rotary(x_BHTE: torch.Tensor, cos_TE: torch.Tensor, sin_TE: torch.Tensor) -> torch.Tensor:
    return x_BHTE * cos_TE + rotate_half(x_BHTE) * sin_TE
