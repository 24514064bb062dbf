"""Triton depth-attention kernels vs the torch backend and a float64 reference. Without a GPU they
run under the Triton interpreter on CPU (TRITON_INTERPRET=1, set here and in conftest.py before the
kernels are imported); with a GPU the same tests run the compiled kernels on CUDA tensors.

Shapes are tiny and have tails (T and d not multiples of the tiles); small tile budgets force the
d-chunked, key-chunked, multi-token-tile and score-pre-pass code paths. Under the interpreter a case
costs about its programs (token tiles x d chunks): the small-budget cases, whose tiles hold one
token, have 3 tokens (several tiles, no more). Every buffer the launchers
allocate starts as NaN, so an element that no program writes fails the comparison.
"""

import os

import torch

if not torch.cuda.is_available():  # before any kernel module is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from attnres_pp.kernels import (  # noqa: E402
    dispatch,
    phase1_torch,
    phase2_torch,
    triton_common,
    triton_ops,
    triton_phase1,
)
from tests.concurrent_programs import ONLY_WHERE_PROGRAMS_RUN_CONCURRENTLY  # noqa: E402

FP32_TOL = dict(atol=1e-4, rtol=1e-4)
BF16_TOL = dict(atol=3e-2, rtol=3e-2)
# opcheck's checks that say something for these ops: the registered schema matches what the op does to
# its inputs (test_schema), the autograd formula is registered for the op rather than left to a wrapper
# (test_autograd_registration), and the fake kernels give the real kernels' shapes, strides and dtypes
# (test_faketensor: what torch.compile traces with). Its fourth, test_aot_dispatch_dynamic (the op and its
# backward through AOTAutograd with dynamic shapes), costs three quarters of the test under the
# interpreter and checks a use the model never makes (it compiles with dynamic=False); the static trace
# of the ops and their backward is test_compiled_graph_calls_the_custom_ops's.
OPCHECK_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor")


@pytest.fixture(autouse=True)
def nan_filled_buffers(monkeypatch, kernel_device):
    """Every test: NaN-filled launcher buffers, tensors made on the kernels' device."""
    monkeypatch.setattr(triton_common, "FILL_BUFFERS_WITH_NAN", True)


def _set_tile_budget(monkeypatch, tile_elems):
    if tile_elems is not None:
        monkeypatch.setattr(triton_common, "DEFAULT_TILE_ELEMS", tile_elems)


def _leaf(*shape, dtype=torch.float64):
    return torch.randn(*shape, dtype=dtype).requires_grad_()


def _phase1_inputs(n_sources, n_tokens, width_d, n_queries, key_mode, rank):
    """float64 leaves; key_mode 'values' (k = d), 'projected' (own [N, T, r]) or 'sliced' (view)."""
    leaves = {"values": _leaf(n_sources, n_tokens, width_d)}
    width_k = width_d if key_mode == "values" else rank
    leaves["queries"] = _leaf(n_queries, width_k)
    if key_mode == "projected":
        leaves["keys"] = _leaf(n_sources, n_tokens, rank)
    return leaves


def _phase1_keys(leaves, key_mode, rank):
    if key_mode == "sliced":
        return leaves["values"][..., -rank:]
    return leaves.get("keys")


def _run_phase1(leaves, key_mode, rank, backend, dtype, d_out, d_lse):
    """Forward + backward on copies of the leaves cast to `dtype`; returns outputs and gradients."""
    cast = {name: x.detach().to(dtype).requires_grad_() for name, x in leaves.items()}
    keys = _phase1_keys(cast, key_mode, rank)
    out, lse = dispatch.phase1(cast["values"], cast["queries"], keys=keys, backend=backend)
    torch.autograd.backward((out, lse), (d_out.to(out.dtype), d_lse.to(lse.dtype)))
    return [out, lse] + [cast[name].grad for name in sorted(cast)]


PHASE1_CASES = [
    # N, T, d, S, key_mode, r, tile budget (None: production sizes)
    (3, 5, 20, 3, "values", None, None),
    (3, 3, 20, 3, "values", None, 32),  # d split over 3 programs: score pre-pass, one token per tile
    (2, 70, 12, 2, "values", None, None),  # two token tiles of 64, the second one short
    (1, 3, 7, 1, "values", None, None),  # N = 1, S = 1
    (3, 5, 20, 3, "projected", 6, None),
    (3, 3, 20, 2, "projected", 6, 16),  # d and r both chunked, with tails
    (3, 5, 20, 3, "sliced", 6, None),
    (2, 3, 20, 2, "sliced", 6, 16),
    (1, 4, 9, 1, "sliced", 3, None),
]


