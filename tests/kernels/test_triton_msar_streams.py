"""The fused MSAR stream kernel (`triton_ops.phase1_streams`: causal-conv streams and phase 1 in one
kernel) against its torch twin (`phase1_conv_streams_torch`, fp32) and a float64 reference written
as explicit shifted sums (independent of the twin's grouped conv1d): outputs and the gradients of
the sources, the conv taps and the queries. Without a GPU it runs under the Triton interpreter on
CPU (TRITON_INTERPRET=1, set here and in conftest.py before the kernels are imported).

Shapes are tiny, with several sources, m >= 3 streams, kernel widths > 1 (one longer than the
sequence), strided sources, and small tile budgets and program counts that force the d-chunked,
key-chunked and grouped code paths. Every launcher buffer starts as NaN, so an element no program
writes fails the comparison.
"""

import os

import torch

if not torch.cuda.is_available():  # before any kernel module is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from attnres_pp.kernels import (  # noqa: E402
    dispatch,
    phase1_torch,
    triton_common,
    triton_msar_streams,
    triton_msar_streams_bwd,
    triton_ops,
)
from tests.concurrent_programs import ONLY_WHERE_PROGRAMS_RUN_CONCURRENTLY  # noqa: E402

FP32_TOL = dict(atol=1e-4, rtol=1e-4)
BF16_TOL = dict(atol=3e-2, rtol=3e-2)
# opcheck's schema, autograd-registration and fake-tensor checks; not its AOTAutograd trace with dynamic
# shapes (the model compiles with dynamic=False; test_compiled_graph_calls_the_custom_op traces the op
# and its backward with static shapes). Why each kept one matters: test_triton_interpreter.py's OPCHECK_UTILS.
OPCHECK_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor")


@pytest.fixture(autouse=True)
def nan_filled_buffers(monkeypatch, kernel_device):
    monkeypatch.setattr(triton_common, "FILL_BUFFERS_WITH_NAN", True)


