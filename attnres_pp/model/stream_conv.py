"""MSAR's causal depthwise stream convolutions as one autograd function, and its slow twin.

Stream s of N sources v [N, B, T, d] is sum over delta < kappa_s of taps[:, s, delta] * v[t - delta]
(v[t < 0] from the zero-padded or halo-extended `padded` [N, B, T + kappa_max - 1, d]).

`shifted_streams` computes exactly the twin's multiply-adds, in the same order, but in place into one
preallocated [m, N, B, T, d] output (one multiply-add per shift for every stream that uses it,
instead of one per stream and shift, and no stack of the streams), and writes its backward by hand:
the twin's autograd graph fills a zero gradient of the whole padded tensor for every shift of every
stream (a slice's backward) and sums them, where this backward accumulates every shift into one
gradient in place. It saves what the twin's graph saves (v, the padded tensor and the taps), so a
pass's saved bytes are the same either way.
"""

from __future__ import annotations

import torch


def _shift_groups(kernel_sizes: tuple[int, ...], reach: int) -> list[tuple[int, list[int]]]:
    """(delta, the streams (0-based among the conv streams) that use tap delta), delta >= 1: taps
    past a stream's kernel size are unused, and taps at delta >= reach meet only zeros."""
    return [(delta, [s for s, kappa in enumerate(kernel_sizes) if delta < kappa])
            for delta in range(1, min(max(kernel_sizes), reach))]


def _runs(streams: list[int]) -> list[tuple[int, int]]:
    """Consecutive runs [a, b) of sorted stream indices (one in-place op per run)."""
    runs: list[tuple[int, int]] = []
    for s in streams:
        if runs and runs[-1][1] == s:
            runs[-1] = (runs[-1][0], s + 1)
        else:
            runs.append((s, s + 1))
    return runs