@pytest.mark.parametrize("n_sources,n_tokens,width_d,n_queries,key_mode,rank,tile_elems", PHASE1_CASES)
def test_phase1_outputs_and_gradients(monkeypatch, n_sources, n_tokens, width_d, n_queries, key_mode, rank, tile_elems):
    _set_tile_budget(monkeypatch, tile_elems)
    leaves = _phase1_inputs(n_sources, n_tokens, width_d, n_queries, key_mode, rank)
    d_out = torch.randn(n_queries, n_tokens, width_d, dtype=torch.float64)
    d_lse = torch.randn(n_queries, n_tokens, dtype=torch.float64)
    exact = _run_phase1(leaves, key_mode, rank, "torch", torch.float64, d_out, d_lse)
    twin = _run_phase1(leaves, key_mode, rank, "torch", torch.float32, d_out, d_lse)
    fast = _run_phase1(leaves, key_mode, rank, "triton", torch.float32, d_out, d_lse)
    for got, want_fp32, want_fp64 in zip(fast, twin, exact, strict=True):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want_fp32, **FP32_TOL)
        torch.testing.assert_close(got.double(), want_fp64, **FP32_TOL)


def _phase2_inputs(n_tokens, width_d, key_mode, rank):
    width_k = width_d if key_mode == "values" else rank
    leaves = {
        "lse1": _leaf(n_tokens),
        "out1": _leaf(n_tokens, width_d),
        "partial": _leaf(n_tokens, width_d),
        "query": _leaf(width_k),
    }
    if key_mode == "projected":
        leaves["partial_key"] = _leaf(n_tokens, rank)
    return leaves


def _run_phase2(leaves, key_mode, rank, backend, dtype, d_h):
    cast = {name: x.detach().to(dtype).requires_grad_() for name, x in leaves.items()}
    cast["lse1"] = leaves["lse1"].detach().to(torch.float64 if dtype == torch.float64 else torch.float32)
    cast["lse1"].requires_grad_()
    key = cast["partial"][:, -rank:] if key_mode == "sliced" else cast.get("partial_key")
    h = dispatch.phase2(cast["out1"], cast["lse1"], cast["partial"], cast["query"], partial_key=key, backend=backend)
    h.backward(d_h.to(h.dtype))
    return [h] + [cast[name].grad for name in sorted(cast)]


PHASE2_CASES = [
    (5, 20, "values", None, None),
    (3, 20, "values", None, 8),  # d chunked: each chunk re-reads the partial's row for its gate
    (70, 12, "values", None, None),
    (1, 3, "values", None, None),
    (5, 20, "projected", 6, None),
    (3, 20, "projected", 6, 4),
    (5, 20, "sliced", 6, None),
    (6, 10, "sliced", 3, 4),
]


@pytest.mark.parametrize("n_tokens,width_d,key_mode,rank,tile_elems", PHASE2_CASES)
def test_phase2_outputs_and_gradients(monkeypatch, n_tokens, width_d, key_mode, rank, tile_elems):
    _set_tile_budget(monkeypatch, tile_elems)
    leaves = _phase2_inputs(n_tokens, width_d, key_mode, rank)
    d_h = torch.randn(n_tokens, width_d, dtype=torch.float64)
    exact = _run_phase2(leaves, key_mode, rank, "torch", torch.float64, d_h)
    twin = _run_phase2(leaves, key_mode, rank, "torch", torch.float32, d_h)
    fast = _run_phase2(leaves, key_mode, rank, "triton", torch.float32, d_h)
    for got, want_fp32, want_fp64 in zip(fast, twin, exact, strict=True):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want_fp32, **FP32_TOL)
        torch.testing.assert_close(got.double(), want_fp64, **FP32_TOL)


