"""`attnres-pp` command line: `train`, `simulate`, `bench`. Each subcommand lives beside its owner
and registers itself here, so this file only wires them together."""

from __future__ import annotations

import argparse
import importlib
import sys

# (subcommand, module that defines `register(subparsers)`)
SUBCOMMANDS = (
    ("train", "attnres_pp.train.cli"),
    ("simulate", "attnres_pp.simulator.cli"),
    ("bench", "attnres_pp.bench.cli"),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="attnres-pp",
        description="Pipeline-parallel training of Attention-Residual transformers.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True)
    for _name, module_name in SUBCOMMANDS:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            if not module_name.startswith(error.name or "\0"):
                raise  # a missing dependency inside the module, not the module itself
            continue
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
