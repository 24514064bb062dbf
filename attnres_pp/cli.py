"""`attnres-pp` command line: `prepare`, `train`, `simulate`, `generate`, `export`, `analyze`, `plot`, `bench`.
Each subcommand lives beside its owner and registers itself here, so this file only wires them together.

Only the module of the subcommand being run is imported: `simulate` must start fast and run where
torch is missing, so it never pays for (or needs) the training side's imports.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable

from attnres_pp.cli_flags import ArgumentParser

# (subcommand, module that defines `register(subparsers)`, one-line help for the top-level listing)
SUBCOMMANDS = (
    ("prepare", "attnres_pp.data.prepare", "tokenize text files, folders or .jsonl into a data folder"),
    ("train", "attnres_pp.train.cli", "train a model (single process or pipelined)"),
    ("simulate", "attnres_pp.simulator.cli", "simulate communication volumes and pipeline schedules (no torch needed)"),
    ("generate", "attnres_pp.generate.cli", "generate text from a trained checkpoint (single process or pipelined)"),
    ("export", "attnres_pp.export.cli", "write a trained run as a Hugging Face model folder (transformers)"),
    ("analyze", "attnres_pp.analysis.analyze_cli", "depth-routing diagnostics of a trained checkpoint"),
    ("plot", "attnres_pp.analysis.plot_cli", "loss and val loss against tokens for several runs"),
    ("bench", "attnres_pp.bench.cli", "benchmarks (attnres-pp bench NAME --help for each one's flags)"),
)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The whole parser, or with `argv` given, one in which only the subcommand that `argv` names is
    imported and registered in full (the others are listed for `--help` by name alone)."""
    # Every subcommand's parser is of this class too: a usage error reads `error: ...`, exit 2.
    parser = ArgumentParser(
        prog="attnres-pp",
        description="Pipeline-parallel training of Attention-Residual transformers.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True)
    chosen = None if argv is None else next((a for a in argv if not a.startswith("-")), None)
    for name, module_name, help_text in SUBCOMMANDS:
        if argv is not None and name != chosen:
            subparsers.add_parser(name, help=help_text, add_help=False)
            continue
        importlib.import_module(module_name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv).parse_args(argv)
    return int(args.func(args) or 0)


def console_main(entry: Callable[[], int] | None = None) -> int:
    """The `attnres-pp` console script (or another command's `entry`, `attnres-lab`'s): `main`, and a
    reader that closes the pipe early (`| head`) ends the command quietly, as Unix tools do, instead
    of with a BrokenPipeError traceback."""
    try:
        code = (entry or main)()
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        # Python flushes stdout once more at exit; point it at /dev/null so that flush cannot fail.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a writer killed by a closed pipe


if __name__ == "__main__":
    sys.exit(console_main())
