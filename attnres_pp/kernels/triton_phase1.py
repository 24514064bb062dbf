"""Triton phase 1 (docs/spec.md section 2): read N completed sources with S queries at once.

Forward: one program per (token tile, d-chunk) holds all S queries and loops over the N sources
with an online softmax, so each value element is read once for every query. Scores need the whole
key row; for r-dim keys (projected, or sliced as a strided view of the values) each d-chunk program
re-reads the small key row, and for d-dim keys that fit one chunk the key read and the value read
are the same cache lines. Only d-dim keys too wide for one chunk get a score pre-pass (a second read
of the values instead of one per chunk).

Backward: kernel A recomputes the scores and, per d-chunk, writes dp = dout . v_i partial sums and
(for separate keys) the value gradient sum_s p * dout; the host turns the small [N, S, T] tensors
into score gradients; the shared key-gradient kernel writes key (and, for keys = values, value)
gradients and per-tile query-gradient partials. Nothing uses atomics.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnres_pp.kernels.triton_common import Tiles, check_device, key_scores, new_buffer, pick_tiles, tile_offsets
from attnres_pp.kernels.triton_keygrad import key_grads


@triton.jit
def _scores_kernel(
    key_ptr, stride_kn, stride_kt, stride_kk, q_ptr, stride_qs, stride_qk,
    scores_ptr, rstd_ptr,  # out: scores [N, S, T], rstd [N, T] fp32 contiguous
    N, T, S, K, eps,
    BLOCK_S: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_t = offs_t < T
    offs_t64 = offs_t.to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    mask_ST = (offs_s < S)[:, None] & mask_t[None, :]
    for i in range(N):
        src = tl.cast(i, tl.int64)
        scores_ST, rstd_T = key_scores(
            key_ptr + src * stride_kn, stride_kt, stride_kk, offs_t64, mask_t,
            q_ptr, stride_qs, stride_qk, S, K, eps, BLOCK_S, BLOCK_T, BLOCK_K,
        )  # fmt: skip
        tl.store(scores_ptr + src * S * T + offs_s[:, None] * T + offs_t64[None, :], scores_ST, mask=mask_ST)
        tl.store(rstd_ptr + src * T + offs_t64, rstd_T, mask=mask_t)


@triton.jit
def _phase1_fwd_kernel(
    v_ptr, stride_vn, stride_vt, stride_vd,  # values [N, T, D]
    key_ptr, stride_kn, stride_kt, stride_kk,  # keys [N, T, K] (the values when K = D)
    q_ptr, stride_qs, stride_qk,  # queries [S, K]
    scores_ptr,  # HAS_SCORES: precomputed scores [N, S, T] fp32
    out_ptr, lse_ptr,  # out [S, T, D] (contiguous), lse [S, T] fp32
    N, T, D, S, K, eps, n_d_chunks,
    HAS_SCORES: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_t, pid_d, offs_t64, mask_t, offs_d = tile_offsets(T, n_d_chunks, BLOCK_T, BLOCK_D)
    mask_d = offs_d < D
    offs_s = tl.arange(0, BLOCK_S)
    mask_s = offs_s < S
    mask_ST = mask_s[:, None] & mask_t[None, :]

    # Online softmax over sources, per query and token: running max, normaliser, weighted sum.
    max_ST = tl.full([BLOCK_S, BLOCK_T], float("-inf"), tl.float32)
    norm_ST = tl.zeros([BLOCK_S, BLOCK_T], tl.float32)
    acc_STD = tl.zeros([BLOCK_S, BLOCK_T, BLOCK_D], tl.float32)
    for i in range(N):
        src = tl.cast(i, tl.int64)
        if HAS_SCORES:
            scores_ST = tl.load(
                scores_ptr + src * S * T + offs_s[:, None] * T + offs_t64[None, :], mask=mask_ST, other=0.0
            ).to(tl.float32)
        else:
            scores_ST, _ = key_scores(
                key_ptr + src * stride_kn, stride_kt, stride_kk, offs_t64, mask_t,
                q_ptr, stride_qs, stride_qk, S, K, eps, BLOCK_S, BLOCK_T, BLOCK_K,
            )  # fmt: skip
        v_TD = tl.load(
            v_ptr + src * stride_vn + offs_t64[:, None] * stride_vt + offs_d[None, :] * stride_vd,
            mask=mask_t[:, None] & mask_d[None, :],
            other=0.0,
        ).to(tl.float32)
        new_max_ST = tl.maximum(max_ST, scores_ST)
        rescale_ST = tl.exp(max_ST - new_max_ST)  # exp(-inf) = 0 on the first source
        weight_ST = tl.exp(scores_ST - new_max_ST)
        norm_ST = norm_ST * rescale_ST + weight_ST
        acc_STD = acc_STD * rescale_ST[:, :, None] + weight_ST[:, :, None] * v_TD[None, :, :]
        max_ST = new_max_ST

    out_STD = acc_STD / norm_ST[:, :, None]
    out_offs = (offs_s[:, None, None] * T + offs_t64[None, :, None]) * D + offs_d[None, None, :]
    out_mask = mask_ST[:, :, None] & mask_d[None, None, :]
    tl.store(out_ptr + out_offs, out_STD.to(out_ptr.dtype.element_ty), mask=out_mask)
    # Every d-chunk computes the same LSE; the first one writes it.
    lse_ST = max_ST + tl.log(norm_ST)
    first_chunk_T = (tl.zeros([BLOCK_T], tl.int32) + pid_d) == 0  # a tensor mask, not a scalar
    tl.store(lse_ptr + offs_s[:, None] * T + offs_t64[None, :], lse_ST, mask=mask_ST & first_chunk_T[None, :])


@triton.jit
def _phase1_bwd_kernel(
    v_ptr, stride_vn, stride_vt, stride_vd,
    key_ptr, stride_kn, stride_kt, stride_kk,
    q_ptr, stride_qs, stride_qk,
    lse_ptr,  # [S, T] fp32 contiguous
    dout_ptr, stride_os, stride_ot, stride_od,  # dout [S, T, D] (any strides)
    scores_ptr, rstd_ptr,  # [N, S, T], [N, T] fp32: read if HAS_SCORES, else written by d-chunk 0
    dp_part_ptr,  # out: [n_d_chunks, N, S, T] fp32, per-chunk partial sums of dout . v_i
    dv_ptr,  # out (STORE_DV): value gradient [N, T, D] contiguous
    N, T, D, S, K, eps, n_d_chunks,
    HAS_SCORES: tl.constexpr, STORE_DV: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_t, pid_d, offs_t64, mask_t, offs_d = tile_offsets(T, n_d_chunks, BLOCK_T, BLOCK_D)
    mask_d = offs_d < D
    mask_TD = mask_t[:, None] & mask_d[None, :]
    offs_s = tl.arange(0, BLOCK_S)
    mask_s = offs_s < S
    mask_ST = mask_s[:, None] & mask_t[None, :]
    st_offs = offs_s[:, None] * T + offs_t64[None, :]
    first_chunk_T = (tl.zeros([BLOCK_T], tl.int32) + pid_d) == 0  # a tensor mask, not a scalar

    dout_STD = tl.load(
        dout_ptr
        + offs_s[:, None, None] * stride_os
        + offs_t64[None, :, None] * stride_ot
        + offs_d[None, None, :] * stride_od,
        mask=mask_s[:, None, None] & mask_TD[None, :, :],
        other=0.0,
    ).to(tl.float32)
    lse_ST = tl.load(lse_ptr + st_offs, mask=mask_ST, other=0.0).to(tl.float32)
    for i in range(N):
        src = tl.cast(i, tl.int64)
        if HAS_SCORES:
            scores_ST = tl.load(scores_ptr + src * S * T + st_offs, mask=mask_ST, other=0.0).to(tl.float32)
        else:
            scores_ST, rstd_T = key_scores(
                key_ptr + src * stride_kn, stride_kt, stride_kk, offs_t64, mask_t,
                q_ptr, stride_qs, stride_qk, S, K, eps, BLOCK_S, BLOCK_T, BLOCK_K,
            )  # fmt: skip
            tl.store(scores_ptr + src * S * T + st_offs, scores_ST, mask=mask_ST & first_chunk_T[None, :])
            tl.store(rstd_ptr + src * T + offs_t64, rstd_T, mask=mask_t & first_chunk_T)
        v_TD = tl.load(
            v_ptr + src * stride_vn + offs_t64[:, None] * stride_vt + offs_d[None, :] * stride_vd,
            mask=mask_TD,
            other=0.0,
        ).to(tl.float32)
        dp_ST = tl.sum(dout_STD * v_TD[None, :, :], axis=2)
        part_offs = (tl.cast(pid_d, tl.int64) * N + src) * S * T + st_offs
        tl.store(dp_part_ptr + part_offs, dp_ST, mask=mask_ST)
        if STORE_DV:
            probs_ST = tl.exp(scores_ST - lse_ST)
            dv_TD = tl.sum(probs_ST[:, :, None] * dout_STD, axis=0)
            tl.store(
                dv_ptr + (src * T + offs_t64[:, None]) * D + offs_d[None, :],
                dv_TD.to(dv_ptr.dtype.element_ty),
                mask=mask_TD,
            )


def _score_pass(keys_NTK, queries_SK, eps, tiles: Tiles):
    """scores [N, S, T] and rstd [N, T] (fp32) in one extra read of the keys."""
    n_sources, n_tokens, width_k = keys_NTK.shape
    n_queries = queries_SK.shape[0]
    scores_NST = new_buffer((n_sources, n_queries, n_tokens), torch.float32, keys_NTK.device)
    rstd_NT = new_buffer((n_sources, n_tokens), torch.float32, keys_NTK.device)
    _scores_kernel[(tiles.n_t_tiles,)](
        keys_NTK, *keys_NTK.stride(), queries_SK, *queries_SK.stride(), scores_NST, rstd_NT,
        n_sources, n_tokens, n_queries, width_k, eps,
        BLOCK_S=tiles.block_s, BLOCK_T=tiles.block_t, BLOCK_K=tiles.block_k, **tiles.launch_options,
    )  # fmt: skip
    return scores_NST, rstd_NT


def _needs_score_pass(keys_NTK: torch.Tensor | None, tiles: Tiles) -> bool:
    # d-dim keys split over several d-chunks would be re-read once per chunk; one pre-pass is cheaper.
    return keys_NTK is None and tiles.n_d_chunks > 1


def phase1_forward(values_NTD, queries_SK, keys_NTK=None, eps=1e-6, tile_elems=None):
    """values [N, T, d], queries [S, k], keys [N, T, k] | None -> out [S, T, d] (values' dtype),
    lse [S, T] fp32. Keys may be any strided view (e.g. the values' last r channels)."""
    check_device(values_NTD)
    n_sources, n_tokens, width_d = values_NTD.shape
    n_queries, width_k = queries_SK.shape
    key_src = values_NTD if keys_NTK is None else keys_NTK
    tiles = pick_tiles(n_queries, n_tokens, width_d, width_k, tile_elems)
    device = values_NTD.device
    out_STD = new_buffer((n_queries, n_tokens, width_d), values_NTD.dtype, device)
    lse_ST = new_buffer((n_queries, n_tokens), torch.float32, device)
    has_scores = _needs_score_pass(keys_NTK, tiles)
    scores_NST = _score_pass(key_src, queries_SK, eps, tiles)[0] if has_scores else lse_ST
    _phase1_fwd_kernel[(tiles.n_t_tiles * tiles.n_d_chunks,)](
        values_NTD, *values_NTD.stride(), key_src, *key_src.stride(), queries_SK, *queries_SK.stride(),
        scores_NST, out_STD, lse_ST,
        n_sources, n_tokens, width_d, n_queries, width_k, eps, tiles.n_d_chunks,
        HAS_SCORES=has_scores,
        BLOCK_S=tiles.block_s, BLOCK_T=tiles.block_t, BLOCK_D=tiles.block_d, BLOCK_K=tiles.block_k,
        **tiles.launch_options,
    )  # fmt: skip
    return out_STD, lse_ST


def phase1_backward(values_NTD, queries_SK, keys_NTK, lse_ST, dout_STD, dlse_ST, eps=1e-6, tile_elems=None):
    """Gradients of phase1_forward: (dvalues [N, T, d], dqueries [S, k], dkeys [N, T, k] | None),
    each in its input's dtype. dout / dlse may be None (treated as zero)."""
    check_device(values_NTD)
    n_sources, n_tokens, width_d = values_NTD.shape
    n_queries, width_k = queries_SK.shape
    device = values_NTD.device
    if dout_STD is None:  # a stride-0 zero: the kernels take any strides
        dout_STD = values_NTD.new_zeros(()).expand(n_queries, n_tokens, width_d)
    key_src = values_NTD if keys_NTK is None else keys_NTK
    tiles = pick_tiles(n_queries, n_tokens, width_d, width_k, tile_elems)
    has_scores = _needs_score_pass(keys_NTK, tiles)
    if has_scores:
        scores_NST, rstd_NT = _score_pass(key_src, queries_SK, eps, tiles)
    else:
        scores_NST = new_buffer((n_sources, n_queries, n_tokens), torch.float32, device)
        rstd_NT = new_buffer((n_sources, n_tokens), torch.float32, device)
    dp_part = new_buffer((tiles.n_d_chunks, n_sources, n_queries, n_tokens), torch.float32, device)
    dvalues_NTD = new_buffer(values_NTD.shape, values_NTD.dtype, device)
    lse_ST = lse_ST.float().contiguous()
    _phase1_bwd_kernel[(tiles.n_t_tiles * tiles.n_d_chunks,)](
        values_NTD, *values_NTD.stride(), key_src, *key_src.stride(), queries_SK, *queries_SK.stride(),
        lse_ST, dout_STD, *dout_STD.stride(), scores_NST, rstd_NT, dp_part, dvalues_NTD,
        n_sources, n_tokens, width_d, n_queries, width_k, eps, tiles.n_d_chunks,
        HAS_SCORES=has_scores, STORE_DV=keys_NTK is not None,
        BLOCK_S=tiles.block_s, BLOCK_T=tiles.block_t, BLOCK_D=tiles.block_d, BLOCK_K=tiles.block_k,
        **tiles.launch_options,
    )  # fmt: skip

    # Small [N, S, T] algebra: softmax backward plus the LSE path, ds = p * (dp - sum_j p_j dp_j + dlse).
    probs_NST = torch.exp(scores_NST - lse_ST.unsqueeze(0))
    dp_NST = dp_part.sum(dim=0)
    delta_ST = (probs_NST * dp_NST).sum(dim=0)
    dlse = 0.0 if dlse_ST is None else dlse_ST.float().unsqueeze(0)
    ds_NST = probs_NST * (dp_NST - delta_ST.unsqueeze(0) + dlse)
    c_NT = (ds_NST * scores_NST).sum(dim=1) / width_k

    if keys_NTK is None:  # one write: d(values) = value path + key path
        dq_SK = key_grads(values_NTD, rstd_NT, ds_NST, c_NT, queries_SK, dvalues_NTD, probs_NST, dout_STD, tile_elems)
        return dvalues_NTD, dq_SK.to(queries_SK.dtype), None
    dkeys_NTK = new_buffer(keys_NTK.shape, keys_NTK.dtype, device)
    dq_SK = key_grads(keys_NTK, rstd_NT, ds_NST, c_NT, queries_SK, dkeys_NTK, tile_elems=tile_elems)
    return dvalues_NTD, dq_SK.to(queries_SK.dtype), dkeys_NTK
