"""`attnres-pp bench NAME [--quick] [--json] [--out DIR] [its own flags]`: the registry of benchmarks
and the one harness that runs each of them.

REGISTRY names every benchmark, its module (in this package) and its one-line help; a `Suite` is such a
registry with its package and the command that runs it (`attnres-pp bench` here; the measurement lab,
`attnres_lab.cli`, runs its studies through the same harness). `bench NAME` has a
parser of its own: the common flags (`--quick` where the benchmark has a short version, `--json`,
`--out DIR`) and what the module's `add_arguments(parser)` declares, so a flag exists only where it
applies and argparse refuses it elsewhere. A `siblings` flag of the registry picks another module to
run under the same name (`attnres-lab fidelity --hosts` runs `fidelity_hosts`); two of them at once are
refused.
A benchmark module provides

    run(quick, pictures_dir, progress, **options) -> dict | None   (None: nothing to write)
    to_markdown(payload) -> str

and, where it needs them,

    add_arguments(parser)          its own flags
    run_options(args) -> dict      the keyword arguments of `run` that its flags give
    check(args) -> str | None      why the flags' values are refused, before anything runs
    results_stem(args) -> str      the stem of its results files (default MODULE[_quick]_<date>)

Every benchmark prints its table (or, with --json, one JSON object on stdout; progress goes to
stderr) and writes STEM.json and STEM.md under --out (default: benchmarks/results/ under the working
directory) through `common.write_results`, with the machine and the `attnres-pp bench NAME ...` command
that ran it; its pictures and traces go in the folder STEM/ beside them.

A benchmark's module is imported only when its parser is looked up (to parse, or to show its
--help): `bench kernels` runs on a GPU machine that has torch and Triton but no Ray.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from attnres_pp.cli_flags import ArgumentParser, refuse


@dataclass(frozen=True)
class Sibling:
    flag: str
    module: str  # under the suite's package
    help: str


@dataclass(frozen=True)
class Benchmark:
    module: str  # under the suite's package
    help: str
    quick: bool = True  # has a short version (--quick)
    out_aliases: tuple[str, ...] = ()  # older spellings of --out that the benchmark still takes
    siblings: tuple[Sibling, ...] = ()  # flags that run another module instead (its results under its name)


REGISTRY = {
    "bubbles": Benchmark("bubbles", "measured pipeline bubbles per schedule vs the calibrated simulator and the "
                                    "closed form"),
    "comm": Benchmark("comm", "bytes and time per step: standard / Full naive / Block naive / Block cached"),
    "overhead": Benchmark("overhead", "step time of Block AttnRes with the cache vs the standard residual, same "
                                      "pipeline"),
    "peer": Benchmark("peer", "our runtime vs torch.distributed.pipelining (Schedule1F1B, ScheduleInterleaved1F1B, "
                              "ScheduleInterleavedZeroBubble)"),
    "checkpoint": Benchmark("checkpoint", "what a checkpoint save costs the training loop: blocking against "
                                          "--async-checkpoint (step time while a save runs, against none)"),
    "recovery": Benchmark("recovery", "a lost rank at D = 2, P = 2: --fault-tolerance replicas (torchft) against "
                                      "the restart from the last checkpoint, seconds to the next committed steps"),
    "split": Benchmark("split", "the backward split in I and W against the fused backward B, per chunk"),
    "data": Benchmark("data", "what reading batches from a data folder's memory-mapped shards adds to a training "
                              "step, against an in-memory array"),
    "inference": Benchmark("inference", "generation: prefill tokens/s and decode latency, Block AttnRes vs "
                                        "standard, 1 process and P=2 V=2"),
    "memory": Benchmark("memory", "peak resident memory per pipeline rank (rank-local chunks), 32 layers d = 512 "
                                  "at P = 1, 2, 4, and the counted memory_per_rank over D x dp_shard x AC x schedule"),
    "variants": Benchmark("variants", "step time of every residual variant over the standard one, one process "
                                      "and P=2 V=2, two shapes"),
    "moe": Benchmark("moe", "step time of a mixture-of-experts model against the dense model of equal active "
                            "parameters, and the experts' grouped matmul against its per-expert loop"),
    "quality": Benchmark("quality", "validation loss of every residual variant at an equal token budget (single "
                                    "process, built-in corpus)", out_aliases=("--out-dir",)),
    "quality-depth": Benchmark("quality_depth", "held-out loss at depth (12 layers, d 48) over paired seeds, and "
                                                "the Block run's routing", quick=False, out_aliases=("--out-dir",)),
    "cli-parity": Benchmark("cli_parity", "through the CLI, pipelined training (P=2, V=2) against the "
                                          "single-process losses, every variant", quick=False),
    "prepare": Benchmark("prepare", "attnres-pp prepare's throughput: BPE training and encode MB/s on a synthetic "
                                    "corpus"),
    "kernels": Benchmark("kernels", "the Triton depth-attention kernels against the torch backend and "
                                    "torch.compile of it (one CUDA GPU)"),
    "kernel-streams": Benchmark("kernel_streams", "the fused MSAR stream kernel alone against its torch twin "
                                                  "and torch.compile of it (one CUDA GPU)"),
}


@dataclass(frozen=True)
class Suite:
    """Benchmarks run by one harness: their registry, the package of their modules, and the command
    that runs them (recorded with every result)."""

    registry: dict[str, Benchmark]
    package: str
    command: tuple[str, ...]

    def module(self, module: str) -> ModuleType:
        return importlib.import_module(f"{self.package}.{module}")

    def module_of(self, name: str) -> ModuleType:
        return self.module(self.registry[name].module)


SUITE = Suite(REGISTRY, "attnres_pp.bench", ("attnres-pp", "bench"))


def module_of(name: str) -> ModuleType:
    return SUITE.module_of(name)


class BenchmarkParser(ArgumentParser):
    """A benchmark's parser: refuses what it does not know itself (argparse would leave unknown flags
    to the top-level parser), naming the benchmarks that have the flag, in the one refusal style."""

    siblings: _Parsers  # every benchmark's parser, this one's included

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            flag = extras[0].split("=", 1)[0]
            owners = [name for name in self.siblings.suite.registry if flag in self.siblings.flags_of(name)]
            hint = f"; {flag} applies to {', '.join(owners)} only" if owners else ""
            self.error(f"unrecognized arguments: {' '.join(extras)}{hint}")
        return namespace, extras


class _Parsers(dict):
    """Benchmark name -> its parser. A benchmark's own flags are declared the first time its parser
    is looked up (to parse, or by a reader of the parser), so only that benchmark's module is imported."""

    def __init__(self, suite: Suite) -> None:
        super().__init__()
        self.suite = suite
        self.declared: set[str] = set()

    def __getitem__(self, name: str) -> argparse.ArgumentParser:
        parser = super().__getitem__(name)
        if name in self.suite.registry and name not in self.declared:
            self.declared.add(name)
            add_arguments = getattr(self.suite.module_of(name), "add_arguments", None)
            if add_arguments is not None:
                add_arguments(parser)
        return parser

    def flags_of(self, name: str) -> set[str]:
        try:
            return set(self[name]._option_string_actions)
        except ImportError:  # a benchmark whose module cannot load here has no flags here
            return set()


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "bench", help="benchmarks: " + ", ".join(REGISTRY),
        description="Benchmarks of the real pipeline, the model and the kernels; `attnres-pp bench NAME --help` "
                    "shows a benchmark's own flags. Results go to benchmarks/results/ under the working "
                    "directory (or --out DIR).")
    benchmarks = parser.add_subparsers(dest="name", required=True, metavar="NAME", parser_class=BenchmarkParser)
    add_benchmarks(benchmarks, SUITE)


