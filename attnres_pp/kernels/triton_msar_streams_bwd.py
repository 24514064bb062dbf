"""Triton fused MSAR phase 1, backward: gradients of `triton_msar_streams.streams_forward` for the
queries, the sources and the conv taps, deterministic (no atomics; per-group partials are summed on
the host in a fixed order).

The streams are recomputed from the sources on the fly in every pass, never stored. Four kernels:

A. per (token tile, d-chunk, stream): the scores and rstd of every source's stream (written by
   d-chunk 0) and per-chunk partial sums dp = dout . u; the host turns the small [m, N, S, T]
   tensors into score gradients ds and c = sum_S ds * s / d (as `triton_phase1` does).
B. per (token group, d-chunk, stream): the stream gradient
   du = sum_S p dout + rstd (sum_S ds q - rstd c u) (value path plus RMSNorm key path), written once
   as fp32 [m, N, T, d], and the group's query-gradient partial sum_t ds rstd u.
C. per (token tile, d-chunk, source): the source gradient dv[t] = sum_s sum_delta taps[s, delta]
   du[s, t + delta] (within t's sequence; the identity stream is tap 1 at delta 0).
D. per (token group, d-chunk, source and conv stream): the group's tap-gradient partial
   sum_t du[s, t] v[t - delta] for every delta at once.

The stream gradient is the one expanded tensor the backward writes: the source and tap gradients
read it at kappa shifts, and recomputing it per shift would redo the [S, T, d] products kappa times.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnres_pp.kernels.triton_common import check_device, new_buffer, pick_tiles, tile_offsets
from attnres_pp.kernels.triton_msar_streams import (
    kappa_tensor,
    stream_scores,
    stream_tile,
    stream_tiles,
    with_identity,
)

# Programs to aim for in the grouped passes (B, D): several waves on a 132-SM GPU, few partials.
STREAM_GRAD_PROGRAMS = 1024


@triton.jit
def _streams_dp_kernel(
    v_ptr, stride_vn, stride_vt, stride_vd, taps_ptr, stride_cn, stride_cm, stride_ck, stride_cd, kappa_ptr,
    q_ptr, stride_qm, stride_qs, stride_qd,
    dout_ptr, stride_om, stride_os, stride_ot, stride_od,  # dout [M, S, T, D] (any strides)
    scores_ptr, rstd_ptr,  # out (d-chunk 0): scores [M, N, S, T], rstd [M, N, T] fp32
    dp_part_ptr,  # out: [n_d_chunks, M, N, S, T] fp32
    N, T, D, S, M, seq_len, eps, n_d_chunks,
    BLOCK_S: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_t, pid_d, offs_t64, mask_t, offs_d = tile_offsets(T, n_d_chunks, BLOCK_T, BLOCK_D)
    stream = tl.program_id(1).to(tl.int64)
    kappa = tl.load(kappa_ptr + stream)
    pos_t = offs_t64 % seq_len
    mask_d = offs_d < D
    offs_s = tl.arange(0, BLOCK_S)
    mask_s = offs_s < S
    mask_ST = mask_s[:, None] & mask_t[None, :]
    st_offs = offs_s[:, None] * T + offs_t64[None, :]
    first_chunk_T = (tl.zeros([BLOCK_T], tl.int32) + pid_d) == 0  # a tensor mask, not a scalar
    dout_STD = tl.load(
        dout_ptr + stream * stride_om + offs_s[:, None, None] * stride_os + offs_t64[None, :, None] * stride_ot
        + offs_d[None, None, :] * stride_od,
        mask=mask_ST[:, :, None] & mask_d[None, None, :],
        other=0.0,
    ).to(tl.float32)
    for i in range(N):
        src = tl.cast(i, tl.int64)
        v_base = v_ptr + src * stride_vn
        taps_base = taps_ptr + src * stride_cn + stream * stride_cm
        scores_ST, rstd_T = stream_scores(
            v_base, stride_vt, stride_vd, taps_base, stride_ck, stride_cd, kappa, offs_t64, pos_t, mask_t,
            q_ptr + stream * stride_qm, stride_qs, stride_qd, S, D, eps, BLOCK_S, BLOCK_T, BLOCK_K,
        )  # fmt: skip
        row = stream * N + src
        tl.store(scores_ptr + row * S * T + st_offs, scores_ST, mask=mask_ST & first_chunk_T[None, :])
        tl.store(rstd_ptr + row * T + offs_t64, rstd_T, mask=mask_t & first_chunk_T)
        u_TD = stream_tile(v_base, stride_vt, stride_vd, taps_base, stride_ck, stride_cd, kappa,
                           offs_t64, pos_t, mask_t, offs_d, mask_d, BLOCK_T, BLOCK_D)
        dp_ST = tl.sum(dout_STD * u_TD[None, :, :], axis=2)
        tl.store(dp_part_ptr + (pid_d * M * N + row) * S * T + st_offs, dp_ST, mask=mask_ST)


@triton.jit
def _streams_du_kernel(
    v_ptr, stride_vn, stride_vt, stride_vd, taps_ptr, stride_cn, stride_cm, stride_ck, stride_cd, kappa_ptr,
    q_ptr, stride_qm, stride_qs, stride_qd,
    dout_ptr, stride_om, stride_os, stride_ot, stride_od,
    probs_ptr, ds_ptr, rstd_ptr, c_ptr,  # [M, N, S, T], [M, N, S, T], [M, N, T], [M, N, T] fp32 contiguous
    du_ptr,  # out: stream gradient [M, N, T, D] fp32
    dq_part_ptr,  # out: [n_groups, M, S, D] fp32
    N, T, D, S, M, seq_len, n_d_chunks, tiles_per_group,
    BLOCK_S: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    pid_g = pid // n_d_chunks
    offs_d = (pid % n_d_chunks) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    stream = tl.program_id(1).to(tl.int64)
    kappa = tl.load(kappa_ptr + stream)
    offs_s = tl.arange(0, BLOCK_S)
    mask_s = offs_s < S
    mask_SD = mask_s[:, None] & mask_d[None, :]
    q_SD = tl.load(
        q_ptr + stream * stride_qm + offs_s[:, None] * stride_qs + offs_d[None, :] * stride_qd, mask=mask_SD, other=0.0
    ).to(tl.float32)
    dq_SD = tl.zeros([BLOCK_S, BLOCK_D], tl.float32)
    t_start = pid_g * tiles_per_group * BLOCK_T
    t_end = tl.minimum(t_start + tiles_per_group * BLOCK_T, T)
    for t0 in range(t_start, t_end, BLOCK_T):
        offs_t64 = (t0 + tl.arange(0, BLOCK_T)).to(tl.int64)
        mask_t = offs_t64 < T
        pos_t = offs_t64 % seq_len
        mask_TD = mask_t[:, None] & mask_d[None, :]
        mask_ST = mask_s[:, None] & mask_t[None, :]
        dout_STD = tl.load(
            dout_ptr + stream * stride_om + offs_s[:, None, None] * stride_os + offs_t64[None, :, None] * stride_ot
            + offs_d[None, None, :] * stride_od,
            mask=mask_s[:, None, None] & mask_TD[None, :, :],
            other=0.0,
        ).to(tl.float32)
        for i in range(N):
            src = tl.cast(i, tl.int64)
            row = stream * N + src
            u_TD = stream_tile(v_ptr + src * stride_vn, stride_vt, stride_vd,
                               taps_ptr + src * stride_cn + stream * stride_cm, stride_ck, stride_cd, kappa,
                               offs_t64, pos_t, mask_t, offs_d, mask_d, BLOCK_T, BLOCK_D)
            st_offs = row * S * T + offs_s[:, None] * T + offs_t64[None, :]
            # Padded queries and tokens load p = ds = 0, so they add nothing to either gradient.
            probs_ST = tl.load(probs_ptr + st_offs, mask=mask_ST, other=0.0)
            ds_ST = tl.load(ds_ptr + st_offs, mask=mask_ST, other=0.0)
            rstd_T = tl.load(rstd_ptr + row * T + offs_t64, mask=mask_t, other=0.0)
            c_T = tl.load(c_ptr + row * T + offs_t64, mask=mask_t, other=0.0)
            dkhat_TD = tl.sum(ds_ST[:, :, None] * q_SD[:, None, :], axis=0)
            du_TD = tl.sum(probs_ST[:, :, None] * dout_STD, axis=0)
            du_TD += rstd_T[:, None] * (dkhat_TD - u_TD * (rstd_T * c_T)[:, None])
            tl.store(du_ptr + (row * T + offs_t64[:, None]) * D + offs_d[None, :], du_TD, mask=mask_TD)
            dq_SD += tl.sum((ds_ST * rstd_T[None, :])[:, :, None] * u_TD[None, :, :], axis=1)
    part_offs = ((tl.cast(pid_g, tl.int64) * M + stream) * S + offs_s[:, None]) * D + offs_d[None, :]
    tl.store(dq_part_ptr + part_offs, dq_SD, mask=mask_SD)


@triton.jit
def _streams_dv_kernel(
    du_ptr,  # [M, N, T, D] fp32 contiguous
    taps_ptr, stride_cn, stride_cm, stride_ck, stride_cd, kappa_ptr,
    dv_ptr,  # out: [N, T, D] contiguous, the sources' dtype
    N, T, D, M, seq_len, n_d_chunks,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    pid_t, pid_d, offs_t64, mask_t, offs_d = tile_offsets(T, n_d_chunks, BLOCK_T, BLOCK_D)
    src = tl.program_id(1).to(tl.int64)
    pos_t = offs_t64 % seq_len
    mask_d = offs_d < D
    dv_TD = tl.zeros([BLOCK_T, BLOCK_D], tl.float32)
    for s in range(M):
        stream = tl.cast(s, tl.int64)
        kappa = tl.load(kappa_ptr + stream)
        taps_base = taps_ptr + src * stride_cn + stream * stride_cm
        du_base = du_ptr + (stream * N + src) * T * D
        for delta in range(0, kappa):
            tap_D = tl.load(taps_base + delta * stride_ck + offs_d * stride_cd, mask=mask_d, other=0.0).to(tl.float32)
            ok_t = mask_t & (pos_t + delta < seq_len)  # t + delta still in t's sequence
            du_TD = tl.load(du_base + (offs_t64 + delta)[:, None] * D + offs_d[None, :],
                            mask=ok_t[:, None] & mask_d[None, :], other=0.0)
            dv_TD += tap_D[None, :] * du_TD
    tl.store(dv_ptr + (src * T + offs_t64[:, None]) * D + offs_d[None, :], dv_TD.to(dv_ptr.dtype.element_ty),
             mask=mask_t[:, None] & mask_d[None, :])


@triton.jit
def _streams_dtaps_kernel(
    du_ptr,  # [M, N, T, D] fp32 contiguous
    v_ptr, stride_vn, stride_vt, stride_vd, kappa_ptr,
    dtaps_part_ptr,  # out: [n_groups, N, M - 1, KMAX, D] fp32
    N, T, D, M, KMAX, seq_len, n_d_chunks, tiles_per_group,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_KAPPA: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    pid_g = pid // n_d_chunks
    offs_d = (pid % n_d_chunks) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    src = (tl.program_id(1) // (M - 1)).to(tl.int64)
    conv = (tl.program_id(1) % (M - 1)).to(tl.int64)  # conv stream conv + 1
    kappa = tl.load(kappa_ptr + conv + 1)
    du_base = du_ptr + ((conv + 1) * N + src) * T * D
    offs_kappa = tl.arange(0, BLOCK_KAPPA)
    # Every delta's sum in one [KAPPA, D] accumulator, so each du tile is read once.
    dtaps_KD = tl.zeros([BLOCK_KAPPA, BLOCK_D], tl.float32)
    t_start = pid_g * tiles_per_group * BLOCK_T
    t_end = tl.minimum(t_start + tiles_per_group * BLOCK_T, T)
    for t0 in range(t_start, t_end, BLOCK_T):
        offs_t64 = (t0 + tl.arange(0, BLOCK_T)).to(tl.int64)
        mask_t = offs_t64 < T
        pos_t = offs_t64 % seq_len
        du_TD = tl.load(du_base + offs_t64[:, None] * D + offs_d[None, :],
                        mask=mask_t[:, None] & mask_d[None, :], other=0.0)
        for delta in range(0, kappa):  # taps past kappa are not used: their gradient stays zero
            ok_t = mask_t & (pos_t >= delta)
            v_TD = tl.load(
                v_ptr + src * stride_vn + (offs_t64 - delta)[:, None] * stride_vt + offs_d[None, :] * stride_vd,
                mask=ok_t[:, None] & mask_d[None, :],
                other=0.0,
            ).to(tl.float32)
            dtap_D = tl.sum(du_TD * v_TD, axis=0)
            dtaps_KD += tl.where((offs_kappa == delta)[:, None], dtap_D[None, :], 0.0)
    part_offs = (((tl.cast(pid_g, tl.int64) * N + src) * (M - 1) + conv) * KMAX + offs_kappa[:, None]) * D
    tl.store(dtaps_part_ptr + part_offs + offs_d[None, :], dtaps_KD,
             mask=(offs_kappa < KMAX)[:, None] & mask_d[None, :])


def _groups(n_t_tiles: int, programs_per_group: int) -> tuple[int, int]:
    """(n_groups, tiles_per_group) for a grouped pass with `programs_per_group` programs per group."""
    n_groups = max(1, min(n_t_tiles, STREAM_GRAD_PROGRAMS // programs_per_group))
    tiles_per_group = triton.cdiv(n_t_tiles, n_groups)
    return triton.cdiv(n_t_tiles, tiles_per_group), tiles_per_group


def streams_backward(sources_NTD, taps_NCKD, kernel_sizes, queries_MSD, seq_len, lse_MST, dout_MSTD, dlse_MST,
                     eps=1e-6, tile_elems=None):
    """Gradients of `streams_forward`: (dsources [N, T, d], dtaps [N, m - 1, kappa_max, d],
    dqueries [m, S, d]), each in its input's dtype. dout / dlse may be None (zero)."""
    check_device(sources_NTD)
    n_sources, n_tokens, width_d = sources_NTD.shape
    n_streams, n_queries, _ = queries_MSD.shape
    kappa_max = taps_NCKD.shape[2]
    device = sources_NTD.device
    if dout_MSTD is None:  # a stride-0 zero: the kernels take any strides
        dout_MSTD = sources_NTD.new_zeros(()).expand(n_streams, n_queries, n_tokens, width_d)
    taps = with_identity(taps_NCKD)
    kappas = kappa_tensor(kernel_sizes, device)
    common = (sources_NTD, *sources_NTD.stride(), taps, *taps.stride(), kappas, queries_MSD, *queries_MSD.stride(),
              dout_MSTD, *dout_MSTD.stride())

    tiles = stream_tiles(n_queries, n_tokens, width_d, tile_elems)
    scores_MNST = new_buffer((n_streams, n_sources, n_queries, n_tokens), torch.float32, device)
    rstd_MNT = new_buffer((n_streams, n_sources, n_tokens), torch.float32, device)
    dp_part = new_buffer((tiles.n_d_chunks, n_streams, n_sources, n_queries, n_tokens), torch.float32, device)
    _streams_dp_kernel[(tiles.n_t_tiles * tiles.n_d_chunks, n_streams)](
        *common, scores_MNST, rstd_MNT, dp_part,
        n_sources, n_tokens, width_d, n_queries, n_streams, seq_len, eps, tiles.n_d_chunks,
        BLOCK_S=tiles.block_s, BLOCK_T=tiles.block_t, BLOCK_D=tiles.block_d, BLOCK_K=tiles.block_k,
        **tiles.launch_options,
    )  # fmt: skip

    # Small [m, N, S, T] algebra: softmax backward plus the LSE path, ds = p * (dp - sum_j p_j dp_j + dlse).
    probs_MNST = torch.exp(scores_MNST - lse_MST.float().unsqueeze(1))
    dp_MNST = dp_part.sum(dim=0)
    delta_MST = (probs_MNST * dp_MNST).sum(dim=1)
    dlse = 0.0 if dlse_MST is None else dlse_MST.float().unsqueeze(1)
    ds_MNST = probs_MNST * (dp_MNST - delta_MST.unsqueeze(1) + dlse)
    c_MNT = (ds_MNST * scores_MNST).sum(dim=2) / width_d

    # Live in B: dout and the products [S, T, C], q and dq [S, C], the stream and its gradient [T, C].
    tiles = pick_tiles(n_queries, n_tokens, width_d, width_d, tile_elems, row_tiles=2, query_tiles=2)
    n_groups, tiles_per_group = _groups(tiles.n_t_tiles, tiles.n_d_chunks * n_streams)
    du_MNTD = new_buffer((n_streams, n_sources, n_tokens, width_d), torch.float32, device)
    dq_part = new_buffer((n_groups, n_streams, n_queries, width_d), torch.float32, device)
    _streams_du_kernel[(n_groups * tiles.n_d_chunks, n_streams)](
        *common, probs_MNST, ds_MNST, rstd_MNT, c_MNT, du_MNTD, dq_part,
        n_sources, n_tokens, width_d, n_queries, n_streams, seq_len, tiles.n_d_chunks, tiles_per_group,
        BLOCK_S=tiles.block_s, BLOCK_T=tiles.block_t, BLOCK_D=tiles.block_d, **tiles.launch_options,
    )  # fmt: skip

    tiles = pick_tiles(1, n_tokens, width_d, width_d, tile_elems, row_tiles=2)
    dsources_NTD = new_buffer(sources_NTD.shape, sources_NTD.dtype, device)
    _streams_dv_kernel[(tiles.n_t_tiles * tiles.n_d_chunks, n_sources)](
        du_MNTD, taps, *taps.stride(), kappas, dsources_NTD,
        n_sources, n_tokens, width_d, n_streams, seq_len, tiles.n_d_chunks,
        BLOCK_T=tiles.block_t, BLOCK_D=tiles.block_d, **tiles.launch_options,
    )  # fmt: skip

    n_conv = n_streams - 1
    if n_conv == 0:  # no conv streams: no taps to differentiate
        return dsources_NTD, taps_NCKD.new_zeros(taps_NCKD.shape), dq_part.sum(dim=0).to(queries_MSD.dtype)
    block_kappa = triton.next_power_of_2(kappa_max)
    tiles = pick_tiles(1, n_tokens, width_d, width_d, tile_elems, row_tiles=2, query_tiles=block_kappa)
    n_groups, tiles_per_group = _groups(tiles.n_t_tiles, tiles.n_d_chunks * n_sources * n_conv)
    dtaps_part = new_buffer((n_groups, n_sources, n_conv, kappa_max, width_d), torch.float32, device)
    _streams_dtaps_kernel[(n_groups * tiles.n_d_chunks, n_sources * n_conv)](
        du_MNTD, sources_NTD, *sources_NTD.stride(), kappas, dtaps_part,
        n_sources, n_tokens, width_d, n_streams, kappa_max, seq_len, tiles.n_d_chunks, tiles_per_group,
        BLOCK_T=tiles.block_t, BLOCK_D=tiles.block_d, BLOCK_KAPPA=block_kappa, **tiles.launch_options,
    )  # fmt: skip
    return (dsources_NTD, dtaps_part.sum(dim=0).to(taps_NCKD.dtype), dq_part.sum(dim=0).to(queries_MSD.dtype))