@pytest.mark.parametrize("key_mode", ["values", "sliced", "projected"])
def test_bf16_inputs_match_fp32_reference(key_mode):
    rank = 4
    leaves = _phase1_inputs(3, 9, 24, 2, key_mode, rank)
    # Round once to bf16 so the reference sees exactly the bf16 kernel's inputs.
    leaves = {name: x.detach().bfloat16().double().requires_grad_() for name, x in leaves.items()}
    d_out = torch.randn(2, 9, 24, dtype=torch.float64).bfloat16().double()
    d_lse = torch.randn(2, 9, dtype=torch.float64)
    exact = _run_phase1(leaves, key_mode, rank, "torch", torch.float64, d_out, d_lse)
    fast = _run_phase1(leaves, key_mode, rank, "triton", torch.bfloat16, d_out, d_lse)
    assert fast[0].dtype == torch.bfloat16 and fast[1].dtype == torch.float32
    for got, want in zip(fast, exact, strict=True):
        torch.testing.assert_close(got.double(), want, **BF16_TOL)

    leaves2 = _phase2_inputs(9, 24, key_mode, rank)
    leaves2 = {name: x.detach().bfloat16().double().requires_grad_() for name, x in leaves2.items()}
    d_h = torch.randn(9, 24, dtype=torch.float64).bfloat16().double()
    exact2 = _run_phase2(leaves2, key_mode, rank, "torch", torch.float64, d_h)
    fast2 = _run_phase2(leaves2, key_mode, rank, "triton", torch.bfloat16, d_h)
    assert fast2[0].dtype == torch.bfloat16
    for got, want in zip(fast2, exact2, strict=True):
        torch.testing.assert_close(got.double(), want, **BF16_TOL)


def test_sliced_keys_reach_the_kernel_as_a_view(monkeypatch):
    """The sliced key is the values' last r channels: the launcher must see that very memory."""
    seen = {}
    launcher = triton_phase1.phase1_forward

    def spy(values_NTD, queries_SK, keys_NTK=None, eps=1e-6, tile_elems=None):
        seen["values_ptr"], seen["keys_ptr"] = values_NTD.data_ptr(), keys_NTK.data_ptr()
        seen["keys_contiguous"] = keys_NTK.is_contiguous()
        return launcher(values_NTD, queries_SK, keys_NTK, eps, tile_elems)

    monkeypatch.setattr(triton_phase1, "phase1_forward", spy)
    width_d, rank = 10, 3
    values = torch.randn(2, 4, width_d, requires_grad=True)
    queries = torch.randn(2, rank)
    out, _ = triton_ops.phase1(values, queries, keys=values[..., -rank:])
    assert seen["keys_ptr"] == seen["values_ptr"] + (width_d - rank) * values.element_size()
    assert not seen["keys_contiguous"]
    out.sum().backward()
    reference = values.detach().requires_grad_()
    phase1_torch(reference, queries, reference[..., -rank:])[0].sum().backward()
    torch.testing.assert_close(values.grad, reference.grad, **FP32_TOL)


@ONLY_WHERE_PROGRAMS_RUN_CONCURRENTLY
def test_backward_is_bitwise_deterministic(monkeypatch):
    _set_tile_budget(monkeypatch, 32)  # many token tiles feed the query-gradient sums
    leaves = _phase1_inputs(3, 11, 20, 3, "projected", 5)
    d_out = torch.randn(3, 11, 20, dtype=torch.float64)
    d_lse = torch.randn(3, 11, dtype=torch.float64)
    first = _run_phase1(leaves, "projected", 5, "triton", torch.float32, d_out, d_lse)
    second = _run_phase1(leaves, "projected", 5, "triton", torch.float32, d_out, d_lse)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)


def test_dispatch_routes_to_the_triton_launchers(monkeypatch, kernel_device):
    calls = []
    launcher = triton_phase1.phase1_forward
    monkeypatch.setattr(triton_phase1, "phase1_forward", lambda *a, **k: calls.append(1) or launcher(*a, **k))
    values, queries = torch.randn(2, 3, 8), torch.randn(1, 8)
    triton_out, _ = dispatch.phase1(values, queries, backend="triton")
    assert calls == [1]
    auto_out, _ = dispatch.phase1(values, queries, backend="auto")  # Triton only for CUDA tensors
    assert len(calls) == (2 if kernel_device == "cuda" else 1)
    torch.testing.assert_close(triton_out, auto_out, **FP32_TOL)


