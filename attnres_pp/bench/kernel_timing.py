"""What the kernel benchmarks (`bench kernels`, `bench kernel-streams`) share: the device they run on
(one CUDA GPU, or the Triton interpreter on CPU for the hidden `--dry-run-cpu` logic check), the
timer, the measured copy bandwidth that the rows' GB/s are set against, the rates of a group of
rows, the published kernels' import status, and the Markdown table of the Triton rows.

Rows are dicts with `op`, `name`, `mode`, `impl` ("triton", "torch", "torch.compile"), `ms` (a float,
or a string saying why not), `bytes` (what the op must move) and the shape's fields; `add_rates`
adds `gbps`, `frac_copy_bw` and `speedup_of_triton`.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import os
import statistics
import time
from collections.abc import Callable

import torch

TIME_BUDGET_S = 360  # later measurements are marked "skipped": with one compile in flight, under 8 min

# Guessed import paths of published AttnRes kernels. No adapter is written for them (their call
# signatures are not verified here), so an importable one is reported, not timed.
PEER_MODULES = {
    "flash-attn-res": "flash_attn_res",
    "fast-attnres": "fast_attnres",
    "liger-kernel attn_res": "liger_kernel.ops.attn_res",
    "fla attnres": "fla.ops.attnres",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dry-run-cpu", action="store_true", help=argparse.SUPPRESS)


def run_options(args: argparse.Namespace) -> dict:
    return {"dry_run": args.dry_run_cpu}


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


# The CPU dry run checks the timing code's logic under the Triton interpreter, not speed: one sample.
CPU_SAMPLES = 1


class Timer:
    """Median milliseconds: triton.testing.do_bench on CUDA (it also clears L2 between reps),
    perf_counter on CPU (dry run, CPU_SAMPLES samples)."""

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
            for _ in range(CPU_SAMPLES):
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
    n_bytes = copy_bytes(device)
    src = torch.empty(n_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    return 2 * n_bytes / (ms * 1e-3) / 1e9 if isinstance(ms, float) else float("nan")


def copy_bytes(device: torch.device) -> int:
    return 2**30 if device.type == "cuda" else 2**20


def add_rates(group: list[dict], copy_gbps: float) -> None:
    """Bandwidth, fraction of copy bandwidth, and each implementation's time / Triton's time."""
    triton_ms = next(r["ms"] for r in group if r["impl"] == "triton")
    for row in group:
        timed = isinstance(row["ms"], float)
        row["gbps"] = row["bytes"] / (row["ms"] * 1e-3) / 1e9 if timed else None
        row["frac_copy_bw"] = row["gbps"] / copy_gbps if timed and copy_gbps == copy_gbps else None
        row["speedup_of_triton"] = row["ms"] / triton_ms if timed and isinstance(triton_ms, float) else None


# (shape, measure(shape, device, dtype, timer, copy_gbps) -> rows) for each shape of a run
Plan = list[tuple[object, Callable]]


def run_kernels(quick: bool, dry_run: bool, plan_for: Callable[[str], Plan],
                progress: Callable[[str], None]) -> dict | None:
    """Time every shape of `plan_for(size)` (size "dry-run", "quick" or "full") on the GPU in bf16, or
    for a dry run on CPU tensors in fp32 under the Triton interpreter, which prints its table and
    returns None (a logic check: nothing to write). Without a CUDA device: says so, returns None."""
    if dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernel modules are imported
        device, dtype, size = torch.device("cpu"), torch.float32, "dry-run"
    elif not torch.cuda.is_available():
        print("no CUDA device: nothing measured")
        return None
    else:
        device, dtype, size = torch.device("cuda"), torch.bfloat16, "quick" if quick else "full"

    import triton

    timer = Timer(device, deadline=time.monotonic() + TIME_BUDGET_S)
    copy_gbps = copy_bandwidth_gbps(device, timer)
    rows = []
    for shape, measure_shape in plan_for(size):
        progress(f"measuring {shape.name} ...")
        try:
            rows += measure_shape(shape, device, dtype, timer, copy_gbps)
        except Exception as error:  # one broken shape must not lose the others' figures
            progress(f"  {shape.name}: {type(error).__name__}: {error}")
            if device.type == "cuda":
                torch.cuda.empty_cache()
    meta = dict(
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (interpreter dry run)",
        torch=torch.__version__,
        triton=triton.__version__,
        dtype=str(dtype).removeprefix("torch."),
        copy_gbps=copy_gbps,
        copy_bytes=copy_bytes(device),
        date=datetime.datetime.now().isoformat(timespec="seconds"),
    )
    payload = {"meta": meta, "peers": peer_status(), "rows": rows}
    if dry_run:
        print(to_markdown(payload))
        print("dry run: no results written")
        return None
    return payload


def to_markdown(payload: dict) -> str:
    rows, peers, meta = payload["rows"], payload["peers"], payload["meta"]
    lines = [
        f"# Depth-attention kernels: {meta['device']}",
        "",
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
