"""`attnres-lab NAME [--quick] [--json] [--out DIR] [its own flags]`: the lab's studies, run by the
benchmarks' one harness (`attnres_pp.bench.cli`: the common flags, the results writer, the recorded
`attnres-lab NAME ...` command), and `attnres-lab fit-memory-units`, which writes the simulator's
activation units.

    fidelity          the simulator, calibrated on one run, predicts held-out runs (`--hosts`: over
                      real links between network-namespace hosts; `--tp`: tensor-parallel runs)
    memory-predict    the simulator's per-rank memory against what real steps hold
    chaos             seeded fault injection over the launchers, each trial classified (clean, hang,
                      misleading line, traceback, leak, checkpoint lost)
    fit-memory-units  fit `attnres_pp/simulator/memory_units.json` on tiny chunks

The several-hosts harness is a command of its own: `python -m attnres_lab.netns_cluster`.
"""

from __future__ import annotations

import argparse
import sys

from attnres_pp.bench.cli import Benchmark, BenchmarkParser, Sibling, Suite, add_benchmarks
from attnres_pp.cli_flags import ArgumentParser

REGISTRY = {
    "fidelity": Benchmark("fidelity", "the simulator, calibrated on one run, predicts held-out runs (schedule, V, "
                                      "m, mode, layers, link)",
                          siblings=(Sibling("--hosts", "fidelity_hosts", "over real links between hosts (network "
                                            "namespaces, tc; needs root; results fidelity_hosts_<date>)"),
                                    Sibling("--tp", "fidelity_tp", "runs of T = 2 tensor-parallel ranks, with and "
                                            "without sequence parallelism, priced by the simulator's tp terms on "
                                            "probed collectives (results fidelity_tp_<date>)"))),
    "memory-predict": Benchmark("memory_predict", "the simulator's per-rank memory prediction against real runs' "
                                                  "memory_per_rank, on cases the units were not fitted on",
                                siblings=(Sibling("--moe", "memory_predict_moe", "mixtures of experts at EP = 1 "
                                                  "and 2, D = 2, P = 1 and 2, AC none and full (results "
                                                  "memory_predict_moe_<date>)"),)),
    "chaos": Benchmark("chaos", "seeded faults over the launchers (kills, a frozen rank, a full disk, a torn log, "
                                "signals to the driver): trials, clean, hangs, misleading lines, tracebacks, leaks, "
                                "checkpoints lost"),
}
SUITE = Suite(REGISTRY, "attnres_lab", ("attnres-lab",))


def _fit_memory_units(args: argparse.Namespace) -> int:
    from attnres_lab.memory_units import run_fit  # torch: imported only when the fit runs

    return run_fit(args)


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="attnres-lab",
                            description="What measures and calibrates attnres-pp: fidelity studies of the simulator "
                                        "and the fitting of its units. Results go to benchmarks/results/ under the "
                                        "working directory (or --out DIR).")
    studies = parser.add_subparsers(dest="name", required=True, metavar="NAME", parser_class=BenchmarkParser)
    parsers = add_benchmarks(studies, SUITE)
    fit = studies.add_parser("fit-memory-units", help="fit the simulator's activation memory units on tiny chunks",
                             description="fit-memory-units: measure what tiny chunks save for backward and fit the "
                                         "simulator's activation units (writes --out, 10-15 min on 2 cores).")
    fit.siblings = parsers
    fit.add_argument("--out", required=True, help="the JSON to write (attnres_pp/simulator/memory_units.json)")
    fit.add_argument("--cases", type=int, default=80, help="tiny chunks measured per variant and dtype")
    fit.add_argument("--checkpoint-cases", type=int, default=200,
                     help="tiny chunks measured per variant, dtype and checkpointing policy")
    fit.set_defaults(func=_fit_memory_units)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else list(argv))
    return int(args.func(args) or 0)


def console_main() -> int:
    """The `attnres-lab` console script."""
    from attnres_pp.cli import console_main as run_console

    return run_console(main)
