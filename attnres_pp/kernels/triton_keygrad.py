"""The Triton key-gradient kernel shared by phase 1 and phase 2 backward passes.

Given the score gradients ds [N, S, T] of s = q . RMSNorm(key), it writes the key gradients and
partial sums of the query gradient, one per group of consecutive token tiles (each program walks
its group's tiles in order and the groups are summed afterwards in a fixed order: no atomics, and
the query gradient is bitwise reproducible). Grouping keeps the partials small ([groups, S, K]
rather than [token tiles, S, K], which at T = 16k and one-token tiles is as big as the values) and
loads the queries once per program. With ADD_VALUE_GRAD (keys are the
values themselves) it also adds the value path sum_s p[s] * dout[s] into the same gradient, so the
value gradient is written once instead of read-modified-written.

RMSNorm without gain, k_hat = key * rstd: dkey = rstd * (dk_hat - k_hat * mean(dk_hat * k_hat)),
with dk_hat = sum_s ds[s] q[s]; and mean(dk_hat * k_hat) = sum_s ds[s] * s[s] / K, which the host
passes precomputed as c [N, T] (no second sweep over the key row).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnres_pp.kernels.triton_common import new_buffer, pick_tiles

# Programs to aim for (token groups x key chunks): several waves on a 132-SM GPU, few partials.
KEY_GRAD_PROGRAMS = 1024


@triton.jit
def _key_grad_kernel(
    key_ptr, stride_kn, stride_kt, stride_kk,  # keys [N, T, K] (any strides)
    dkey_ptr, stride_gn, stride_gt, stride_gk,  # out: key gradient [N, T, K]
    q_ptr, stride_qs, stride_qk,  # queries [S, K]
    rstd_ptr, ds_ptr, c_ptr,  # rstd [N, T], ds [N, S, T], c [N, T]: contiguous fp32
    probs_ptr, dout_ptr, stride_os, stride_ot, stride_ok,  # ADD_VALUE_GRAD: probs [N, S, T], dout [S, T, K]
    dq_part_ptr,  # out: [n_groups, S, K] fp32
    N, T, S, K, n_k_chunks, tiles_per_group,
    ADD_VALUE_GRAD: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    # Chunk index fastest, so the programs sharing a token group run side by side.
    pid = tl.program_id(0)
    pid_g = pid // n_k_chunks
    offs_c = (pid % n_k_chunks) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_c = offs_c < K
    offs_s = tl.arange(0, BLOCK_S)
    mask_s = offs_s < S
    mask_SC = mask_s[:, None] & mask_c[None, :]

    q_SC = tl.load(
        q_ptr + offs_s[:, None] * stride_qs + offs_c[None, :] * stride_qk, mask=mask_SC, other=0.0
    ).to(tl.float32)
    dq_SC = tl.zeros([BLOCK_S, BLOCK_C], tl.float32)
    t_start = pid_g * tiles_per_group * BLOCK_T
    t_end = tl.minimum(t_start + tiles_per_group * BLOCK_T, T)
    for t0 in range(t_start, t_end, BLOCK_T):
        offs_t64 = (t0 + tl.arange(0, BLOCK_T)).to(tl.int64)
        mask_t = offs_t64 < T
        mask_TC = mask_t[:, None] & mask_c[None, :]
        mask_ST = mask_s[:, None] & mask_t[None, :]
        if ADD_VALUE_GRAD:
            dout_STC = tl.load(
                dout_ptr
                + offs_s[:, None, None] * stride_os
                + offs_t64[None, :, None] * stride_ot
                + offs_c[None, None, :] * stride_ok,
                mask=mask_s[:, None, None] & mask_TC[None, :, :],
                other=0.0,
            ).to(tl.float32)
        for i in range(N):
            src = tl.cast(i, tl.int64)
            key_TC = tl.load(
                key_ptr + src * stride_kn + offs_t64[:, None] * stride_kt + offs_c[None, :] * stride_kk,
                mask=mask_TC,
                other=0.0,
            ).to(tl.float32)
            rstd_T = tl.load(rstd_ptr + src * T + offs_t64, mask=mask_t, other=0.0).to(tl.float32)
            c_T = tl.load(c_ptr + src * T + offs_t64, mask=mask_t, other=0.0).to(tl.float32)
            st_offs = src * S * T + offs_s[:, None] * T + offs_t64[None, :]
            # Padded queries and tokens load ds = 0, so they add nothing to either gradient.
            ds_ST = tl.load(ds_ptr + st_offs, mask=mask_ST, other=0.0).to(tl.float32)
            khat_TC = key_TC * rstd_T[:, None]
            dkhat_TC = tl.sum(ds_ST[:, :, None] * q_SC[:, None, :], axis=0)
            dkey_TC = rstd_T[:, None] * (dkhat_TC - khat_TC * c_T[:, None])
            if ADD_VALUE_GRAD:
                probs_ST = tl.load(probs_ptr + st_offs, mask=mask_ST, other=0.0).to(tl.float32)
                dkey_TC += tl.sum(probs_ST[:, :, None] * dout_STC, axis=0)
            tl.store(
                dkey_ptr + src * stride_gn + offs_t64[:, None] * stride_gt + offs_c[None, :] * stride_gk,
                dkey_TC.to(dkey_ptr.dtype.element_ty),
                mask=mask_TC,
            )
            dq_SC += tl.sum(ds_ST[:, :, None] * khat_TC[None, :, :], axis=1)
    part_offs = (tl.cast(pid_g, tl.int64) * S + offs_s[:, None]) * K + offs_c[None, :]
    tl.store(dq_part_ptr + part_offs, dq_SC, mask=mask_SC)


def key_grads(
    keys_NTK: torch.Tensor,
    rstd_NT: torch.Tensor,
    ds_NST: torch.Tensor,
    c_NT: torch.Tensor,
    queries_SK: torch.Tensor,
    dkeys_NTK: torch.Tensor,
    probs_NST: torch.Tensor | None = None,
    dout_STK: torch.Tensor | None = None,
    tile_elems: int | None = None,
) -> torch.Tensor:
    """Write the key gradient into `dkeys_NTK` (plus sum_s probs * dout when those are given) and
    return the query gradient [S, K] in fp32, summed over token groups in a fixed order."""
    n_sources, n_tokens, width_k = keys_NTK.shape
    n_queries = queries_SK.shape[0]
    # Live per program: dout and the products [S, T, C] (counted once), q and dq [S, C], and the
    # key, normalised key and key-gradient rows [T, C].
    tiles = pick_tiles(n_queries, n_tokens, width_k, width_k, tile_elems, row_tiles=3, query_tiles=2)
    n_groups = max(1, min(tiles.n_t_tiles, KEY_GRAD_PROGRAMS // tiles.n_d_chunks))
    tiles_per_group = triton.cdiv(tiles.n_t_tiles, n_groups)
    n_groups = triton.cdiv(tiles.n_t_tiles, tiles_per_group)
    dq_part = new_buffer((n_groups, n_queries, width_k), torch.float32, keys_NTK.device)
    add_value_grad = probs_NST is not None
    if add_value_grad:
        dout_strides = dout_STK.stride()
    else:  # never read: the ADD_VALUE_GRAD branch is compiled out
        probs_NST, dout_STK, dout_strides = ds_NST, ds_NST, (0, 0, 0)
    grid = (n_groups * tiles.n_d_chunks,)
    _key_grad_kernel[grid](
        keys_NTK, *keys_NTK.stride(),
        dkeys_NTK, *dkeys_NTK.stride(),
        queries_SK, *queries_SK.stride(),
        rstd_NT.contiguous(), ds_NST.contiguous(), c_NT.contiguous(),
        probs_NST.contiguous(), dout_STK, *dout_strides,
        dq_part,
        n_sources, n_tokens, n_queries, width_k, tiles.n_d_chunks, tiles_per_group,
        ADD_VALUE_GRAD=add_value_grad,
        BLOCK_S=tiles.block_s, BLOCK_T=tiles.block_t, BLOCK_C=tiles.block_d,
        **tiles.launch_options,
    )  # fmt: skip
    return dq_part.sum(dim=0)