def test_torch_library_opcheck():
    n_tokens, width_d, rank = 4, 8, 3
    values = torch.randn(2, n_tokens, width_d, requires_grad=True)
    cases = [
        (triton_ops._phase1_op, (values, torch.randn(2, width_d, requires_grad=True), None, 1e-6)),
        (
            triton_ops._phase1_op,
            (values, torch.randn(2, rank, requires_grad=True), torch.randn(2, n_tokens, rank), 1e-6),
        ),
    ]
    for key in (None, torch.randn(n_tokens, rank, requires_grad=True)):
        width_k = width_d if key is None else rank
        args = [torch.randn(n_tokens, width_d), torch.randn(n_tokens), torch.randn(n_tokens, width_d)]
        args = [x.requires_grad_() for x in args] + [torch.randn(width_k, requires_grad=True), key, 1e-6]
        cases.append((triton_ops._phase2_op, tuple(args)))
    # Strided inputs: the model's packed [values | keys] views, and a dense permuted tensor.
    packed = torch.randn(2, n_tokens, width_d + rank, requires_grad=True)
    permuted = torch.randn(n_tokens, 2, width_d).transpose(0, 1).requires_grad_()
    cases.append((triton_ops._phase1_op, (packed[..., :width_d], torch.randn(2, rank), packed[..., width_d:], 1e-6)))
    cases.append((triton_ops._phase1_op, (permuted, torch.randn(1, width_d), None, 1e-6)))
    for op, args in cases:
        torch.library.opcheck(op, args, test_utils=OPCHECK_UTILS)
    # The backward ops' fake kernels must promise the strides the launchers really return.
    values = permuted.detach()
    queries = torch.randn(1, width_d)
    lse = triton_ops.phase1(values, queries)[1]
    d_out, d_lse = torch.randn(1, n_tokens, width_d), torch.randn(1, n_tokens)
    torch.library.opcheck(triton_ops._phase1_backward_op, (values, queries, None, lse, d_out, d_lse, 1e-6),
                          test_utils=OPCHECK_UTILS)
    partial = torch.randn(width_d, n_tokens).t()
    args2 = (torch.randn(n_tokens, width_d), lse[0], partial, torch.randn(width_d), None, d_out[0], 1e-6)
    torch.library.opcheck(triton_ops._phase2_backward_op, args2, test_utils=OPCHECK_UTILS)


def test_compiled_graph_calls_the_custom_ops():
    """torch.compile traces through the ops (aot_eager: no C++ toolchain needed on CPU)."""

    def read(values, queries, partial, query):
        out, lse = triton_ops.phase1(values, queries)
        return triton_ops.phase2(out[0], lse[0], partial, query)

    args = [torch.randn(2, 5, 6), torch.randn(2, 6), torch.randn(5, 6), torch.randn(6)]
    eager_args = [x.clone().requires_grad_() for x in args]
    compiled_args = [x.clone().requires_grad_() for x in args]
    read(*eager_args).square().sum().backward()
    torch.compile(read, backend="aot_eager", fullgraph=True)(*compiled_args).square().sum().backward()
    for a, b in zip(eager_args, compiled_args, strict=True):
        torch.testing.assert_close(a.grad, b.grad, **FP32_TOL)


def test_phase2_zero_query_is_a_mean_merge():
    """docs/spec.md section 1.1 identity: zero queries give plain means, so phase 2 merges with weight 1 / (n + 1)."""
    values = torch.randn(3, 4, 8)
    out1, lse1 = triton_ops.phase1(values, torch.zeros(1, 8))
    partial = torch.randn(4, 8)
    h = triton_ops.phase2(out1[0], lse1[0], partial, torch.zeros(8))
    torch.testing.assert_close(h, torch.cat([values, partial[None]]).mean(dim=0), **FP32_TOL)
    torch.testing.assert_close(h, phase2_torch(out1[0], lse1[0], partial, torch.zeros(8)), **FP32_TOL)


@pytest.mark.parametrize("key_mode,rank", [("values", None), ("projected", 5)])
def test_key_gradient_programs_walk_several_token_tiles(monkeypatch, key_mode, rank):
    """With few key-gradient programs each walks a group of token tiles; the query gradient sums
    the groups' partials. Gradients must not change."""
    from attnres_pp.kernels import triton_keygrad

    _set_tile_budget(monkeypatch, 64)
    monkeypatch.setattr(triton_keygrad, "KEY_GRAD_PROGRAMS", 2)
    launches = []
    kernel = triton_keygrad._key_grad_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append((grid[0], args[-1]))  # programs, token tiles per program
                return kernel[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(triton_keygrad, "_key_grad_kernel", Spy())
    leaves = _phase1_inputs(3, 9, 12, 2, key_mode, rank)  # 5 token tiles of 2, the last one short
    d_out = torch.randn(2, 9, 12, dtype=torch.float64)
    d_lse = torch.randn(2, 9, dtype=torch.float64)
    twin = _run_phase1(leaves, key_mode, rank, "torch", torch.float32, d_out, d_lse)
    fast = _run_phase1(leaves, key_mode, rank, "triton", torch.float32, d_out, d_lse)
    assert launches and all(per_group > 1 for _, per_group in launches)
    for got, want in zip(fast, twin, strict=True):
        torch.testing.assert_close(got, want, **FP32_TOL)
