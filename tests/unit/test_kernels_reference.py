"""The pure-torch depth-attention ops: identities and float64 gradchecks."""

from __future__ import annotations

import pytest
import torch

from attnres_pp.kernels import phase1, phase2, rms_normalize


def _one_softmax(values_NTD, keys_NTK, query_K):
    scores_TN = torch.einsum("k,ntk->tn", query_K, rms_normalize(keys_NTK, 1e-6))
    return torch.einsum("tn,ntd->td", torch.softmax(scores_TN, -1), values_NTD)


def test_zero_queries_give_the_plain_mean():
    values = torch.randn(5, 7, 6, dtype=torch.float64)
    out, lse = phase1(values, torch.zeros(3, 6, dtype=torch.float64), backend="torch")
    for s in range(3):
        torch.testing.assert_close(out[s], values.mean(0))
    torch.testing.assert_close(lse, torch.full((3, 7), float(torch.log(torch.tensor(5.0))), dtype=torch.float64))


@pytest.mark.parametrize("rank", [None, 3])
def test_two_phase_equals_one_softmax_over_all_sources(rank):
    g = torch.Generator().manual_seed(0)
    n, t, d = 4, 9, 6
    values = torch.randn(n + 1, t, d, generator=g, dtype=torch.float64)
    keys = None if rank is None else torch.randn(n + 1, t, rank, generator=g, dtype=torch.float64)
    query = torch.randn(rank or d, generator=g, dtype=torch.float64)
    out1, lse1 = phase1(values[:n], query[None], keys=None if keys is None else keys[:n], backend="torch")
    merged = phase2(out1[0], lse1[0], values[n], query, partial_key=None if keys is None else keys[n],
                    backend="torch")
    want = _one_softmax(values, values if keys is None else keys, query)
    torch.testing.assert_close(merged, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("rank", [None, 3])
def test_phase1_gradcheck_float64(rank):
    g = torch.Generator().manual_seed(1)
    values = torch.randn(3, 5, 4, generator=g, dtype=torch.float64, requires_grad=True)
    queries = torch.randn(2, rank or 4, generator=g, dtype=torch.float64, requires_grad=True)
    keys = None if rank is None else torch.randn(3, 5, rank, generator=g, dtype=torch.float64, requires_grad=True)
    inputs = (values, queries) if keys is None else (values, queries, keys)

    def fn(v, q, k=None):
        out, lse = phase1(v, q, keys=k, backend="torch")
        return out, lse

    assert torch.autograd.gradcheck(fn, inputs)


@pytest.mark.parametrize("rank", [None, 3])
def test_phase2_gradcheck_float64(rank):
    g = torch.Generator().manual_seed(2)
    t, d = 5, 4
    args = [torch.randn(t, d, generator=g, dtype=torch.float64, requires_grad=True),
            torch.randn(t, generator=g, dtype=torch.float64, requires_grad=True),
            torch.randn(t, d, generator=g, dtype=torch.float64, requires_grad=True),
            torch.randn(rank or d, generator=g, dtype=torch.float64, requires_grad=True)]
    if rank is not None:
        args.append(torch.randn(t, rank, generator=g, dtype=torch.float64, requires_grad=True))

    def fn(out1, lse1, partial, query, partial_key=None):
        return phase2(out1, lse1, partial, query, partial_key=partial_key, backend="torch")

    assert torch.autograd.gradcheck(fn, tuple(args))


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="backend"):
        phase1(torch.zeros(1, 2, 3), torch.zeros(1, 3), backend="cuda")
