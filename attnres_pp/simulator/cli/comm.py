"""`attnres-pp simulate comm`: flags -> ModelConfig and a partition -> the tensors and bytes of each
hop for the four payload modes (`simulator.comm`), as a table or one JSON object."""

from __future__ import annotations

import argparse
import json

from attnres_pp.cli_flags import layer_counts, refuse
from attnres_pp.simulator.cli.flags import (
    add_tensor_parallel_flags,
    model_config,
    model_flags,
    positive_int,
    tensor_parallel_from,
)
from attnres_pp.simulator.comm import comm_report, format_comm_table


def register(commands) -> None:
    parser = commands.add_parser("comm", help="tensors and bytes per hop for the four modes")
    model_flags(parser, required=True)
    parser.add_argument("--stages", type=positive_int, required=True, help="P, pipeline ranks")
    parser.add_argument("--virtual", type=positive_int, default=1, help="V, chunks per rank (default 1)")
    parser.add_argument("--layer-counts", default=None, help="layers per chunk, comma separated")
    add_tensor_parallel_flags(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        cfg = model_config(args)
        tp = tensor_parallel_from(args, cfg, tokens=args.tokens, n_stages=args.stages)
        report = comm_report(n_layers=cfg.n_layers, block_size=cfg.block_size, blocks=cfg.blocks,
                             n_stages=args.stages, n_virtual=args.virtual, tokens=args.tokens, d_model=cfg.d_model,
                             source_width=cfg.source_width, dtype=args.dtype,
                             layer_counts=layer_counts(args.layer_counts), tensor_parallel=tp.size,
                             sequence_parallel=tp.sp, tp_bytes_per_s=args.intra_node_gbps * 1e9 / 8,
                             tp_latency_s=args.intra_node_latency_us * 1e-6)
    except ValueError as error:
        return refuse(error, full=True)
    print(json.dumps(report.to_dict()) if args.json else format_comm_table(report))
    return 0
