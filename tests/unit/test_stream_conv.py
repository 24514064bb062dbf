"""MSAR's stream convolutions: the in-place autograd function (`stream_conv.shifted_streams`)
against its slow twin (ordinary autograd over one multiply-add per stream and shift), float64:
the streams and the gradients of the sources, the taps and a sequence shard's halo."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attnres_pp.model.stream_conv import shifted_streams, shifted_streams_twin


def _streams_and_grads(fn, kernel_sizes, halo: bool, dtype, seq: int = 9, compute_dtype=None):
    """`fn`'s streams and gradients for sources rounded to `dtype` (held in `compute_dtype`, default
    `dtype`) and float64 taps."""
    compute_dtype = compute_dtype or dtype
    g = torch.Generator().manual_seed(0)
    n, b, d, kappa = 2, 3, 5, max(kernel_sizes)
    v = torch.randn(n, b, seq, d, generator=g, dtype=torch.float64).to(dtype).to(compute_dtype).requires_grad_()
    taps = torch.randn(n, len(kernel_sizes), kappa, d, generator=g, dtype=torch.float64).requires_grad_()
    before = torch.randn(n, b, kappa - 1, d, generator=g, dtype=torch.float64).to(dtype).to(compute_dtype)
    before.requires_grad_()
    # A shard reads the tokens before it (reach kappa); a whole sequence reads zeros (reach seq).
    padded = torch.cat([before, v], dim=2) if halo else F.pad(v, (0, 0, kappa - 1, 0))
    streams = fn(v, padded, taps, kernel_sizes, kappa if halo else seq)
    weights = torch.randn(streams.shape, generator=g, dtype=torch.float64).to(dtype).to(streams.dtype)
    leaves = [v, taps, before] if halo else [v, taps]
    return streams, torch.autograd.grad((streams * weights).sum(), leaves)


@pytest.mark.parametrize("kernel_sizes", [(4, 8, 12), (3, 1, 5), (2,), (1, 2)])
@pytest.mark.parametrize("halo", [False, True])
def test_fast_streams_and_gradients_equal_the_twin_in_float64(kernel_sizes, halo):
    fast, fast_grads = _streams_and_grads(shifted_streams, kernel_sizes, halo, torch.float64)
    twin, twin_grads = _streams_and_grads(shifted_streams_twin, kernel_sizes, halo, torch.float64)
    assert fast.shape == (1 + len(kernel_sizes), 2, 3, 9, 5)
    torch.testing.assert_close(fast, twin, rtol=0, atol=0)  # the same multiply-adds in the same order
    for got, want in zip(fast_grads, twin_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_a_sequence_shorter_than_the_kernels_skips_the_taps_that_meet_only_zeros():
    """seq 3 < kappa 12 (no halo): taps at delta >= 3 read only v[t < 0] = 0, their gradient is zero."""
    fast, (_, taps_grad) = _streams_and_grads(shifted_streams, (4, 8, 12), False, torch.float64, seq=3)
    twin, (_, twin_taps_grad) = _streams_and_grads(shifted_streams_twin, (4, 8, 12), False, torch.float64, seq=3)
    torch.testing.assert_close(fast, twin, rtol=0, atol=0)
    torch.testing.assert_close(taps_grad, twin_taps_grad, rtol=1e-12, atol=1e-12)
    assert taps_grad[:, :, 3:].abs().sum() == 0 and taps_grad[:, :, :3].abs().min() > 0


def test_bf16_sources_are_convolved_in_the_taps_dtype_and_returned_in_bf16():
    fast, fast_grads = _streams_and_grads(shifted_streams, (4, 8, 12), False, torch.bfloat16)
    twin, twin_grads = _streams_and_grads(shifted_streams_twin, (4, 8, 12), False, torch.bfloat16)
    assert fast.dtype == torch.bfloat16 and fast_grads[0].dtype == torch.bfloat16
    torch.testing.assert_close(fast, twin, rtol=0, atol=0)
    # Gradients within bf16's rounding (relative to their largest entry: the sources' gradient is
    # rounded where its pieces meet, the padding's slice and the taps' products) of the float64
    # gradients of the same bf16 values, as the twin's are.
    _, exact_grads = _streams_and_grads(shifted_streams_twin, (4, 8, 12), False, torch.bfloat16,
                                        compute_dtype=torch.float64)
    for got, want, twin_got in zip(fast_grads, exact_grads, twin_grads, strict=True):
        scale = want.abs().max()
        torch.testing.assert_close(got.double(), want, rtol=0, atol=2 ** -7 * scale)
        torch.testing.assert_close(twin_got.double(), want, rtol=0, atol=2 ** -7 * scale)
