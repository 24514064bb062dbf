"""`attnres-pp simulate memory`: flags -> ModelConfig + MemorySetup -> each rank's predicted memory
(`simulator.memory`), as a table or as `{"memory_per_rank": [...], "peak_action_per_rank": [...]}`
with the ranks in global-rank order (dp_rank * P + pp_rank), as `summary.json` lists them.
"""

from __future__ import annotations

import argparse
import json

from attnres_pp.cli_flags import refuse
from attnres_pp.model.config import ModelConfig
from attnres_pp.model_flags import add_layer_counts_flag, add_model_flags, layer_counts_flag, model_from_flags
from attnres_pp.schedule.schedules import SCHEDULES
from attnres_pp.simulator.cli.flags import (
    add_attention_kernel_flag,
    add_tensor_parallel_flags,
    positive_int,
    tensor_parallel_from,
)
from attnres_pp.simulator.comm import DTYPE_BYTES, format_bytes
from attnres_pp.simulator.memory import (
    AC_POLICIES,
    DP_SHARDS,
    LAUNCHERS,
    MEMORY_KEYS,
    RESHARD_AFTER_FORWARD,
    MemorySetup,
    predict_memory,
)


def register(commands) -> None:
    parser = commands.add_parser(
        "memory", help="predict each rank's peak memory (params, grads, AdamW, activations, cache)",
        description="Per-rank memory of one training step predicted from shapes and the schedule's action "
                    "order (docs/spec.md section 8): the keys of summary.json's memory_per_rank and the peak's action.")
    parser.add_argument("--schedule", choices=sorted(SCHEDULES), required=True)
    parser.add_argument("--stages", type=positive_int, required=True, help="P, pipeline ranks")
    parser.add_argument("--virtual", type=positive_int, default=1, help="V, chunks per rank (default 1)")
    parser.add_argument("--microbatches", type=positive_int, required=True, help="m, microbatches per step and replica")
    # The model flags are train's own (same names, defaults and meaning); the simulator adds these.
    add_model_flags(parser)
    parser.add_argument("--tokens", type=positive_int, default=4096, help="tokens per microbatch")
    parser.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="bf16")
    add_layer_counts_flag(parser)
    parser.add_argument("--no-cache", action="store_true", help="AttnRes without the cross-stage cache")
    parser.add_argument("--data-parallel", type=positive_int, default=1, help="D, replicas of the pipeline")
    parser.add_argument("--dp-shard", choices=DP_SHARDS, default="replicate",
                        help="replicate: every replica holds everything; fsdp: FSDP2 shards 1/D")
    parser.add_argument("--fsdp-reshard-after-forward", choices=RESHARD_AFTER_FORWARD, default=None,
                        help="train's: never (default) keeps each chunk all-gathered through the step; always "
                             "reshards it after each F, so it is all-gathered only while the chunk runs and "
                             "from its backward to its next F (--dp-shard fsdp only)")
    parser.add_argument("--activation-checkpoint", choices=AC_POLICIES, default="none")
    add_attention_kernel_flag(parser, default="flash")
    add_tensor_parallel_flags(parser, ranks=True)
    parser.add_argument("--expert-parallel", type=positive_int, default=1,
                        help="EP (docs/spec.md section 12): replicas of a pipeline stage that share each MoE "
                             "layer's routed experts, E / EP each; divides --moe-experts and --data-parallel "
                             "(default 1)")
    parser.add_argument("--moe-load-factor", type=float, default=1.0,
                        help="EP > 1: the rows the most-loaded expert-parallel rank's experts receive, over the "
                             "balanced N K of a microbatch (1.0, the default: balanced routing; read it off a run's "
                             "moe_expert_loads as the largest rank's share x EP); every rank is priced at it")
    parser.add_argument("--launcher", choices=LAUNCHERS, default="inprocess",
                        help="train's --launcher: local and ray (ranks on one host) also hold the shared-memory "
                             "receive slots of a step (transport_buffer_bytes); default inprocess (none)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=run)


def build(args: argparse.Namespace) -> tuple[ModelConfig, MemorySetup]:
    cfg = model_from_flags(args)
    tp = tensor_parallel_from(args, cfg, tokens=args.tokens, n_stages=args.stages, data_parallel=args.data_parallel)
    setup = MemorySetup(schedule=args.schedule, n_stages=args.stages, n_virtual=args.virtual,
                        n_microbatches=args.microbatches, tokens=args.tokens, dtype=args.dtype,
                        cache=not args.no_cache, data_parallel=args.data_parallel, dp_shard=args.dp_shard,
                        activation_checkpoint=args.activation_checkpoint,
                        reshard_after_forward=args.fsdp_reshard_after_forward or "never",
                        layer_counts=layer_counts_flag(args), attention_kernel=args.attention_kernel,
                        tensor_parallel=tp.size, sequence_parallel=tp.sp, launcher=args.launcher,
                        expert_parallel=args.expert_parallel, moe_load_factor=args.moe_load_factor)
    return cfg, setup


def run(args: argparse.Namespace) -> int:
    try:
        cfg, setup = build(args)
        ranks = predict_memory(cfg, setup)
    except ValueError as error:
        return refuse(error)
    if args.json:
        print(json.dumps({"attention_kernel": setup.attention_kernel, "tensor_parallel": setup.tensor_parallel,
                          "sequence_parallel": setup.sp, "expert_parallel": setup.expert_parallel,
                          "moe_load_factor": setup.moe_load_factor,
                          "memory_per_rank": [r.terms for r in ranks],
                          "peak_action_per_rank": [r.peak_action for r in ranks],
                          "peak_bytes_per_rank": [r.peak_bytes for r in ranks]}))
        return 0
    print(format_table(setup, ranks))
    return 0


def format_table(setup: MemorySetup, ranks) -> str:
    header = ["rank", "params", "grads", "optimizer", "activations", "cache", "peak", "at", "dominated by"]
    reshard = ", reshard after forward always" if setup.reshard_after_forward == "always" else ""
    # Replicas hold the same as replica 0 (under fsdp their AdamW moments may be a little smaller).
    shown = ranks[:setup.n_stages]
    rows = [header] + [[str(i), *(format_bytes(r.terms[k]) for k in MEMORY_KEYS), format_bytes(r.peak_bytes),
                        r.peak_action, r.dominant] for i, r in enumerate(shown)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join([
        f"{setup.schedule} P={setup.n_stages} V={setup.n_virtual} m={setup.n_microbatches} D={setup.data_parallel} "
        f"({setup.dp_shard}{reshard}), AC {setup.activation_checkpoint}, {setup.tokens} tokens/mb, {setup.dtype}, "
        f"cache {'on' if setup.cache else 'off'}, {setup.attention_kernel} attention"
        + (f", EP={setup.expert_parallel} (E / EP routed experts per rank"
           + (f"; the most-loaded rank's {setup.moe_load_factor:g} x the balanced rows, on every rank)"
              if setup.moe_load_factor != 1 else ")") if setup.expert_parallel > 1 else "")
        + (f", T={setup.tensor_parallel} (SP {'on' if setup.sp else 'off'}; one row per (dp, pp): each of its "
           "T tp ranks holds the same, derived)" if setup.tensor_parallel > 1 else ""),
        *lines,
        *([f"ranks {setup.n_stages}..{len(ranks) - 1} (replicas 1..{setup.data_parallel - 1}) hold the same as "
           f"ranks 0..{setup.n_stages - 1}" + (" (AdamW moments up to their unpadded shards)"
                                              if setup.dp_shard == "fsdp" else "") + "; --json lists every rank"]
          if setup.data_parallel > 1 else []),
        "peak = params + grads + optimizer + (activations + cache at the peak's action)"
        + (f" + the shared-memory receive slots ({setup.launcher}: "
           + ", ".join(format_bytes(r.terms["transport_buffer_bytes"]) for r in shown) + " per rank)"
           if any(r.terms["transport_buffer_bytes"] for r in shown) else "")
        + ((" + the all-gathered parameters (fsdp" + (": the chunks unsharded at the peak's action)"
                                                       if setup.reshard_after_forward == "always" else ")"))
           if setup.dp_shard == "fsdp" and setup.data_parallel > 1 else ""),
    ])
