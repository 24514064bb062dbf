"""The Triton depth-attention ops as torch.library custom ops (namespace `attnres_pp`), with fake
(meta) kernels and autograd, so they run eagerly and under torch.compile (as opaque ops).

    phase1(values [N,T,d], queries [S,k], *, keys [N,T,k] | None, eps) -> (out [S,T,d], lse [S,T])
    phase2(out1 [T,d], lse1 [T], partial [T,d], query [k], *, partial_key [T,k] | None, eps) -> h [T,d]
    phase1_streams(sources [N,T,d], taps [N,m-1,kappa,d], kernel_sizes, queries [m,S,d], seq_len, eps)
        -> (out [m,S,T,d], lse [m,S,T])   (MSAR: conv streams and phase 1 fused)

Keys may be strided views (sliced keys are the values' last r channels): the kernels take strides,
so no copy is made, and autograd routes the key gradient back into the viewed values.
The backward passes are custom ops too, so a compiled graph calls the Triton backward kernels.
Kernels run on CUDA tensors, or on CPU tensors when TRITON_INTERPRET=1 was set before import.
"""

# No `from __future__ import annotations`: torch.library infers the op schema from real annotations.
import torch
from torch import Tensor

from attnres_pp.kernels import triton_msar_streams, triton_msar_streams_bwd, triton_phase1, triton_phase2


def _no_grad_placeholder(like: Tensor) -> Tensor:
    # Custom ops cannot return None; an empty tensor stands for "no key tensor, no key gradient".
    return like.new_empty((0,))


# ---------------------------------------------------------------------------------------- phase 1


@torch.library.custom_op("attnres_pp::phase1", mutates_args=())
def _phase1_op(values: Tensor, queries: Tensor, keys: Tensor | None, eps: float) -> tuple[Tensor, Tensor]:
    return triton_phase1.phase1_forward(values, queries, keys, eps)


@_phase1_op.register_fake
def _phase1_fake(values, queries, keys, eps):
    n_tokens, width_d = values.shape[1], values.shape[2]
    n_queries = queries.shape[0]
    return (
        values.new_empty((n_queries, n_tokens, width_d)),
        values.new_empty((n_queries, n_tokens), dtype=torch.float32),
    )


