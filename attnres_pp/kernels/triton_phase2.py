"""Triton phase 2 (docs/spec.md section 2): merge the phase-1 read with the open partial,
h = o1 + g * (p - o1), g = sigmoid(s_p - lse1), s_p = q . RMSNorm(partial_key or partial).

One program per (token tile, d-chunk); the gate needs the whole key row, which each d-chunk program
reads (the partial's own row when keys are the partial: the same cache lines as its value load).

Backward: kernel A writes d(o1) = (1 - g) dh, d(partial) = g dh (separate keys only) and per-chunk
partial sums of dg = dh . (p - o1); the host forms ds_p = dg g (1 - g) and d(lse1) = -ds_p; the
shared key-gradient kernel (N = S = 1) writes the key gradient (for keys = partial, together with
g dh) and per-tile query-gradient partials. Nothing uses atomics.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnres_pp.kernels.triton_common import check_device, key_scores, new_buffer, pick_tiles, tile_offsets
from attnres_pp.kernels.triton_keygrad import key_grads


@triton.jit
def _gate(key_ptr, stride_kt, stride_kk, offs_t64, mask_t, q_ptr, stride_qk, lse_ptr, K, eps,
          BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """(g [T], s_p [T], rstd [T]) for one token tile."""
    scores_1T, rstd_T = key_scores(
        key_ptr, stride_kt, stride_kk, offs_t64, mask_t, q_ptr, 0, stride_qk, 1, K, eps, 1, BLOCK_T, BLOCK_K
    )
    score_T = tl.sum(scores_1T, axis=0)  # drop the size-1 query axis
    lse_T = tl.load(lse_ptr + offs_t64, mask=mask_t, other=0.0).to(tl.float32)
    gate_T = 1.0 / (1.0 + tl.exp(lse_T - score_T))
    return gate_T, score_T, rstd_T


@triton.jit
def _load_tile(ptr, stride_t, stride_d, offs_t64, offs_d, mask_TD):
    """A [T, D] tile as fp32 (zeros where masked)."""
    return tl.load(ptr + offs_t64[:, None] * stride_t + offs_d[None, :] * stride_d, mask=mask_TD, other=0.0).to(
        tl.float32
    )


@triton.jit
def _phase2_fwd_kernel(
    o1_ptr, stride_ot, stride_od,  # out1 [T, D]
    lse_ptr,  # lse1 [T] (contiguous)
    p_ptr, stride_pt, stride_pd,  # partial [T, D]
    key_ptr, stride_kt, stride_kk,  # partial key [T, K] (the partial when K = D)
    q_ptr, stride_qk,  # query [K]
    h_ptr,  # out: h [T, D] contiguous
    T, D, K, eps, n_d_chunks,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_t, pid_d, offs_t64, mask_t, offs_d = tile_offsets(T, n_d_chunks, BLOCK_T, BLOCK_D)
    mask_TD = mask_t[:, None] & (offs_d < D)[None, :]

    gate_T, _, _ = _gate(
        key_ptr, stride_kt, stride_kk, offs_t64, mask_t, q_ptr, stride_qk, lse_ptr, K, eps, BLOCK_T, BLOCK_K
    )
    o1_TD = _load_tile(o1_ptr, stride_ot, stride_od, offs_t64, offs_d, mask_TD)
    p_TD = _load_tile(p_ptr, stride_pt, stride_pd, offs_t64, offs_d, mask_TD)
    h_TD = o1_TD + gate_T[:, None] * (p_TD - o1_TD)
    tl.store(h_ptr + offs_t64[:, None] * D + offs_d[None, :], h_TD.to(h_ptr.dtype.element_ty), mask=mask_TD)


@triton.jit
def _phase2_bwd_kernel(
    o1_ptr, stride_ot, stride_od,
    lse_ptr,
    p_ptr, stride_pt, stride_pd,
    key_ptr, stride_kt, stride_kk,
    q_ptr, stride_qk,
    dh_ptr, stride_ht, stride_hd,  # dh [T, D] (any strides)
    do1_ptr, dp_ptr,  # out: d(out1), d(partial) (STORE_DP) [T, D] contiguous
    score_ptr, rstd_ptr,  # out (d-chunk 0): s_p [T], rstd [T] fp32
    dg_part_ptr,  # out: [n_d_chunks, T] fp32 partial sums of dh . (p - o1)
    T, D, K, eps, n_d_chunks,
    STORE_DP: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_t, pid_d, offs_t64, mask_t, offs_d = tile_offsets(T, n_d_chunks, BLOCK_T, BLOCK_D)
    mask_TD = mask_t[:, None] & (offs_d < D)[None, :]
    first_chunk_T = (tl.zeros([BLOCK_T], tl.int32) + pid_d) == 0  # a tensor mask, not a scalar

    gate_T, score_T, rstd_T = _gate(
        key_ptr, stride_kt, stride_kk, offs_t64, mask_t, q_ptr, stride_qk, lse_ptr, K, eps, BLOCK_T, BLOCK_K
    )
    tl.store(score_ptr + offs_t64, score_T, mask=mask_t & first_chunk_T)
    tl.store(rstd_ptr + offs_t64, rstd_T, mask=mask_t & first_chunk_T)
    o1_TD = _load_tile(o1_ptr, stride_ot, stride_od, offs_t64, offs_d, mask_TD)
    p_TD = _load_tile(p_ptr, stride_pt, stride_pd, offs_t64, offs_d, mask_TD)
    dh_TD = _load_tile(dh_ptr, stride_ht, stride_hd, offs_t64, offs_d, mask_TD)
    out_offs = offs_t64[:, None] * D + offs_d[None, :]
    tl.store(do1_ptr + out_offs, (dh_TD - gate_T[:, None] * dh_TD).to(do1_ptr.dtype.element_ty), mask=mask_TD)
    if STORE_DP:
        tl.store(dp_ptr + out_offs, (gate_T[:, None] * dh_TD).to(dp_ptr.dtype.element_ty), mask=mask_TD)
    dg_T = tl.sum(dh_TD * (p_TD - o1_TD), axis=1)
    tl.store(dg_part_ptr + tl.cast(pid_d, tl.int64) * T + offs_t64, dg_T, mask=mask_t)


def phase2_forward(out1_TD, lse1_T, partial_TD, query_K, partial_key_TK=None, eps=1e-6, tile_elems=None):
    """out1 [T, d], lse1 [T], partial [T, d], query [k], partial_key [T, k] | None -> h [T, d]
    in the partial's dtype."""
    check_device(partial_TD)
    n_tokens, width_d = partial_TD.shape
    width_k = query_K.shape[0]
    key_src = partial_TD if partial_key_TK is None else partial_key_TK
    tiles = pick_tiles(1, n_tokens, width_d, width_k, tile_elems)
    h_TD = new_buffer((n_tokens, width_d), partial_TD.dtype, partial_TD.device)
    _phase2_fwd_kernel[(tiles.n_t_tiles * tiles.n_d_chunks,)](
        out1_TD, *out1_TD.stride(), lse1_T.contiguous(), partial_TD, *partial_TD.stride(),
        key_src, *key_src.stride(), query_K, *query_K.stride(), h_TD,
        n_tokens, width_d, width_k, eps, tiles.n_d_chunks,
        BLOCK_T=tiles.block_t, BLOCK_D=tiles.block_d, BLOCK_K=tiles.block_k, **tiles.launch_options,
    )  # fmt: skip
    return h_TD