def add_benchmarks(benchmarks: argparse._SubParsersAction, suite: Suite) -> _Parsers:
    """One parser per benchmark of `suite` under `benchmarks` (made with `parser_class=BenchmarkParser`);
    returns the map of them, where a caller may add parsers of its own."""
    parsers = _Parsers(suite)
    benchmarks._name_parser_map = benchmarks.choices = parsers  # argparse looks parsers up in this map
    for name, bench in suite.registry.items():
        sub = benchmarks.add_parser(name, help=bench.help, description=f"{name}: {bench.help}.")
        sub.siblings = parsers
        if bench.quick:
            sub.add_argument("--quick", action="store_true", help="the short version")
        sub.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
        sub.add_argument("--out", *bench.out_aliases, metavar="DIR", default=None,
                         help="where results go (default: benchmarks/results/ under the working directory)")
        for sibling in bench.siblings:
            sub.add_argument(sibling.flag, action="store_true", help=sibling.help)
        sub.set_defaults(func=run_benchmark, parser=sub, quick=False, suite=suite)
    return parsers


def recorded_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The flags of `args` that differ from `parser`'s defaults, in declaration order (--json aside:
    how a result is printed is not how it was measured)."""
    flags = []
    for action in parser._actions:
        if not action.option_strings or action.dest in ("help", "json"):
            continue
        value = getattr(args, action.dest, action.default)
        if value == action.default:
            continue
        flag = action.option_strings[0]
        flags += [flag] if action.nargs == 0 else [flag, str(value)]
    return flags


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

    parser, suite = args.parser, args.suite
    picked = [s for s in suite.registry[args.name].siblings if getattr(args, s.flag[2:].replace("-", "_"))]
    if len(picked) > 1:
        return refuse(f"{' and '.join(s.flag for s in picked)} each pick another benchmark: give one of them")
    module = suite.module(picked[0].module) if picked else suite.module_of(args.name)
    problem = module.check(args) if hasattr(module, "check") else None
    if problem:
        return refuse(problem)
    out_dir = Path(args.out) if args.out else default_out_dir()
    try:  # before the benchmark runs for minutes and then cannot write its results
        check_out_dir(out_dir, "--out")
    except ValueError as error:
        return refuse(str(error))
    out_dir.mkdir(parents=True, exist_ok=True)

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    info = machine()
    progress(f"bench {args.name}{' --quick' if args.quick else ''} on {machine_line(info)}")
    started = time.perf_counter()
    stem = (module.results_stem(args) if hasattr(module, "results_stem")
            else results_stem(module.__name__.rsplit(".", 1)[1], args.quick))
    options = module.run_options(args) if hasattr(module, "run_options") else {}
    # Pictures and traces go to a folder named like the result files (STEM/), linked from STEM.md.
    payload = module.run(args.quick, out_dir / stem, progress, **options)
    if payload is None:  # the benchmark measured nothing here (no GPU) or was a dry run: it said so
        return 0
    command = command_line(args.name, recorded_flags(parser, args), suite.command)
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
