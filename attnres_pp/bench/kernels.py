"""`attnres-pp bench kernels [--quick]`: the Triton depth-attention ops (phase 1, phase 2 and the
fused MSAR stream kernel, forward and forward+backward) on one CUDA GPU against the torch backend,
torch.compile of the torch backend, and published AttnRes kernels where importable.

The full shape set runs in bf16 in under 8 minutes on one H200; `--quick` takes two small shapes
(and the stream kernel's quick shape). Reports the median time, the achieved bandwidth (bytes the op
must move / time) next to a measured device-to-device copy bandwidth, a max-abs-error spot check
against the torch backend, and the speedups (`bench.kernel_timing`); writes kernels[_quick]_<date>.json
and .md. Without a CUDA device it says so and exits 0 without writing anything. The hidden
`--dry-run-cpu` runs the whole timing path on CPU tensors under the Triton interpreter with tiny
shapes, prints the table and writes no files (a logic check for machines without a GPU).

Imports torch and, when it measures, the kernels: never Ray (scripts/gpu_check.sh runs it on a GPU
machine without it).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from attnres_pp.bench import kernel_streams

# add_arguments, run_options and to_markdown are this benchmark's hooks for the harness (bench/cli.py),
# the same for both kernel benchmarks.
from attnres_pp.bench.kernel_timing import add_arguments, add_rates, run_kernels, run_options, to_markdown  # noqa: F401


@dataclass(frozen=True)
class Shape:
    name: str
    n_sources: int  # N completed sources
    n_tokens: int  # T
    width_d: int  # d
    n_queries: int  # S
    key_mode: str  # "values" (k = d), "projected" (own [N, T, r] keys) or "sliced" (view, k = r)
    rank: int = 0

    @property
    def width_k(self) -> int:
        return self.width_d if self.key_mode == "values" else self.rank


FULL_SHAPES = [
    Shape("block d=7168", 8, 16384, 7168, 4, "values"),
    Shape("many tokens", 16, 65536, 1024, 8, "values"),
    Shape("projected r=64", 8, 32768, 4096, 2, "projected", 64),
    Shape("sliced r=128", 12, 32768, 2048, 4, "sliced", 128),
]
QUICK_SHAPES = [
    Shape("quick", 4, 8192, 1024, 2, "values"),
    Shape("quick sliced r=64", 4, 8192, 1024, 2, "sliced", 64),
]
DRY_RUN_SHAPES = [
    Shape("dry-run", 2, 5, 12, 2, "values"),
    Shape("dry-run projected", 2, 5, 12, 2, "projected", 4),
    Shape("dry-run sliced", 2, 5, 12, 2, "sliced", 4),
]

def phase1_bytes(shape: Shape, elem: int, backward: bool) -> int:
    """Bytes phase 1 must move: read values (+ separate keys), write out and lse; the backward reads
    values, keys, dout, lse, dlse and writes dvalues (+ dkeys)."""
    n, t, d, s = shape.n_sources, shape.n_tokens, shape.width_d, shape.n_queries
    keys = n * t * shape.rank * elem if shape.key_mode == "projected" else 0
    forward = n * t * d * elem + keys + s * t * d * elem + s * t * 4
    if not backward:
        return forward
    return forward + (n * t * d * elem + keys + s * t * d * elem + 2 * s * t * 4) + (n * t * d * elem + keys)


def phase2_bytes(shape: Shape, elem: int, backward: bool) -> int:
    """Read out1, partial (+ key), lse1, write h; the backward reads them and dh, writes their grads."""
    t, d = shape.n_tokens, shape.width_d
    key = t * shape.rank * elem if shape.key_mode == "projected" else 0
    forward = 3 * t * d * elem + key + t * 4
    return forward + ((3 * t * d * elem + key + t * 4) + (2 * t * d * elem + key + t * 4) if backward else 0)


def make_inputs(shape: Shape, device, dtype, requires_grad: bool):
    """Phase-1 and phase-2 argument lists (leaves first) for one shape."""
    t, d, k = shape.n_tokens, shape.width_d, shape.width_k

    def leaf(*size, scale=1.0, leaf_dtype=dtype):
        return (torch.randn(*size, device=device, dtype=leaf_dtype) * scale).requires_grad_(requires_grad)

    values = leaf(shape.n_sources, t, d)
    queries = leaf(shape.n_queries, k, scale=0.1)
    keys = leaf(shape.n_sources, t, k) if shape.key_mode == "projected" else None
    leaves1 = [x for x in (values, queries, keys) if x is not None]
    out1, lse1, partial, query = leaf(t, d), leaf(t, leaf_dtype=torch.float32), leaf(t, d), leaf(k, scale=0.1)
    partial_key = leaf(t, k) if shape.key_mode == "projected" else None
    leaves2 = [x for x in (out1, lse1, partial, query, partial_key) if x is not None]

    def keys_of(v):  # sliced keys are built inside the timed call: a view, never a copy
        return v[..., d - shape.rank :] if shape.key_mode == "sliced" else keys

    def key_of(p):
        return p[:, d - shape.rank :] if shape.key_mode == "sliced" else partial_key

    call1 = (values, queries, keys_of)
    call2 = (out1, lse1, partial, query, key_of)
    return call1, leaves1, call2, leaves2


def implementations(device: torch.device):
    """name -> (phase1(values, queries, keys), phase2(out1, lse1, partial, query, key))."""
    from attnres_pp.kernels import phase1_torch, phase2_torch, triton_ops

    compile_kwargs = {"backend": "aot_eager"} if device.type == "cpu" else {}
    # One static-shape graph per shape, mode and key variant: keep dynamo from giving up (it falls
    # back to eager silently after its recompile limit).
    for limit in ("cache_size_limit", "recompile_limit"):
        if hasattr(torch._dynamo.config, limit):
            setattr(torch._dynamo.config, limit, 64)
    return {
        "triton": (
            lambda v, q, k: triton_ops.phase1(v, q, keys=k),
            lambda o, lse, p, q, k: triton_ops.phase2(o, lse, p, q, partial_key=k),
        ),
        "torch": (phase1_torch, phase2_torch),
        "torch.compile": (
            torch.compile(phase1_torch, dynamic=False, **compile_kwargs),
            torch.compile(phase2_torch, dynamic=False, **compile_kwargs),
        ),
    }


def _as_list(outputs):
    return list(outputs) if isinstance(outputs, tuple) else [outputs]


def _outputs_and_grads(run, leaves, grads):
    """Detached outputs of one call (plus the leaves' gradients when `grads` is given)."""
    for leaf in leaves:
        leaf.grad = None
    outputs = run()
    if grads is not None:
        torch.autograd.backward(outputs, grads)
        outputs = outputs + [leaf.grad for leaf in leaves]
    return [x.detach() for x in outputs]


def _max_abs_err(run, leaves, grads, reference):
    if reference is None:
        return None
    try:
        got = _outputs_and_grads(run, leaves, grads)
    except Exception as error:
        return f"error: {type(error).__name__}"
    return max((a.float() - b.float()).abs().max().item() for a, b in zip(got, reference, strict=True))


def _output_grads(shape: Shape, op_index: int, device, dtype):
    """Random gradients for (out [S, T, d], lse [S, T] fp32) or h [T, d]."""
    t, d = shape.n_tokens, shape.width_d
    if op_index == 0:
        s = shape.n_queries
        return [torch.randn(s, t, d, device=device, dtype=dtype), torch.randn(s, t, device=device)]
    return [torch.randn(t, d, device=device, dtype=dtype)]


def _bind(fn, tensors, key_fn, keys_from):
    """A no-argument call of one implementation; the key (a view for sliced keys) is made inside."""
    return lambda: _as_list(fn(*tensors, key_fn(keys_from)))


def _training_step(run, grads):
    return lambda: torch.autograd.backward(run(), grads)


def _inference_step(run):
    def step():
        with torch.no_grad():
            run()

    return step


def measure_shape(shape, impls, device, dtype, timer, copy_gbps):
    """Rows for one shape: per op, mode and implementation the time, bandwidth and error vs torch."""
    elem = torch.finfo(dtype).bits // 8
    rows = []
    for op_index, (op, byte_count) in enumerate((("phase1", phase1_bytes), ("phase2", phase2_bytes))):
        for backward in (False, True):
            call1, leaves1, call2, leaves2 = make_inputs(shape, device, dtype, requires_grad=backward)
            (*tensors, key_fn), leaves = (call1, leaves1) if op_index == 0 else (call2, leaves2)
            keys_from = tensors[0] if op_index == 0 else tensors[2]
            runs = {name: _bind(fns[op_index], tensors, key_fn, keys_from) for name, fns in impls.items()}
            grads = _output_grads(shape, op_index, device, dtype) if backward else None
            try:  # the torch backend is the reference for the error column
                reference = _outputs_and_grads(runs["torch"], leaves, grads)
            except Exception:
                reference = None
            group = []
            for name, run in runs.items():
                step = _training_step(run, grads) if backward else _inference_step(run)
                err = _max_abs_err(run, leaves, grads, reference) if time.monotonic() < timer.deadline else None
                ms = timer(step, leaves if backward else ())
                group.append(dict(op=op, mode="fwd+bwd" if backward else "fwd", impl=name, ms=ms,
                                  bytes=byte_count(shape, elem, backward), max_abs_err_vs_torch=err,
                                  **asdict(shape)))  # fmt: skip
            add_rates(group, copy_gbps)
            rows += group
            del call1, leaves1, call2, leaves2, runs, reference, grads
    return rows


def plan(size: str) -> list:
    """(shape, measure) for every phase-1/phase-2 shape of `size`, then the stream kernel's."""
    shapes = {"dry-run": DRY_RUN_SHAPES, "quick": QUICK_SHAPES, "full": FULL_SHAPES}[size]
    state = {}

    def measure(shape, device, dtype, timer, copy_gbps):
        if "impls" not in state:  # one set of compiled functions for every shape
            state["impls"] = implementations(device)
        return measure_shape(shape, state["impls"], device, dtype, timer, copy_gbps)

    return [(shape, measure) for shape in shapes] + kernel_streams.plan(size)


def run(quick: bool, out_dir: Path | None, progress, dry_run: bool = False) -> dict | None:
    del out_dir  # tables only
    return run_kernels(quick, dry_run, plan, progress)
