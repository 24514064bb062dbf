"""Backend choice for the depth-attention ops: "torch", "triton", or "auto"
(Triton for CUDA tensors, torch otherwise)."""

from __future__ import annotations

import torch

from attnres_pp.kernels.reference import phase1_conv_streams_torch, phase1_torch, phase2_torch

BACKENDS = ("auto", "torch", "triton")


def resolve_backend(backend: str, tensor: torch.Tensor) -> str:
    """"torch" or "triton": what `backend` means for ops on `tensor`."""
    return _resolve(backend, tensor)


def _resolve(backend: str, tensor: torch.Tensor) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is unknown; choose one of {', '.join(BACKENDS)}")
    if backend == "auto":
        return "triton" if tensor.is_cuda and _triton_available() else "torch"
    return backend


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def phase1(values, queries, *, keys=None, eps: float = 1e-6, backend: str = "auto"):
    """values [N, T, d], queries [S, d or r], keys [N, T, r] | None -> (out [S, T, d], lse [S, T])."""
    if _resolve(backend, values) == "triton":
        from attnres_pp.kernels import triton_ops

        return triton_ops.phase1(values, queries, keys=keys, eps=eps)
    return phase1_torch(values, queries, keys, eps)


def phase2(out1, lse1, partial, query, *, partial_key=None, eps: float = 1e-6, backend: str = "auto"):
    """out1 [T, d], lse1 [T], partial [T, d], query [d or r], partial_key [T, r] | None -> h [T, d]."""
    if _resolve(backend, partial) == "triton":
        from attnres_pp.kernels import triton_ops

        return triton_ops.phase2(out1, lse1, partial, query, partial_key=partial_key, eps=eps)
    return phase2_torch(out1, lse1, partial, query, partial_key, eps)


def phase1_streams(sources, taps, kernel_sizes, queries, seq_len: int, *, eps: float = 1e-6, backend: str = "auto"):
    """MSAR phase 1 of all m streams: sources [N, T, d], taps [N, m-1, kappa_max, d] (zero past each
    stream's kernel size), queries [m, S, d] -> (out [m, S, T, d], lse [m, S, T]). Triton: one fused
    kernel that never writes the streams; torch: the streams written out, then phase 1 (the twin)."""
    if _resolve(backend, sources) == "triton":
        from attnres_pp.kernels import triton_ops

        return triton_ops.phase1_streams(sources, taps, kernel_sizes, queries, seq_len, eps=eps)
    return phase1_conv_streams_torch(sources, taps, kernel_sizes, queries, seq_len, eps)
