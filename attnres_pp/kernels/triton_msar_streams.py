"""Triton fused MSAR phase 1 (docs/spec.md sections 1.4 and 2), forward: the causal-conv streams of the
completed sources and the batched depth read of every stream in one kernel, the streams never
written to memory (as the MSAR paper does).

Stream s of source i is `u[s, i, t] = sum_{delta < kappa_s} taps[i, s, delta] * v[i, t - delta]`
per channel, with v = 0 before the start of t's sequence (tokens are whole sequences of
`seq_len`, flattened). Stream 0 is the identity: the host passes kappa_0 = 1 and the tap 1.0, so
the kernel reads the source buffer directly (one load, an exact product by one) with no branch.

One program per (token tile, d-chunk, stream) holds all S queries of its stream, and loops over the
N sources with an online softmax, as `triton_phase1` does for a single stream. The score needs the
whole normalised row of the stream, so `stream_scores` convolves the row chunk by chunk (BLOCK_K
channels at a time) before the d-chunk's value tile is convolved; the kappa shifted loads of a
tile hit the same cache lines. Backward: `triton_msar_streams_bwd`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnres_pp.kernels.triton_common import check_device, new_buffer, pick_tiles, tile_offsets


@triton.jit
def stream_tile(
    v_ptr, stride_vt, stride_vd,  # one source [T, D] (already offset to the source)
    taps_ptr, stride_ck, stride_cd,  # this source's taps of one stream [KMAX, D]
    kappa, offs_t64, pos_t, mask_t, offs_c, mask_c,
    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """The stream tile u [BLOCK_T, BLOCK_C] = sum_{delta < kappa} taps[delta] * v[t - delta], in fp32;
    `pos_t` is each token's position in its sequence (a tap reaching before it reads zero)."""
    u_TC = tl.zeros([BLOCK_T, BLOCK_C], tl.float32)
    for delta in range(0, kappa):
        tap_C = tl.load(taps_ptr + delta * stride_ck + offs_c * stride_cd, mask=mask_c, other=0.0).to(tl.float32)
        ok_t = mask_t & (pos_t >= delta)
        v_TC = tl.load(
            v_ptr + (offs_t64 - delta)[:, None] * stride_vt + offs_c[None, :] * stride_vd,
            mask=ok_t[:, None] & mask_c[None, :],
            other=0.0,
        ).to(tl.float32)
        u_TC += tap_C[None, :] * v_TC
    return u_TC


