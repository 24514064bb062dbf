"""Benchmark the Triton depth-attention ops (phase 1, phase 2 and the fused MSAR stream kernel,
forward and forward+backward) on one CUDA GPU against the torch backend, torch.compile of the torch
backend, and published AttnRes kernels where importable.

    python benchmarks/bench_kernels.py            # full shape set, bf16 (under 8 minutes on one H200)
    python benchmarks/bench_kernels.py --quick    # two small shapes

Reports the median time, the achieved bandwidth (bytes the op must move / time) next to a measured
device-to-device copy bandwidth, a max-abs-error spot check against the torch backend, and the
speedups; writes benchmarks/results/kernels_<date>.json and .md with the exact command line.
Without a CUDA device it says so and exits 0 without writing anything. The hidden --dry-run-cpu
runs the whole timing path on CPU tensors under the Triton interpreter with a tiny shape, prints
the table and writes no files (a logic check for machines without a GPU).
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from bench_kernels_streams import (
    DRY_RUN_STREAM_SHAPES,
    FULL_STREAM_SHAPES,
    QUICK_STREAM_SHAPES,
    measure_stream_shape,
)

RESULTS_DIR = Path(__file__).resolve().parent / "results"
TIME_BUDGET_S = 360  # later measurements are marked "skipped": with one compile in flight, under 8 min


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

# Guessed import paths of published AttnRes kernels. No adapter is written for them (their call
# signatures are not verified here), so an importable one is reported, not timed.
PEER_MODULES = {
    "flash-attn-res": "flash_attn_res",
    "fast-attnres": "fast_attnres",
    "liger-kernel attn_res": "liger_kernel.ops.attn_res",
    "fla attnres": "fla.ops.attnres",
}


def peer_status() -> dict[str, str]:
    status = {}
    for label, module in PEER_MODULES.items():
        try:
            importlib.import_module(module)
        except Exception:  # ImportError, or a broken install: never fail the benchmark for a peer
            status[label] = "n/a (not importable)"
        else:
            status[label] = "n/a (importable; no verified adapter)"
    return status


class Timer:
    """Median milliseconds: triton.testing.do_bench on CUDA (it also clears L2 between reps),
    perf_counter on CPU (dry run)."""

    def __init__(self, device: torch.device, deadline: float):
        self.device, self.deadline = device, deadline

    def __call__(self, fn, leaves=()) -> float | str:
        if time.monotonic() > self.deadline:
            return "skipped (time budget)"
        try:
            if self.device.type == "cuda":
                import triton.testing

                return float(triton.testing.do_bench(fn, warmup=10, rep=60, grad_to_none=list(leaves),
                                                     return_mode="median"))  # fmt: skip
            samples = []
            for _ in range(3):
                for leaf in leaves:
                    leaf.grad = None
                start = time.perf_counter()
                fn()
                samples.append((time.perf_counter() - start) * 1e3)
            return statistics.median(samples)
        except Exception as error:  # OOM or a compile failure: record it and carry on
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            return f"error: {type(error).__name__}"


def copy_bandwidth_gbps(device: torch.device, timer: Timer) -> float:
    """Device-to-device copy bandwidth (read + write) of a large tensor.copy_, in GB/s."""
    n_bytes = 2**30 if device.type == "cuda" else 2**20
    src = torch.empty(n_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    return 2 * n_bytes / (ms * 1e-3) / 1e9 if isinstance(ms, float) else float("nan")


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
            _add_rates(group, copy_gbps)
            rows += group
            del call1, leaves1, call2, leaves2, runs, reference, grads
    return rows


def _add_rates(group, copy_gbps):
    """Bandwidth, fraction of copy bandwidth, and each implementation's time / Triton's time."""
    triton_ms = next(r["ms"] for r in group if r["impl"] == "triton")
    for row in group:
        timed = isinstance(row["ms"], float)
        row["gbps"] = row["bytes"] / (row["ms"] * 1e-3) / 1e9 if timed else None
        row["frac_copy_bw"] = row["gbps"] / copy_gbps if timed and copy_gbps == copy_gbps else None
        row["speedup_of_triton"] = row["ms"] / triton_ms if timed and isinstance(triton_ms, float) else None


def markdown(rows, peers, meta) -> str:
    lines = [
        f"# Depth-attention kernels: {meta['device']}",
        "",
        f"Command: `{meta['command']}`  ",
        f"torch {meta['torch']}, triton {meta['triton']}, {meta['dtype']}, copy bandwidth "
        f"{meta['copy_gbps']:.0f} GB/s (read + write of a {meta['copy_bytes']} B tensor.copy_).  ",
        "Speedup = other implementation's median time / Triton's. Bandwidth = bytes the op must move / time.",
        "",
        "| op | shape | N | T | d | S | keys | mode | Triton ms | GB/s | % copy BW | vs torch | vs compile "
        "| max err vs torch |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def fmt(x, spec):
        return format(x, spec) if isinstance(x, float) else (x if isinstance(x, str) else "n/a")

    for row in (r for r in rows if r["impl"] == "triton"):
        others = {r["impl"]: r for r in rows if r["op"] == row["op"] and r["mode"] == row["mode"]
                  and r["name"] == row["name"]}  # fmt: skip
        keys = row["key_mode"] + (f" r={row['rank']}" if row["rank"] else "")
        frac = row["frac_copy_bw"] * 100 if row["frac_copy_bw"] is not None else None
        lines.append(
            f"| {row['op']} | {row['name']} | {row['n_sources']} | {row['n_tokens']} | {row['width_d']} "
            f"| {row['n_queries']} | {keys} | {row['mode']} | {fmt(row['ms'], '.3f')} "
            f"| {fmt(row['gbps'], '.0f')} | {fmt(frac, '.0f')} "
            f"| {fmt(others['torch']['speedup_of_triton'], '.2f')} "
            f"| {fmt(others['torch.compile']['speedup_of_triton'], '.2f')} "
            f"| {fmt(row['max_abs_err_vs_torch'], '.2e')} |"
        )
    lines += ["", "Published kernels: " + "; ".join(f"{k}: {v}" for k, v in peers.items()), ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="two small shapes instead of the full set")
    parser.add_argument("--dry-run-cpu", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    command = "python " + " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:])

    if args.dry_run_cpu:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernel modules are imported
        device, dtype, shapes = torch.device("cpu"), torch.float32, DRY_RUN_SHAPES
        stream_shapes = DRY_RUN_STREAM_SHAPES
    elif not torch.cuda.is_available():
        print("no CUDA device: nothing measured")
        return 0
    else:
        device, dtype = torch.device("cuda"), torch.bfloat16
        shapes = QUICK_SHAPES if args.quick else FULL_SHAPES
        stream_shapes = QUICK_STREAM_SHAPES if args.quick else FULL_STREAM_SHAPES

    import triton

    timer = Timer(device, deadline=time.monotonic() + TIME_BUDGET_S)
    copy_gbps = copy_bandwidth_gbps(device, timer)
    impls = implementations(device)
    rows = []
    measures = [(shape, lambda shape: measure_shape(shape, impls, device, dtype, timer, copy_gbps)) for shape in shapes]
    measures += [(shape, lambda shape: measure_stream_shape(shape, device, dtype, timer, copy_gbps, _add_rates))
                 for shape in stream_shapes]
    for shape, measure in measures:
        print(f"measuring {shape.name} ...", flush=True)
        try:
            rows += measure(shape)
        except Exception as error:  # one broken shape must not lose the others' figures
            print(f"  {shape.name}: {type(error).__name__}: {error}", flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    peers = peer_status()
    meta = dict(
        command=command,
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (interpreter dry run)",
        torch=torch.__version__,
        triton=triton.__version__,
        dtype=str(dtype).removeprefix("torch."),
        copy_gbps=copy_gbps,
        copy_bytes=2**30 if device.type == "cuda" else 2**20,
        date=datetime.datetime.now().isoformat(timespec="seconds"),
    )
    table = markdown(rows, peers, meta)
    print(table)
    if args.dry_run_cpu:
        print("dry run: no results written")
        return 0
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    stem = RESULTS_DIR / f"kernels_{datetime.date.today().isoformat()}"
    stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "peers": peers, "rows": rows}, indent=2))
    stem.with_suffix(".md").write_text(table)
    print(f"wrote {stem}.json and {stem}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
