"""`attnres-pp bench kernel-streams [--quick]`: the fused MSAR stream kernel alone, and its rows of
`bench kernels`: the causal-conv streams and phase 1 of every stream in one Triton launch
(`triton_ops.phase1_streams`) against its torch twin (`phase1_conv_streams_torch`, the streams
written out) and torch.compile of the twin, at the MSAR paper's stream set (m = 4: the identity and
causal convolutions of widths 4, 8 and 12). One CUDA GPU, bf16; without one it says so and writes
nothing; the hidden `--dry-run-cpu` runs it on CPU under the Triton interpreter and writes nothing.
Writes kernel_streams[_quick]_<date>.json and .md.

Rows carry the same keys as the phase-1/phase-2 rows (op "phase1_streams", key_mode naming the
streams), so the Markdown table and the rates are shared (`bench.kernel_timing`). Bandwidth counts
the bytes the fused op must move: the sources once and the m stream reads written, never the
expanded streams.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

# add_arguments, run_options and to_markdown are this benchmark's hooks for the harness (bench/cli.py),
# the same for both kernel benchmarks.
from attnres_pp.bench.kernel_timing import add_arguments, add_rates, run_kernels, run_options, to_markdown  # noqa: F401

PAPER_KERNELS = (4, 8, 12)


@dataclass(frozen=True)
class StreamShape:
    name: str
    n_sources: int  # N completed sources
    n_tokens: int  # T = whole sequences of seq_len
    width_d: int  # d
    n_queries: int  # S
    seq_len: int
    kernel_sizes: tuple[int, ...] = PAPER_KERNELS

    @property
    def n_streams(self) -> int:
        return len(self.kernel_sizes) + 1


FULL_STREAM_SHAPES = [StreamShape("msar paper m=4", 8, 16384, 2048, 4, 4096)]
QUICK_STREAM_SHAPES = [StreamShape("quick msar m=4", 4, 8192, 1024, 2, 1024)]
DRY_RUN_STREAM_SHAPES = [StreamShape("dry-run msar", 2, 8, 12, 2, 4, (2, 3))]


def streams_bytes(shape: StreamShape, elem: int, backward: bool) -> int:
    """Forward: read the sources, taps and queries, write out [m, S, T, d] and lse [m, S, T] (fp32).
    The backward reads the sources, taps, queries, dout, lse and dlse and writes the three gradients."""
    n, t, d, s, m = shape.n_sources, shape.n_tokens, shape.width_d, shape.n_queries, shape.n_streams
    params = n * (m - 1) * max(shape.kernel_sizes) * d * 4 + m * s * d * 4
    forward = n * t * d * elem + params + m * s * t * d * elem + m * s * t * 4
    if not backward:
        return forward
    return forward + (n * t * d * elem + params + m * s * t * d * elem + 2 * m * s * t * 4) + (n * t * d * elem
                                                                                               + params)


def implementations(device: torch.device):
    """name -> phase1_streams(sources, taps, kernel_sizes, queries, seq_len)."""
    from attnres_pp.kernels import phase1_conv_streams_torch, triton_ops

    compile_kwargs = {"backend": "aot_eager"} if device.type == "cpu" else {}
    return {"triton": triton_ops.phase1_streams, "torch": phase1_conv_streams_torch,
            "torch.compile": torch.compile(phase1_conv_streams_torch, dynamic=False, **compile_kwargs)}


def _leaves(shape: StreamShape, device, dtype, requires_grad: bool):
    """sources [N, T, d] in `dtype`; taps [N, m-1, kappa_max, d] (zero past each kernel size) and
    queries [m, S, d] fp32, as the model's parameters."""
    kappa = max(shape.kernel_sizes)
    taps = torch.randn(shape.n_sources, shape.n_streams - 1, kappa, shape.width_d, device=device) / kappa
    for s, width in enumerate(shape.kernel_sizes):
        taps[:, s, width:] = 0
    sources = torch.randn(shape.n_sources, shape.n_tokens, shape.width_d, device=device, dtype=dtype)
    queries = torch.randn(shape.n_streams, shape.n_queries, shape.width_d, device=device) * 0.1
    return [x.requires_grad_(requires_grad) for x in (sources, taps, queries)]


def measure_stream_shape(shape: StreamShape, device, dtype, timer, copy_gbps):
    """Rows for one stream shape: forward and forward+backward of every implementation, with the
    max abs error (outputs and the gradients of sources, taps and queries) against the torch twin."""
    impls = implementations(device)
    rows = []
    for backward in (False, True):
        group = _measure_mode(shape, impls, backward, device, dtype, timer)
        add_rates(group, copy_gbps)
        rows += group
    return rows


def _measure_mode(shape: StreamShape, impls, backward: bool, device, dtype, timer):
    leaves = _leaves(shape, device, dtype, requires_grad=backward)
    m, s, t, d = shape.n_streams, shape.n_queries, shape.n_tokens, shape.width_d
    grads = [torch.randn(m, s, t, d, device=device, dtype=dtype), torch.randn(m, s, t, device=device)]

    def bound(fn):
        return lambda: list(fn(leaves[0], leaves[1], list(shape.kernel_sizes), leaves[2], shape.seq_len))

    def outputs(run):
        for leaf in leaves:
            leaf.grad = None
        got = run()
        if backward:
            torch.autograd.backward(got, grads)
            got = got + [leaf.grad for leaf in leaves]
        return [x.detach().float() for x in got]

    def step_of(run):
        def step():
            if backward:
                torch.autograd.backward(run(), grads)
            else:
                with torch.no_grad():
                    run()

        return step

    reference = outputs(bound(impls["torch"]))
    group = []
    for name, fn in impls.items():
        run, err = bound(fn), None
        if time.monotonic() < timer.deadline:
            try:
                err = max((a - b).abs().max().item() for a, b in zip(outputs(run), reference, strict=True))
            except Exception as error:  # a compile failure is a row, not a lost benchmark
                err = f"error: {type(error).__name__}"
        group.append(dict(op="phase1_streams", mode="fwd+bwd" if backward else "fwd", impl=name,
                          ms=timer(step_of(run), leaves if backward else ()),
                          bytes=streams_bytes(shape, torch.finfo(dtype).bits // 8, backward),
                          max_abs_err_vs_torch=err, key_mode="streams k=" + ",".join(map(str, shape.kernel_sizes)),
                          rank=0, n_streams=m, **asdict(shape)))
    return group


def plan(size: str) -> list:
    """(shape, measure) for the stream shapes of `size` ("dry-run", "quick" or "full")."""
    shapes = {"dry-run": DRY_RUN_STREAM_SHAPES, "quick": QUICK_STREAM_SHAPES, "full": FULL_STREAM_SHAPES}[size]
    return [(shape, measure_stream_shape) for shape in shapes]


def run(quick: bool, out_dir: Path | None, progress, dry_run: bool = False) -> dict | None:
    del out_dir  # tables only
    return run_kernels(quick, dry_run, plan, progress)
