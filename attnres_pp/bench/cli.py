"""`attnres-pp bench bubbles | comm | overhead | peer | split | inference | memory | fidelity | variants [--quick]
[--json] [--out DIR]` (`--compile`: variants only).

Each benchmark prints its table (or, with --json, one JSON object on stdout; progress goes to
stderr) and writes NAME[_quick]_<date>.json and .md under --out (default: the checkout's
benchmarks/results/), and its pictures and traces in the folder NAME[_quick]_<date>/ beside them.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from pathlib import Path

BENCHMARKS = {
    "bubbles": "measured pipeline bubbles per schedule vs the calibrated simulator and the closed form",
    "comm": "bytes and time per step: standard / Full naive / Block naive / Block cached",
    "overhead": "step time of Block AttnRes with the cache vs the standard residual, same pipeline",
    "peer": "our runtime vs torch.distributed.pipelining (Schedule1F1B, ScheduleInterleaved1F1B, "
            "ScheduleInterleavedZeroBubble)",
    "split": "the backward split in I and W against the fused backward B, per chunk",
    "inference": "generation: prefill tokens/s and decode latency, Block AttnRes vs standard, 1 process and P=2 V=2",
    "memory": "peak resident memory per pipeline rank (rank-local chunks), 32 layers d = 512 at P = 1, 2, 4",
    "fidelity": "the simulator, calibrated on one run, predicts held-out runs (schedule, V, m, mode, layers, link)",
    "variants": "step time of every residual variant over the standard one, one process and P=2 V=2, two shapes",
}


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "bench", help="benchmarks: bubbles, comm, overhead, peer, split, inference, memory, fidelity, variants",
        description="Benchmarks of the real pipeline (local launcher, gloo, one thread per rank). "
                    + " ".join(f"{name}: {text}." for name, text in BENCHMARKS.items()))
    parser.add_argument("name", choices=sorted(BENCHMARKS), help="which benchmark")
    parser.add_argument("--quick", action="store_true", help="the short version (all four: under 10 min on 2 cores)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    parser.add_argument("--out", metavar="DIR", default=None,
                        help="where results go (default: benchmarks/results/ of the checkout)")
    parser.add_argument("--hosts", action="store_true",
                        help="fidelity only: over real links between hosts (network namespaces, tc; needs root)")
    parser.add_argument("--no-timing", action="store_true",
                        help="comm only: count and predict bytes, skip the multi-process timing runs")
    parser.add_argument("--predict", action="store_true",
                        help="memory only: the simulator's per-rank prediction against real runs' memory_per_rank")
    parser.add_argument("--compile", action="store_true",
                        help="variants only: also time every variant with its sublayers torch.compile'd")
    parser.set_defaults(func=run_benchmark, parser=parser)


def run_benchmark(args: argparse.Namespace) -> int:
    from attnres_pp.bench.common import (
        command_line,
        default_out_dir,
        machine,
        machine_line,
        results_stem,
        write_results,
    )
    from attnres_pp.out_paths import check_out_dir

    if args.no_timing and args.name != "comm":
        print(f"{args.parser.prog}: error: --no-timing applies to comm only", file=sys.stderr)
        return 2
    if args.predict and args.name != "memory":
        print(f"{args.parser.prog}: error: --predict applies to memory only", file=sys.stderr)
        return 2
    if args.compile and args.name != "variants":
        print(f"{args.parser.prog}: error: --compile applies to variants only", file=sys.stderr)
        return 2
    if args.hosts and args.name != "fidelity":
        print(f"{args.parser.prog}: error: --hosts applies to fidelity only", file=sys.stderr)
        return 2
    out_dir = Path(args.out) if args.out else default_out_dir()
    try:  # before the benchmark runs for minutes and then cannot write its results
        check_out_dir(out_dir, "--out")
    except ValueError as error:
        print(f"{args.parser.prog}: error: {error}", file=sys.stderr)
        return 2
    name = "memory_predict" if args.predict else args.name
    module = importlib.import_module(f"attnres_pp.bench.{name}")
    out_dir.mkdir(parents=True, exist_ok=True)

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    info = machine()
    progress(f"bench {args.name}{' --quick' if args.quick else ''} on {machine_line(info)}")
    started = time.perf_counter()
    # --compile results sit beside the eager-only run's of the same day, never over them.
    stem = results_stem(name + ("_hosts" if args.hosts else "") + ("_compile" if args.compile else ""), args.quick)
    options = {"timing": not args.no_timing} if args.name == "comm" else {}
    if args.name == "variants":
        options = {"compile_model": args.compile}
    if args.hosts:
        options = {"hosts": True}
    # Pictures and traces go to a folder named like the result files (STEM/), linked from STEM.md.
    payload = module.run(args.quick, out_dir / stem, progress, **options)
    command = (command_line(args.name, args.quick, args.out) + (" --no-timing" if args.no_timing else "")
               + (" --predict" if args.predict else "") + (" --compile" if args.compile else "")
               + (" --hosts" if args.hosts else ""))
    payload = {"benchmark": args.name, "quick": args.quick, **payload, "machine": info, "command": command,
               "elapsed_s": time.perf_counter() - started}
    markdown = "\n".join([module.to_markdown(payload), "",
                          f"Command: `{command}` ({payload['elapsed_s']:.0f} s).  ",
                          f"Machine: {machine_line(info)}."])
    paths = write_results(out_dir, stem, payload, markdown)
    progress(f"wrote {', '.join(str(p) for p in paths)} in {payload['elapsed_s']:.0f} s")
    # The written file is strict JSON (non-finite floats became null): print that.
    print(json.dumps(json.loads(paths[0].read_text())) if args.json else markdown)
    return 0