@triton.jit
def stream_scores(
    v_ptr, stride_vt, stride_vd, taps_ptr, stride_ck, stride_cd, kappa,
    offs_t64, pos_t, mask_t,
    q_ptr, stride_qs, stride_qd,  # this stream's queries [S, D]
    S, D, eps,
    BLOCK_S: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """scores [BLOCK_S, BLOCK_T] = q . RMSNorm(u) and rstd [BLOCK_T] of one source's stream, the
    stream convolved BLOCK_K channels at a time (any width d works)."""
    offs_s = tl.arange(0, BLOCK_S)
    mask_s = offs_s < S
    sumsq_T = tl.zeros([BLOCK_T], tl.float32)
    dots_ST = tl.zeros([BLOCK_S, BLOCK_T], tl.float32)
    for k0 in range(0, D, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < D
        u_TK = stream_tile(v_ptr, stride_vt, stride_vd, taps_ptr, stride_ck, stride_cd, kappa,
                           offs_t64, pos_t, mask_t, offs_k, mask_k, BLOCK_T, BLOCK_K)
        q_SK = tl.load(
            q_ptr + offs_s[:, None] * stride_qs + offs_k[None, :] * stride_qd,
            mask=mask_s[:, None] & mask_k[None, :],
            other=0.0,
        ).to(tl.float32)
        sumsq_T += tl.sum(u_TK * u_TK, axis=1)
        dots_ST += tl.sum(q_SK[:, None, :] * u_TK[None, :, :], axis=2)
    rstd_T = 1.0 / tl.sqrt(sumsq_T / D + eps)
    return dots_ST * rstd_T[None, :], rstd_T


@triton.jit
def _streams_fwd_kernel(
    v_ptr, stride_vn, stride_vt, stride_vd,  # sources [N, T, D] (any strides)
    taps_ptr, stride_cn, stride_cm, stride_ck, stride_cd,  # taps [N, M, KMAX, D]
    kappa_ptr,  # [M] int32 taps per stream (1 for the identity stream)
    q_ptr, stride_qm, stride_qs, stride_qd,  # queries [M, S, D]
    out_ptr, lse_ptr,  # out [M, S, T, D] contiguous, lse [M, S, T] fp32
    N, T, D, S, seq_len, eps, n_d_chunks,
    BLOCK_S: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_t, pid_d, offs_t64, mask_t, offs_d = tile_offsets(T, n_d_chunks, BLOCK_T, BLOCK_D)
    stream = tl.program_id(1).to(tl.int64)
    kappa = tl.load(kappa_ptr + stream)
    pos_t = offs_t64 % seq_len
    mask_d = offs_d < D
    offs_s = tl.arange(0, BLOCK_S)
    mask_ST = (offs_s < S)[:, None] & mask_t[None, :]
    q_base = q_ptr + stream * stride_qm

    max_ST = tl.full([BLOCK_S, BLOCK_T], float("-inf"), tl.float32)
    norm_ST = tl.zeros([BLOCK_S, BLOCK_T], tl.float32)
    acc_STD = tl.zeros([BLOCK_S, BLOCK_T, BLOCK_D], tl.float32)
    for i in range(N):
        src = tl.cast(i, tl.int64)
        v_base = v_ptr + src * stride_vn
        taps_base = taps_ptr + src * stride_cn + stream * stride_cm
        scores_ST, _ = stream_scores(
            v_base, stride_vt, stride_vd, taps_base, stride_ck, stride_cd, kappa, offs_t64, pos_t, mask_t,
            q_base, stride_qs, stride_qd, S, D, eps, BLOCK_S, BLOCK_T, BLOCK_K,
        )  # fmt: skip
        u_TD = stream_tile(v_base, stride_vt, stride_vd, taps_base, stride_ck, stride_cd, kappa,
                           offs_t64, pos_t, mask_t, offs_d, mask_d, BLOCK_T, BLOCK_D)
        new_max_ST = tl.maximum(max_ST, scores_ST)
        rescale_ST = tl.exp(max_ST - new_max_ST)  # exp(-inf) = 0 on the first source
        weight_ST = tl.exp(scores_ST - new_max_ST)
        norm_ST = norm_ST * rescale_ST + weight_ST
        acc_STD = acc_STD * rescale_ST[:, :, None] + weight_ST[:, :, None] * u_TD[None, :, :]
        max_ST = new_max_ST

    out_STD = acc_STD / norm_ST[:, :, None]
    out_offs = ((stream * S + offs_s[:, None, None]) * T + offs_t64[None, :, None]) * D + offs_d[None, None, :]
    tl.store(out_ptr + out_offs, out_STD.to(out_ptr.dtype.element_ty), mask=mask_ST[:, :, None] & mask_d[None, None, :])
    lse_ST = max_ST + tl.log(norm_ST)
    first_chunk_T = (tl.zeros([BLOCK_T], tl.int32) + pid_d) == 0  # every d-chunk has the LSE; one writes it
    lse_offs = (stream * S + offs_s[:, None]) * T + offs_t64[None, :]
    tl.store(lse_ptr + lse_offs, lse_ST, mask=mask_ST & first_chunk_T[None, :])


def kappa_tensor(kernel_sizes: list[int], device: torch.device) -> torch.Tensor:
    """Taps per stream, identity first: [1, kappa_1, ..., kappa_{m-1}] as int32 on `device`."""
    return torch.tensor([1, *kernel_sizes], dtype=torch.int32, device=device)


def stream_tiles(n_queries: int, n_tokens: int, width_d: int, tile_elems: int | None):
    """Forward tiles: the [S, T, d-chunk] accumulator plus the stream tile and the queries' chunk."""
    return pick_tiles(n_queries, n_tokens, width_d, width_d, tile_elems, row_tiles=1)


def streams_forward(sources_NTD, taps_NCKD, kernel_sizes, queries_MSD, seq_len, eps=1e-6, tile_elems=None):
    """sources [N, T, d] (T = B * seq_len tokens, whole sequences), taps [N, m - 1, kappa_max, d] of
    the conv streams (zero past each stream's kernel_sizes[s - 1]), queries [m, S, d] ->
    out [m, S, T, d] (the sources' dtype), lse [m, S, T] fp32."""
    check_device(sources_NTD)
    n_sources, n_tokens, width_d = sources_NTD.shape
    n_streams, n_queries, _ = queries_MSD.shape
    if n_tokens % seq_len:
        raise ValueError(f"{n_tokens} tokens are not whole sequences of {seq_len}")
    tiles = stream_tiles(n_queries, n_tokens, width_d, tile_elems)
    device = sources_NTD.device
    out_MSTD = new_buffer((n_streams, n_queries, n_tokens, width_d), sources_NTD.dtype, device)
    lse_MST = new_buffer((n_streams, n_queries, n_tokens), torch.float32, device)
    taps = with_identity(taps_NCKD)
    _streams_fwd_kernel[(tiles.n_t_tiles * tiles.n_d_chunks, n_streams)](
        sources_NTD, *sources_NTD.stride(), taps, *taps.stride(), kappa_tensor(kernel_sizes, device),
        queries_MSD, *queries_MSD.stride(), out_MSTD, lse_MST,
        n_sources, n_tokens, width_d, n_queries, seq_len, eps, tiles.n_d_chunks,
        BLOCK_S=tiles.block_s, BLOCK_T=tiles.block_t, BLOCK_D=tiles.block_d, BLOCK_K=tiles.block_k,
        **tiles.launch_options,
    )  # fmt: skip
    return out_MSTD, lse_MST


def with_identity(taps_NCKD: torch.Tensor) -> torch.Tensor:
    """The kernels' taps [N, m, kappa_max, d]: the identity stream's (tap 0 = 1) before the conv streams'."""
    identity = torch.zeros_like(taps_NCKD[:, :1])
    identity[:, :, 0] = 1
    return torch.cat([identity, taps_NCKD.detach()], dim=1)
