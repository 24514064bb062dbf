"""`attnres-pp simulate sweep`: the sweeps of `simulator.sweep` (comm against depth, blocks, P and V;
bubble against m and V) as Markdown tables on stdout, with `--out DIR` also NAME.png per sweep."""

from __future__ import annotations

import argparse
import sys

from attnres_pp.cli_flags import refuse
from attnres_pp.out_paths import check_out_dir
from attnres_pp.simulator.cli.flags import non_negative_int, positive_int
from attnres_pp.simulator.comm import DTYPE_BYTES
from attnres_pp.simulator.sweep import SWEEPS, SweepBase, run_sweeps


def register(commands) -> None:
    parser = commands.add_parser("sweep", help="tables and plots: comm vs depth/blocks/P/V, bubble vs m/V")
    parser.add_argument("--only", choices=sorted(SWEEPS), default=None, help="run one family of sweeps")
    parser.add_argument("--out", metavar="DIR", default=None, help="write NAME.png per sweep and sweeps.md")
    parser.add_argument("--layers", type=positive_int, default=64)
    parser.add_argument("--blocks", type=positive_int, default=8, help="blocks = sublayers / block size")
    parser.add_argument("--stages", type=positive_int, default=4)
    parser.add_argument("--virtual", type=positive_int, default=2)
    parser.add_argument("--microbatches", type=positive_int, default=16)
    parser.add_argument("--tokens", type=positive_int, default=4096, help="tokens per microbatch")
    parser.add_argument("--d-model", type=positive_int, default=4096)
    parser.add_argument("--key-rank", type=non_negative_int, default=0, help="extra width of projected low-rank keys")
    parser.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="bf16")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        base = SweepBase(n_layers=args.layers, n_blocks=args.blocks, n_stages=args.stages,
                         n_virtual=args.virtual, n_microbatches=args.microbatches, tokens=args.tokens,
                         d_model=args.d_model, key_rank=args.key_rank, dtype=args.dtype)
        kinds = (args.only,) if args.only else tuple(SWEEPS)
        if args.out:
            check_out_dir(args.out, "--out")
        sweeps = run_sweeps(base, kinds, args.out, progress=lambda line: print(line, file=sys.stderr))
    except ValueError as error:
        return refuse(error, full=True)
    print("\n\n".join(sweep.to_markdown() for sweep in sweeps))
    return 0