class _ShiftedStreams(torch.autograd.Function):
    @staticmethod
    def forward(ctx, v_NBTD: torch.Tensor, padded_NBPD: torch.Tensor, taps_NSKD: torch.Tensor,
                kernel_sizes: tuple[int, ...], reach: int) -> torch.Tensor:
        math = torch.promote_types(v_NBTD.dtype, taps_NSKD.dtype)
        n_conv, seq, kappa_max = len(kernel_sizes), v_NBTD.shape[2], taps_NSKD.shape[2]
        out_MNBTD = torch.empty((n_conv + 1, *v_NBTD.shape), dtype=v_NBTD.dtype, device=v_NBTD.device)
        out_MNBTD[0].copy_(v_NBTD)
        in_place = math == v_NBTD.dtype  # else the multiply-adds run in the wider dtype, then are cast
        conv_SNBTD = out_MNBTD[1:] if in_place else torch.empty((n_conv, *v_NBTD.shape), dtype=math,
                                                                device=v_NBTD.device)
        taps_SKN11D = taps_NSKD.permute(1, 2, 0, 3)[:, :, :, None, None]  # tap (s, delta) over [N, B, T, d]
        torch.mul(v_NBTD.unsqueeze(0), taps_SKN11D[:, 0], out=conv_SNBTD)
        for delta, streams in _shift_groups(kernel_sizes, reach):
            shifted_NBTD = padded_NBPD[:, :, kappa_max - 1 - delta: kappa_max - 1 - delta + seq]
            for a, b in _runs(streams):
                conv_SNBTD[a:b].addcmul_(shifted_NBTD.unsqueeze(0), taps_SKN11D[a:b, delta])
        if not in_place:
            out_MNBTD[1:].copy_(conv_SNBTD)
        ctx.save_for_backward(v_NBTD, padded_NBPD, taps_NSKD)
        ctx.kernel_sizes, ctx.reach = kernel_sizes, reach
        return out_MNBTD

    @staticmethod
    def backward(ctx, grad_MNBTD: torch.Tensor):
        v_NBTD, padded_NBPD, taps_NSKD = ctx.saved_tensors
        kernel_sizes, reach = ctx.kernel_sizes, ctx.reach
        math = torch.promote_types(v_NBTD.dtype, taps_NSKD.dtype)
        seq, kappa_max = v_NBTD.shape[2], taps_NSKD.shape[2]
        g_SNBTD = grad_MNBTD[1:].to(math)
        taps_SKN11D = taps_NSKD.permute(1, 2, 0, 3)[:, :, :, None, None]
        grad_v = grad_v_NBTD = grad_padded = grad_taps = None
        if ctx.needs_input_grad[0]:
            grad_v_NBTD = grad_MNBTD[0].to(math, copy=True)
            for s in range(len(kernel_sizes)):
                grad_v_NBTD.addcmul_(g_SNBTD[s], taps_SKN11D[s, 0])
            grad_v = grad_v_NBTD.to(v_NBTD.dtype)
        if ctx.needs_input_grad[1]:
            grad_padded = torch.zeros(padded_NBPD.shape, dtype=math, device=padded_NBPD.device)
            for delta, streams in _shift_groups(kernel_sizes, reach):
                rows = grad_padded[:, :, kappa_max - 1 - delta: kappa_max - 1 - delta + seq]
                for s in streams:
                    rows.addcmul_(g_SNBTD[s], taps_SKN11D[s, delta])
            grad_padded = grad_padded.to(padded_NBPD.dtype)
        if ctx.needs_input_grad[2]:
            grad_taps = torch.zeros(taps_NSKD.shape, dtype=math, device=taps_NSKD.device)
            grad_taps[:, :, 0] = (g_SNBTD * v_NBTD.unsqueeze(0)).sum(dim=(2, 3)).transpose(0, 1)
            for delta, streams in _shift_groups(kernel_sizes, reach):
                shifted_NBTD = padded_NBPD[:, :, kappa_max - 1 - delta: kappa_max - 1 - delta + seq]
                for a, b in _runs(streams):
                    products_SNBTD = g_SNBTD[a:b] * shifted_NBTD.unsqueeze(0)
                    grad_taps[:, a:b, delta] = products_SNBTD.sum(dim=(2, 3)).transpose(0, 1)
            grad_taps = grad_taps.to(taps_NSKD.dtype)
        return grad_v, grad_padded, grad_taps, None, None


def shifted_streams(v_NBTD: torch.Tensor, padded_NBPD: torch.Tensor, taps_NSKD: torch.Tensor,
                    kernel_sizes: tuple[int, ...], reach: int) -> torch.Tensor:
    """Streams [m, N, B, T, d] (stream 0 is v) of N sources: the fast path of `shifted_streams_twin`."""
    return _ShiftedStreams.apply(v_NBTD, padded_NBPD, taps_NSKD, tuple(kernel_sizes), reach)


def shifted_streams_twin(v_NBTD: torch.Tensor, padded_NBPD: torch.Tensor, taps_NSKD: torch.Tensor,
                         kernel_sizes: tuple[int, ...], reach: int) -> torch.Tensor:
    """The slow twin: one differentiable multiply-add per stream and shift, then a stack."""
    seq, kappa_max = v_NBTD.shape[2], taps_NSKD.shape[2]

    def shifted(delta: int) -> torch.Tensor:  # v[t - delta]
        return padded_NBPD[:, :, kappa_max - 1 - delta: kappa_max - 1 - delta + seq]

    streams = [v_NBTD]
    for s, kappa in enumerate(kernel_sizes):
        taps_NKD = taps_NSKD[:, s].unsqueeze(1).unsqueeze(1)  # [N, 1, 1, K, d]
        u_NBTD = v_NBTD * taps_NKD[..., 0, :]
        for delta in range(1, min(kappa, reach)):
            u_NBTD = torch.addcmul(u_NBTD, shifted(delta), taps_NKD[..., delta, :])
        streams.append(u_NBTD.to(v_NBTD.dtype))
    return torch.stack(streams)