@torch.library.custom_op("attnres_pp::phase1_backward", mutates_args=())
def _phase1_backward_op(
    values: Tensor, queries: Tensor, keys: Tensor | None, lse: Tensor, d_out: Tensor, d_lse: Tensor, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    d_values, d_queries, d_keys = triton_phase1.phase1_backward(values, queries, keys, lse, d_out, d_lse, eps)
    return d_values, d_queries, _no_grad_placeholder(values) if d_keys is None else d_keys


@_phase1_backward_op.register_fake
def _phase1_backward_fake(values, queries, keys, lse, d_out, d_lse, eps):
    # The launchers return fresh contiguous gradients whatever the inputs' strides (views included).
    d_keys = _no_grad_placeholder(values) if keys is None else keys.new_empty(keys.shape)
    return values.new_empty(values.shape), queries.new_empty(queries.shape), d_keys


def _phase1_setup_context(ctx, inputs, output):
    values, queries, keys, eps = inputs
    ctx.save_for_backward(values, queries, keys, output[1])
    ctx.eps = eps
    ctx.has_keys = keys is not None


def _phase1_backward(ctx, d_out, d_lse):
    values, queries, keys, lse = ctx.saved_tensors
    # Unused outputs may arrive as None; the kernels want real (possibly zero) gradients.
    if d_out is None:  # a stride-0 zero: the kernels take any strides
        d_out = values.new_zeros(()).expand(lse.shape[0], lse.shape[1], values.shape[-1])
    d_lse = torch.zeros_like(lse) if d_lse is None else d_lse
    d_values, d_queries, d_keys = _phase1_backward_op(values, queries, keys, lse, d_out, d_lse, ctx.eps)
    return d_values, d_queries, (d_keys if ctx.has_keys else None), None


_phase1_op.register_autograd(_phase1_backward, setup_context=_phase1_setup_context)


# ---------------------------------------------------------------------------------------- phase 2


@torch.library.custom_op("attnres_pp::phase2", mutates_args=())
def _phase2_op(
    out1: Tensor, lse1: Tensor, partial: Tensor, query: Tensor, partial_key: Tensor | None, eps: float
) -> Tensor:
    return triton_phase2.phase2_forward(out1, lse1, partial, query, partial_key, eps)


@_phase2_op.register_fake
def _phase2_fake(out1, lse1, partial, query, partial_key, eps):
    return partial.new_empty(partial.shape)


@torch.library.custom_op("attnres_pp::phase2_backward", mutates_args=())
def _phase2_backward_op(
    out1: Tensor, lse1: Tensor, partial: Tensor, query: Tensor, partial_key: Tensor | None, d_h: Tensor, eps: float
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    grads = triton_phase2.phase2_backward(out1, lse1, partial, query, partial_key, d_h, eps)
    d_key = grads[4]
    return (*grads[:4], _no_grad_placeholder(partial) if d_key is None else d_key)


@_phase2_backward_op.register_fake
def _phase2_backward_fake(out1, lse1, partial, query, partial_key, d_h, eps):
    d_key = _no_grad_placeholder(partial) if partial_key is None else partial_key.new_empty(partial_key.shape)
    return tuple(x.new_empty(x.shape) for x in (out1, lse1, partial, query)) + (d_key,)


def _phase2_setup_context(ctx, inputs, output):
    out1, lse1, partial, query, partial_key, eps = inputs
    ctx.save_for_backward(out1, lse1, partial, query, partial_key)
    ctx.eps = eps
    ctx.has_key = partial_key is not None


def _phase2_backward(ctx, d_h):
    out1, lse1, partial, query, partial_key = ctx.saved_tensors
    d_out1, d_lse1, d_partial, d_query, d_key = _phase2_backward_op(
        out1, lse1, partial, query, partial_key, d_h, ctx.eps
    )
    return d_out1, d_lse1, d_partial, d_query, (d_key if ctx.has_key else None), None


_phase2_op.register_autograd(_phase2_backward, setup_context=_phase2_setup_context)


# ------------------------------------------------------------------------- MSAR streams + phase 1


@torch.library.custom_op("attnres_pp::phase1_streams", mutates_args=())
def _streams_op(sources: Tensor, taps: Tensor, queries: Tensor, kernel_sizes: list[int], seq_len: int,
                eps: float) -> tuple[Tensor, Tensor]:
    return triton_msar_streams.streams_forward(sources, taps, kernel_sizes, queries, seq_len, eps)


@_streams_op.register_fake
def _streams_fake(sources, taps, queries, kernel_sizes, seq_len, eps):
    n_streams, n_queries = queries.shape[0], queries.shape[1]
    n_tokens, width_d = sources.shape[1], sources.shape[2]
    return (sources.new_empty((n_streams, n_queries, n_tokens, width_d)),
            sources.new_empty((n_streams, n_queries, n_tokens), dtype=torch.float32))


@torch.library.custom_op("attnres_pp::phase1_streams_backward", mutates_args=())
def _streams_backward_op(sources: Tensor, taps: Tensor, queries: Tensor, kernel_sizes: list[int], seq_len: int,
                         lse: Tensor, d_out: Tensor, d_lse: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    return triton_msar_streams_bwd.streams_backward(sources, taps, kernel_sizes, queries, seq_len, lse, d_out,
                                                    d_lse, eps)


@_streams_backward_op.register_fake
def _streams_backward_fake(sources, taps, queries, kernel_sizes, seq_len, lse, d_out, d_lse, eps):
    return sources.new_empty(sources.shape), taps.new_empty(taps.shape), queries.new_empty(queries.shape)


def _streams_setup_context(ctx, inputs, output):
    sources, taps, queries, kernel_sizes, seq_len, eps = inputs
    ctx.save_for_backward(sources, taps, queries, output[1])
    ctx.kernel_sizes, ctx.seq_len, ctx.eps = kernel_sizes, seq_len, eps


def _streams_backward(ctx, d_out, d_lse):
    sources, taps, queries, lse = ctx.saved_tensors
    if d_out is None:  # a stride-0 zero: the kernels take any strides
        d_out = sources.new_zeros(()).expand(*lse.shape, sources.shape[-1])
    d_lse = torch.zeros_like(lse) if d_lse is None else d_lse
    d_sources, d_taps, d_queries = _streams_backward_op(sources, taps, queries, ctx.kernel_sizes, ctx.seq_len, lse,
                                                        d_out, d_lse, ctx.eps)
    return d_sources, d_taps, d_queries, None, None, None


_streams_op.register_autograd(_streams_backward, setup_context=_streams_setup_context)


# ------------------------------------------------------------------------------------- public API


def phase1(values: Tensor, queries: Tensor, *, keys: Tensor | None = None, eps: float = 1e-6):
    """values [N, T, d], queries [S, k], keys [N, T, k] | None -> (out [S, T, d], lse [S, T] fp32).

    out = sum_i softmax_i(q . RMSNorm(key_i)) v_i, lse = logsumexp_i of the same scores."""
    return _phase1_op(values, queries, keys, eps)


def phase2(
    out1: Tensor,
    lse1: Tensor,
    partial: Tensor,
    query: Tensor,
    *,
    partial_key: Tensor | None = None,
    eps: float = 1e-6,
) -> Tensor:
    """h [T, d] = out1 + sigmoid(s_p - lse1) * (partial - out1), s_p = query . RMSNorm(partial_key
    or partial)."""
    return _phase2_op(out1, lse1, partial, query, partial_key, eps)


def phase1_streams(sources: Tensor, taps: Tensor, kernel_sizes: list[int], queries: Tensor, seq_len: int,
                   eps: float = 1e-6) -> tuple[Tensor, Tensor]:
    """MSAR phase 1 of every stream, the streams computed in the kernel and never stored.

    sources [N, T, d] (T = whole sequences of seq_len), taps [N, m-1, kappa_max, d] (conv stream s
    uses its first kernel_sizes[s-1] taps: u[t] = sum_delta taps[delta] * v[t - delta]), queries
    [m, S, d] (stream 0 the identity) -> out [m, S, T, d], lse [m, S, T] fp32."""
    return _streams_op(sources, taps, queries, list(kernel_sizes), seq_len, eps)
