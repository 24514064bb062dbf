"""Pure-torch depth-attention ops (docs/spec.md section 2): the slow twin of every fast kernel.

Differentiable through ordinary autograd. All math runs in float32 (or float64 when given float64),
outputs come back in the input dtype and the log-sum-exp in float32 (float64 for float64 inputs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _math_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last axis with no gain (the depth-attention key norm): x / sqrt(mean(x^2) + eps).

    One fused op rather than five: on CPU at small widths these reads are dispatch-bound.
    """
    return F.rms_norm(x, (x.shape[-1],), eps=eps)


def phase1_torch(
    values_NTD: torch.Tensor,
    queries_SK: torch.Tensor,
    keys_NTK: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Read N completed sources with S queries at once.

    values [N, T, d]; queries [S, k]; keys [N, T, k] or None (keys = values, k = d).
    Returns out [S, T, d] = sum_i softmax_i(q . RMSNorm(key_i)) v_i and lse [S, T].
    """
    with torch.autocast(values_NTD.device.type, enabled=False):  # fp32 math, as the Triton kernels
        return _phase1(values_NTD, queries_SK, keys_NTK, eps)


def _phase1(values_NTD, queries_SK, keys_NTK, eps):
    math = _math_dtype(values_NTD.dtype)
    k = values_NTD if keys_NTK is None else keys_NTK
    return _phase1_normalized(values_NTD, queries_SK, rms_normalize(k.to(math), eps))


def phase1_normalized_torch(values_NTD: torch.Tensor, queries_SK: torch.Tensor,
                            khat_NTK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`phase1_torch` with the keys already RMS-normalised (`khat = RMSNorm(key)`, computed once per
    source by the caller rather than once per read): the same out [S, T, d] and lse [S, T]."""
    with torch.autocast(values_NTD.device.type, enabled=False):
        return _phase1_normalized(values_NTD, queries_SK, khat_NTK)


def _phase1_normalized(values_NTD, queries_SK, khat_NTK):
    math = _math_dtype(values_NTD.dtype)
    v = values_NTD.to(math)
    # Plain matmul / bmm rather than einsum: at small shapes einsum's layout planning costs more
    # than the arithmetic (2x on CPU for N=5, T=256, d=128).
    scores_TSN = (khat_NTK.to(math) @ queries_SK.to(math).t()).permute(1, 2, 0)
    lse_TS = torch.logsumexp(scores_TSN, dim=-1)
    probs_TSN = torch.exp(scores_TSN - lse_TS.unsqueeze(-1))  # the softmax, reusing the lse
    out_TSD = torch.bmm(probs_TSN, v.transpose(0, 1))
    return out_TSD.transpose(0, 1).to(values_NTD.dtype), lse_TS.t()


def phase1_streams_torch(values_MNTD: torch.Tensor, queries_MSD: torch.Tensor, khat_MNTD: torch.Tensor,
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Phase 1 of MSAR for all m streams at once (the slow twin of the fused stream kernel).

    values [m, N, T, d] (stream s of source i), queries [m, S, d], khat = RMSNorm(values) [m, N, T, d].
    Returns out [m, S, T, d] = sum_i softmax_i(q_s . khat_{s,i}) v_{s,i} and lse [m, S, T]: stream s
    equals `phase1_torch(values[s], queries[s])`.
    """
    with torch.autocast(values_MNTD.device.type, enabled=False):
        math = _math_dtype(values_MNTD.dtype)
        m, n, t, d = values_MNTD.shape
        # One bmm for every stream's scores: [m, N*T, d] @ [m, d, S] (the source prefix is contiguous).
        scores_MNTS = torch.bmm(khat_MNTD.to(math).reshape(m, n * t, d),
                                queries_MSD.to(math).transpose(1, 2)).view(m, n, t, -1)
        lse_MTS = torch.logsumexp(scores_MNTS, dim=1)
        probs_MNTS = torch.exp(scores_MNTS - lse_MTS.unsqueeze(1))
        # unbind, not per-stream indexing: each index's backward would fill a zero gradient of all m streams.
        out_MSTD = torch.stack([torch.bmm(p_NTS.permute(1, 2, 0), v_NTD.transpose(0, 1)).transpose(0, 1)
                                for p_NTS, v_NTD in zip(probs_MNTS.unbind(0), values_MNTD.to(math).unbind(0),
                                                        strict=True)])
        return out_MSTD.to(values_MNTD.dtype), lse_MTS.transpose(1, 2)


def conv_streams_torch(sources_NTD: torch.Tensor, taps_NCKD: torch.Tensor, seq_len: int) -> torch.Tensor:
    """MSAR streams [m, N, T, d] of N sources [N, T, d] (T = whole sequences of seq_len): stream 0 is
    the source, stream s >= 1 `sum_delta taps[:, s-1, delta] * v[t - delta]` (v = 0 before a
    sequence starts), all in one grouped conv1d."""
    n, t, d = sources_NTD.shape
    n_conv, kappa = taps_NCKD.shape[1], taps_NCKD.shape[2]
    x_BCS = sources_NTD.reshape(n, t // seq_len, seq_len, d).permute(1, 0, 3, 2).reshape(-1, n * d, seq_len)
    # Output channel (source, channel, stream); conv1d correlates, so the taps are flipped.
    weight = taps_NCKD.permute(0, 3, 1, 2).flip(-1).reshape(n * d * n_conv, 1, kappa).to(sources_NTD.dtype)
    y = F.conv1d(F.pad(x_BCS, (kappa - 1, 0)), weight, groups=n * d)
    y_CNTD = y.view(-1, n, d, n_conv, seq_len).permute(3, 1, 0, 4, 2).reshape(n_conv, n, t, d)
    return torch.cat([sources_NTD.unsqueeze(0), y_CNTD])


def phase1_conv_streams_torch(sources_NTD: torch.Tensor, taps_NCKD: torch.Tensor, kernel_sizes: list[int],
                              queries_MSD: torch.Tensor, seq_len: int, eps: float = 1e-6,
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The slow twin of the fused MSAR stream kernel (`triton_ops.phase1_streams`): the streams
    (`conv_streams_torch`, stream s using its first kernel_sizes[s-1] taps) written out, then
    `phase1_streams_torch`. out [m, S, T, d], lse [m, S, T]."""
    with torch.autocast(sources_NTD.device.type, enabled=False):
        used_CK = torch.arange(taps_NCKD.shape[2], device=taps_NCKD.device) < torch.tensor(
            kernel_sizes, device=taps_NCKD.device).unsqueeze(1)  # taps past a kernel size are not used
        streams_MNTD = conv_streams_torch(sources_NTD, taps_NCKD * used_CK.unsqueeze(-1), seq_len)
        khat = rms_normalize(streams_MNTD.to(_math_dtype(sources_NTD.dtype)), eps)
        return phase1_streams_torch(streams_MNTD, queries_MSD, khat)


def phase2_streams_torch(out1_MTD: torch.Tensor, lse1_MT: torch.Tensor, partial_MTD: torch.Tensor,
                         query_MD: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Phase 2 of MSAR for all m streams at once: stream s equals `phase2_torch(out1[s], lse1[s],
    partial[s], query[s])`; returns h [m, T, d]."""
    with torch.autocast(partial_MTD.device.type, enabled=False):
        math = _math_dtype(partial_MTD.dtype)
        p = partial_MTD.to(math)
        # A multiply-and-sum, not a bmm against a [m, d, 1] query: matrix-vector bmms and their
        # backward are 4x slower on CPU at these sizes.
        score_MT = torch.linalg.vecdot(rms_normalize(p, eps), query_MD.to(math).unsqueeze(1))
        gate_MT1 = torch.sigmoid(score_MT - lse1_MT.to(math)).unsqueeze(-1)
        return torch.lerp(out1_MTD.to(math), p, gate_MT1).to(partial_MTD.dtype)


def phase2_torch(
    out1_TD: torch.Tensor,
    lse1_T: torch.Tensor,
    partial_TD: torch.Tensor,
    query_K: torch.Tensor,
    partial_key_TK: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Merge the phase-1 read with the open partial: h = o1 + sigmoid(s_p - lse1) * (p - o1)."""
    with torch.autocast(partial_TD.device.type, enabled=False):  # fp32 math, as the Triton kernels
        return _phase2(out1_TD, lse1_T, partial_TD, query_K, partial_key_TK, eps)


def _phase2(out1_TD, lse1_T, partial_TD, query_K, partial_key_TK, eps):
    math = _math_dtype(partial_TD.dtype)
    p = partial_TD.to(math)
    k = p if partial_key_TK is None else partial_key_TK.to(math)
    score_T = rms_normalize(k, eps) @ query_K.to(math)
    gate_T1 = torch.sigmoid(score_T - lse1_T.to(math)).unsqueeze(-1)
    return torch.lerp(out1_TD.to(math), p, gate_T1).to(partial_TD.dtype)  # o1 + gate (p - o1)