def phase2_backward(out1_TD, lse1_T, partial_TD, query_K, partial_key_TK, dh_TD, eps=1e-6, tile_elems=None):
    """Gradients of phase2_forward: (d_out1, d_lse1, d_partial, d_query, d_partial_key | None),
    each in its input's dtype."""
    check_device(partial_TD)
    n_tokens, width_d = partial_TD.shape
    width_k = query_K.shape[0]
    device = partial_TD.device
    key_src = partial_TD if partial_key_TK is None else partial_key_TK
    tiles = pick_tiles(1, n_tokens, width_d, width_k, tile_elems)
    lse1_f32 = lse1_T.float().contiguous()
    d_out1 = new_buffer((n_tokens, width_d), out1_TD.dtype, device)
    d_partial = new_buffer((n_tokens, width_d), partial_TD.dtype, device)
    score_T = new_buffer((n_tokens,), torch.float32, device)
    rstd_T = new_buffer((n_tokens,), torch.float32, device)
    dg_part = new_buffer((tiles.n_d_chunks, n_tokens), torch.float32, device)
    _phase2_bwd_kernel[(tiles.n_t_tiles * tiles.n_d_chunks,)](
        out1_TD, *out1_TD.stride(), lse1_f32, partial_TD, *partial_TD.stride(),
        key_src, *key_src.stride(), query_K, *query_K.stride(), dh_TD, *dh_TD.stride(),
        d_out1, d_partial, score_T, rstd_T, dg_part,
        n_tokens, width_d, width_k, eps, tiles.n_d_chunks,
        STORE_DP=partial_key_TK is not None,
        BLOCK_T=tiles.block_t, BLOCK_D=tiles.block_d, BLOCK_K=tiles.block_k, **tiles.launch_options,
    )  # fmt: skip

    # Small [T] algebra: sigmoid backward; lse1 enters the gate with the opposite sign of s_p.
    gate_T = torch.sigmoid(score_T - lse1_f32)
    ds_T = dg_part.sum(dim=0) * gate_T * (1.0 - gate_T)
    d_lse1 = (-ds_T).to(lse1_T.dtype)
    c_T = ds_T * score_T / width_k
    one_source = dict(rstd_NT=rstd_T[None], ds_NST=ds_T[None, None], c_NT=c_T[None], queries_SK=query_K[None])
    if partial_key_TK is None:  # one write: d(partial) = g dh + key path
        dq = key_grads(
            partial_TD[None], **one_source, dkeys_NTK=d_partial[None],
            probs_NST=gate_T[None, None], dout_STK=dh_TD[None], tile_elems=tile_elems,
        )  # fmt: skip
        return d_out1, d_lse1, d_partial, dq[0].to(query_K.dtype), None
    d_key = new_buffer(partial_key_TK.shape, partial_key_TK.dtype, device)
    dq = key_grads(partial_key_TK[None], **one_source, dkeys_NTK=d_key[None], tile_elems=tile_elems)
    return d_out1, d_lse1, d_partial, dq[0].to(query_K.dtype), d_key