def _reference_fp64(sources_NTD, taps_NCKD, kernel_sizes, queries_MSD, seq_len, eps=1e-6):
    """Streams by explicit shifted sums within each sequence, then `phase1_torch` per stream."""
    n, t, d = sources_NTD.shape
    v_NBLD = sources_NTD.reshape(n, t // seq_len, seq_len, d)
    streams = [sources_NTD]
    for s, kappa in enumerate(kernel_sizes):
        shifted = [torch.nn.functional.pad(v_NBLD[:, :, : seq_len - delta], (0, 0, delta, 0))
                   for delta in range(min(kappa, seq_len))]
        u = sum(taps_NCKD[:, s, delta][:, None, None, :] * x for delta, x in enumerate(shifted))
        streams.append(u.reshape(n, t, d))
    reads = [phase1_torch(u, queries_MSD[s], None, eps) for s, u in enumerate(streams)]
    return torch.stack([o for o, _ in reads]), torch.stack([lse for _, lse in reads])


def _inputs(n_sources, seq_len, batch, width_d, n_queries, kernel_sizes, strided):
    """float64 leaves: sources [N, T, d] (or a wider tensor whose first d channels are them), taps
    [N, m-1, kappa_max, d] zero past each kernel size, queries [m, S, d]."""
    n_tokens, n_streams, kappa_max = seq_len * batch, len(kernel_sizes) + 1, max(kernel_sizes)
    taps = torch.randn(n_sources, n_streams - 1, kappa_max, width_d, dtype=torch.float64)
    for s, kappa in enumerate(kernel_sizes):
        taps[:, s, kappa:] = 0
    width = width_d + 3 if strided else width_d
    return {
        "sources": torch.randn(n_sources, n_tokens, width, dtype=torch.float64).requires_grad_(),
        "taps": taps.requires_grad_(),
        "queries": torch.randn(n_streams, n_queries, width_d, dtype=torch.float64).requires_grad_(),
    }


def _run(leaves, kernel_sizes, seq_len, width_d, backend, dtype, d_out, d_lse):
    """Forward + backward on copies cast to `dtype` ('reference': the float64 shifted sums)."""
    cast = {name: x.detach().to(dtype).requires_grad_() for name, x in leaves.items()}
    sources = cast["sources"][..., :width_d]  # a strided view when the leaf is wider than d
    if backend == "reference":
        out, lse = _reference_fp64(sources, cast["taps"], kernel_sizes, cast["queries"], seq_len)
    else:
        out, lse = dispatch.phase1_streams(sources, cast["taps"], kernel_sizes, cast["queries"], seq_len,
                                           backend=backend)
    torch.autograd.backward((out, lse), (d_out.to(out.dtype), d_lse.to(lse.dtype)))
    return {"out": out, "lse": lse, **{f"d_{name}": cast[name].grad for name in cast}}


CASES = [
    # N, seq_len, batch, d, S, kernel sizes, strided sources, tile budget, grouped-pass programs
    (3, 5, 2, 12, 2, (2, 3), True, None, None),  # m = 3, two sequences, strided sources
    # The interpreter's cost is programs x sources: the two small-budget cases run one-token tiles,
    # so they keep to the fewest sources and tokens that still give each pass its chunked paths.
    (2, 3, 2, 10, 2, (2, 5, 4), False, 64, 2),  # m = 4, a kernel longer than two sequences, grouped
    (2, 3, 1, 10, 3, (3,), True, 32, 2),  # d chunked over programs in every pass, scores over key chunks
    (1, 6, 1, 7, 1, (1, 4), False, None, None),  # N = 1, S = 1, a width-1 kernel
    (2, 70, 1, 6, 2, (3, 2), False, None, None),  # two token tiles of 64, the second one short
]


@pytest.mark.parametrize("n_sources,seq_len,batch,width_d,n_queries,kernel_sizes,strided,tile_elems,programs", CASES)
def test_outputs_and_every_gradient(monkeypatch, n_sources, seq_len, batch, width_d, n_queries, kernel_sizes,
                                    strided, tile_elems, programs):
    if tile_elems is not None:
        monkeypatch.setattr(triton_common, "DEFAULT_TILE_ELEMS", tile_elems)
    if programs is not None:
        monkeypatch.setattr(triton_msar_streams_bwd, "STREAM_GRAD_PROGRAMS", programs)
    leaves = _inputs(n_sources, seq_len, batch, width_d, n_queries, kernel_sizes, strided)
    n_streams, n_tokens = len(kernel_sizes) + 1, seq_len * batch
    d_out = torch.randn(n_streams, n_queries, n_tokens, width_d, dtype=torch.float64)
    d_lse = torch.randn(n_streams, n_queries, n_tokens, dtype=torch.float64)
    args = (kernel_sizes, seq_len, width_d)
    exact = _run(leaves, *args, "reference", torch.float64, d_out, d_lse)
    twin = _run(leaves, *args, "torch", torch.float32, d_out, d_lse)
    fast = _run(leaves, *args, "triton", torch.float32, d_out, d_lse)
    assert fast.keys() == exact.keys() == twin.keys()
    for name, want in exact.items():
        got = fast[name]
        assert torch.isfinite(got).all(), name
        torch.testing.assert_close(got, twin[name], **FP32_TOL, msg=name)
        torch.testing.assert_close(got.double(), want, **FP32_TOL, msg=name)
    assert fast["d_taps"].abs().sum() > 0
    for s, kappa in enumerate(kernel_sizes):  # taps past a stream's kernel size are never used
        assert (fast["d_taps"][:, s, kappa:] == 0).all()
    if strided:  # the channels past d are no source: no gradient reaches them
        assert (fast["d_sources"][..., width_d:] == 0).all()


def test_bf16_sources_match_the_fp64_reference():
    kernel_sizes, seq_len, width_d = (2, 3), 4, 16
    leaves = _inputs(3, seq_len, 2, width_d, 2, kernel_sizes, False)
    leaves["sources"] = leaves["sources"].detach().bfloat16().double().requires_grad_()
    d_out = torch.randn(3, 2, 8, width_d, dtype=torch.float64).bfloat16().double()
    d_lse = torch.randn(3, 2, 8, dtype=torch.float64)
    exact = _run(leaves, kernel_sizes, seq_len, width_d, "reference", torch.float64, d_out, d_lse)
    cast = {name: x.detach().requires_grad_() for name, x in leaves.items()}
    sources = cast["sources"].detach().bfloat16().requires_grad_()
    out, lse = triton_ops.phase1_streams(sources, cast["taps"].float(), kernel_sizes, cast["queries"].float(),
                                         seq_len)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    torch.autograd.backward((out, lse), (d_out.bfloat16(), d_lse.float()))
    torch.testing.assert_close(out.double(), exact["out"], **BF16_TOL)
    torch.testing.assert_close(lse.double(), exact["lse"], **BF16_TOL)
    torch.testing.assert_close(sources.grad.double(), exact["d_sources"], **BF16_TOL)


@ONLY_WHERE_PROGRAMS_RUN_CONCURRENTLY
def test_backward_is_bitwise_deterministic(monkeypatch):
    monkeypatch.setattr(triton_common, "DEFAULT_TILE_ELEMS", 64)
    monkeypatch.setattr(triton_msar_streams_bwd, "STREAM_GRAD_PROGRAMS", 4)  # several partials per sum
    leaves = _inputs(3, 4, 2, 8, 2, (2, 3), False)
    d_out = torch.randn(3, 2, 8, 8, dtype=torch.float64)
    d_lse = torch.randn(3, 2, 8, dtype=torch.float64)
    first = _run(leaves, (2, 3), 4, 8, "triton", torch.float32, d_out, d_lse)
    second = _run(leaves, (2, 3), 4, 8, "triton", torch.float32, d_out, d_lse)
    for name in first:
        assert torch.equal(first[name], second[name]), name


def test_grouped_passes_walk_several_token_tiles(monkeypatch):
    """With few programs the stream- and tap-gradient passes each walk a group of tiles. The tiles
    hold one token: two sequences of 4 tokens give each group 8 tiles, a sequence boundary and the
    width-3 kernel reaching back over tiles (the interpreter's cost grows with the tiles)."""
    monkeypatch.setattr(triton_common, "DEFAULT_TILE_ELEMS", 64)
    monkeypatch.setattr(triton_msar_streams_bwd, "STREAM_GRAD_PROGRAMS", 4)
    groups = []
    real = triton_msar_streams_bwd._groups
    monkeypatch.setattr(triton_msar_streams_bwd, "_groups", lambda *a: groups.append(real(*a)) or groups[-1])
    leaves = _inputs(2, 4, 2, 8, 2, (2, 3), False)
    d_out = torch.randn(3, 2, 8, 8, dtype=torch.float64)
    d_lse = torch.randn(3, 2, 8, dtype=torch.float64)
    twin = _run(leaves, (2, 3), 4, 8, "torch", torch.float32, d_out, d_lse)
    fast = _run(leaves, (2, 3), 4, 8, "triton", torch.float32, d_out, d_lse)
    assert len(groups) == 2 and all(per_group > 1 for _, per_group in groups)
    for name in twin:
        torch.testing.assert_close(fast[name], twin[name], **FP32_TOL, msg=name)


def test_torch_library_opcheck():
    kernel_sizes, seq_len = [2, 3], 3
    packed = torch.randn(2, 6, 9, requires_grad=True)
    taps = torch.randn(2, 2, 3, 6, requires_grad=True)
    queries = torch.randn(3, 2, 6, requires_grad=True)
    torch.library.opcheck(triton_ops._streams_op, (packed[..., :6], taps, queries, kernel_sizes, seq_len, 1e-6),
                          test_utils=OPCHECK_UTILS)
    sources = packed.detach()[..., :6]
    lse = triton_ops.phase1_streams(sources, taps.detach(), kernel_sizes, queries.detach(), seq_len)[1]
    d_out, d_lse = torch.randn(3, 2, 6, 6), torch.randn(3, 2, 6)
    torch.library.opcheck(triton_ops._streams_backward_op, (sources, taps.detach(), queries.detach(), kernel_sizes,
                                                            seq_len, lse, d_out, d_lse, 1e-6),
                          test_utils=OPCHECK_UTILS)


def test_compiled_graph_calls_the_custom_op():
    """torch.compile traces through the fused op and its backward (aot_eager: no C++ toolchain)."""

    def read(sources, taps, queries):
        out, lse = triton_ops.phase1_streams(sources, taps, [2, 3], queries, 3)
        return out.square().sum() + lse.sum()

    args = [torch.randn(2, 6, 5), torch.randn(2, 2, 3, 5), torch.randn(3, 2, 5)]
    eager = [x.clone().requires_grad_() for x in args]
    compiled = [x.clone().requires_grad_() for x in args]
    read(*eager).backward()
    torch.compile(read, backend="aot_eager", fullgraph=True)(*compiled).backward()
    for a, b in zip(eager, compiled, strict=True):
        torch.testing.assert_close(a.grad, b.grad, **FP32_TOL)


def test_tokens_must_be_whole_sequences():
    with pytest.raises(ValueError, match="not whole sequences"):
        triton_msar_streams.streams_forward(torch.randn(1, 5, 4), torch.randn(1, 1, 2, 4), [2],
                                            torch.randn(2, 1, 4), 2)


def test_the_model_reads_msar_through_the_fused_kernel(monkeypatch):
    """Under the Triton backend each MSAR phase-1 read is one fused launch over the stored sources
    (no per-stream phase-1 launches, no stream conv of completed sources); loss and gradients are
    the torch backend's."""
    from attnres_pp.kernels import triton_phase1
    from attnres_pp.model import ModelConfig, Transformer
    from attnres_pp.model.depth import StreamConvs

    cfg = ModelConfig(vocab_size=32, n_layers=2, d_model=16, n_heads=2, seq_len=6, residual="msar", block_size=2,
                      stream_kernels=(2, 3))
    calls = {"fused": 0, "phase1": 0, "stream_stack": 0}
    fused, plain, stack = (triton_msar_streams.streams_forward, triton_phase1.phase1_forward,
                           StreamConvs.stream_stack)

    def count(name, fn):
        def counted(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return counted

    monkeypatch.setattr(triton_msar_streams, "streams_forward", count("fused", fused))
    monkeypatch.setattr(triton_phase1, "phase1_forward", count("phase1", plain))
    monkeypatch.setattr(StreamConvs, "stream_stack", count("stream_stack", stack))
    idx, targets = torch.randint(0, 32, (2, 6)), torch.randint(0, 32, (2, 6))
    results = {}
    for backend in ("torch", "triton"):
        torch.manual_seed(0)
        model = Transformer(cfg, backend=backend)
        with torch.no_grad():  # non-zero queries, gates and taps off their init, so that reads are not plain means
            for name, p in model.named_parameters():
                if name.endswith(("read.query", "gate_weight", "gate_bias")) or "stream_convs" in name:
                    p.add_(torch.randn(p.shape) * 0.5)
        before = dict(calls)
        loss = model(idx, targets)
        loss.backward()
        results[backend] = (loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None})
        results[backend + "_calls"] = {k: calls[k] - before[k] for k in calls}
    # 4 sublayers in blocks of 2 plus the final read: 3 phase-1 reads; the partials' streams are
    # still convolved per read (2 of them), the completed sources' never.
    assert results["triton_calls"] == {"fused": 3, "phase1": 0, "stream_stack": 2}
    assert results["torch_calls"]["fused"] == 0
    torch.testing.assert_close(results["triton"][0], results["torch"][0], atol=1e-5, rtol=1e-5)
    grads_torch, grads_triton = results["torch"][1], results["triton"][1]
    assert grads_triton.keys() == grads_torch.keys()
    assert any("stream_convs" in n for n in grads_triton)
    for name, grad in grads_torch.items():
        torch.testing.assert_close(grads_triton[name], grad, atol=1e-4, rtol=1e-4, msg=name)
