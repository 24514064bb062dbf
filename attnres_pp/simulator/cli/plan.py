"""`attnres-pp simulate plan`: flags -> PlanRequest -> the fastest configurations that fit
(`simulator.plan`), as a table with the `attnres-pp train` command of the fastest row train runs on
the GPUs, or `{"rows": [...], "run": {...}, "run_row": N}`.

Numbers are parsed by `attnres_pp.cli_flags`' flag tables, so a bad value is one line `error: ...` and exit 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

from attnres_pp.cli_flags import add_number_flags, parse_number_flags, refuse
from attnres_pp.model_flags import add_layer_counts_flag, add_model_flags, model_from_flags
from attnres_pp.simulator.cli.flags import (
    add_attention_kernel_flag,
    add_tensor_parallel_flags,
    positive_int,
)
from attnres_pp.simulator.comm import format_bytes
from attnres_pp.simulator.layer_recipe import describe_recipe
from attnres_pp.simulator.memory import DTYPE_BYTES
from attnres_pp.simulator.moe import parameter_counts
from attnres_pp.simulator.plan import GIB, Candidate, Planner, PlanRequest, PlanResult, make_plan
from attnres_pp.simulator.tensor_parallel import INTRA_NODE_GBPS, TP_SIZES

# The planner's own numbers (the model's flags are train's, `model_flags`).
# (flag, dest, type, default, help); default None = required
_NUMBERS = (
    ("--global-batch", "global_batch", int, None, "sequences per optimiser step (all replicas)"),
    ("--gpus", "gpus", int, None, "GPUs in all"),
    ("--gpu-memory-gib", "gpu_memory_gib", float, None, "memory per GPU, GiB"),
    ("--gpus-per-node", "gpus_per_node", int, 8, "GPUs per node"),
    ("--intra-node-gbps", "intra_node_gbps", float, INTRA_NODE_GBPS,
     "link inside a node, Gb/s per direction (NVLink 4: 450 GB/s); hops and the tp collectives"),
    ("--inter-node-gbps", "inter_node_gbps", float, 400.0, "link between nodes, Gb/s (InfiniBand)"),
    ("--latency-us", "latency_us", float, 10.0, "link latency, microseconds"),
    ("--tflops", "tflops", float, 400.0, "achieved TFLOP/s per GPU"),
    ("--peak-tflops", "peak_tflops", float, 989.0, "peak TFLOP/s per GPU, for MFU (H100 dense bf16)"),
    ("--hbm-tbs", "hbm_tbs", float, 3.0, "achieved memory bandwidth, TB/s"),
    ("--top", "top", int, 5, "rows to print"),
    ("--why", "why", int, 0, "print the memory and time terms of this row of the table (1-based; 0 = none)"),
)
_REQUIRED = tuple(flag for flag, _dest, _kind, default, _help in _NUMBERS if default is None)


def register(commands) -> None:
    parser = commands.add_parser(
        "plan", help="the fastest P, V, D, m, schedule, block size, cache, FSDP and AC that fit in memory",
        description="Search pipeline and data-parallel layouts, schedules (GPipe included), block sizes, the "
                    "cross-stage cache on and off, dp_shard (fsdp with reshard after forward never and always) "
                    "and activation checkpointing; keep those whose predicted per-rank peak fits --gpu-memory-gib "
                    "and rank them by predicted step time (docs/simulator.md). --why N prints row N's terms.")
    add_model_flags(parser, notes={"--block-size": "simulate plan: given, it is fixed; left out (and no "
                                                   "--blocks), the plan searches 4, 8 and 16 blocks",
                                   "--blocks": "simulate plan: given, the blocks are fixed"})
    add_layer_counts_flag(parser, note="simulate plan searches the split: refused")
    add_number_flags(parser, _NUMBERS, _REQUIRED)
    parser.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="bf16")
    add_attention_kernel_flag(parser, default="flash")
    add_tensor_parallel_flags(parser, link=False, search=True)
    parser.add_argument("--expert-parallel", type=positive_int, default=None,
                        help="EP (docs/spec.md section 12), fixed; left out, a model with --moe-experts searches "
                             "the powers of two dividing E and D")
    parser.add_argument("--json", action="store_true", help='print {"rows": [...]}, fastest first')
    parser.set_defaults(func=run)


_NON_NEGATIVE = ("--why",)


def _values(args: argparse.Namespace) -> dict:
    return parse_number_flags(args, _NUMBERS, _REQUIRED, non_negative=_NON_NEGATIVE,
                              positive=tuple(row[0] for row in _NUMBERS if row[0] not in _NON_NEGATIVE))


def build(args: argparse.Namespace) -> PlanRequest:
    if args.layer_counts is not None:
        raise ValueError("--layer-counts: simulate plan searches over it; drop it")
    values = _values(args)
    cfg = model_from_flags(args)
    fixed_block_size = args.block_size is not None or args.blocks is not None
    return PlanRequest(model=cfg, global_batch=values["global_batch"], gpus=values["gpus"],
                       gpu_memory_gib=values["gpu_memory_gib"], gpus_per_node=values["gpus_per_node"],
                       intra_node_gbps=values["intra_node_gbps"], inter_node_gbps=values["inter_node_gbps"],
                       latency_us=values["latency_us"], tflops=values["tflops"], peak_tflops=values["peak_tflops"],
                       hbm_tbs=values["hbm_tbs"], dtype=args.dtype,
                       block_size=cfg.block_size if fixed_block_size else None,
                       top=values["top"], attention_kernel=args.attention_kernel,
                       tensor_parallel_sizes=TP_SIZES if args.tensor_parallel is None else (args.tensor_parallel,),
                       sequence_parallel=args.sequence_parallel is not False,
                       intra_node_latency_us=args.intra_node_latency_us, expert_parallel=args.expert_parallel)


def run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    try:
        request = build(args)
        result = make_plan(request)
        rows = result.rows
        why = _values(args)["why"]
        if why and why > len(rows):
            raise ValueError(f"--why {why}: the plan has {len(rows)} row{'s' if len(rows) > 1 else ''} "
                             f"(give 1..{len(rows)}, or raise --top)")
        terms = explain_row(request, rows[why - 1]) if why else None
    except ValueError as error:
        return refuse(error)
    if args.json:
        out = {"attention_kernel": request.attention_kernel, "rows": rows, "run": result.run,
               "run_row": result.run_row}
        if terms is not None:
            out["why"] = {"row": why, "pp_rank": terms["pp_rank"], "memory_bytes": dict(terms["memory"]),
                          "time_s": dict(terms["time"])}
        print(json.dumps(out))
        return 0
    print(format_table(request, result, time.perf_counter() - started))
    if terms is not None:
        print(format_why(why, rows[why - 1], terms))
    return 0


def explain_row(request: PlanRequest, row: dict) -> dict:
    """The terms of one row of `plan(request)` (Planner.explain of the candidate its config names)."""
    names = {f.name for f in dataclasses.fields(Candidate)}
    candidate = Candidate(**{k: v for k, v in row["config"].items() if k in names})
    return Planner(request).explain(candidate)


def format_why(index: int, row: dict, terms: dict) -> str:
    """One line per term: memory in GiB (exact bytes after), then time in seconds; each block ends in its sum."""
    c = row["config"]
    lines = [f"why row {index} ({c['schedule']} T={c['tensor_parallel']} P={c['n_stages']} V={c['n_virtual']} "
             f"D={c['data_parallel']} " + (f"EP={c['expert_parallel']} " if c["expert_parallel"] > 1 else "") +
             f"m={c['n_microbatches']}): memory of the fullest rank, pp rank {terms['pp_rank']}"]
    width = max(len(label) for label, _ in terms["memory"] + terms["time"]) + 2
    for label, value in terms["memory"]:
        lines.append(f"  {label + ':':<{width}}{value / GIB:10.3f} GiB  ({value} B)")
    peak = row["peak_memory_bytes"]
    lines.append(f"  {'per rank max:':<{width}}{peak / GIB:10.3f} GiB  ({peak} B)")
    lines.append("time per step:")
    for label, value in terms["time"]:
        lines.append(f"  {label + ':':<{width}}{value:10.4f} s")
    lines.append(f"  {'per step:':<{width}}{row['step_time_s']:10.4f} s")
    return "\n".join(lines)


def format_table(request: PlanRequest, result: PlanResult, seconds: float) -> str:
    moe = request.model.moe  # an EP column for a mixture of experts (dense tables keep their columns)
    header = ["#", "schedule", "T", "P", "V", "D", *(["EP"] if moe else []), "m", "S", "cache", "shard", "AC", "step",
              "tok/s/GPU", "MFU", "bubble", "bytes/hop", "peak/rank", "dominated by", "train runs"]
    table = [header]
    for i, row in enumerate(result.rows, 1):
        c = row["config"]
        table.append([str(i), c["schedule"], str(c["tensor_parallel"]) + ("" if c["sequence_parallel"] or
                                                                            c["tensor_parallel"] == 1 else "/noSP"),
                      str(c["n_stages"]), str(c["n_virtual"]), str(c["data_parallel"]),
                      *([str(row["expert_parallel"])] if moe else []),
                      str(c["n_microbatches"]), f"N={c['blocks']}" if c.get("blocks") else str(c["block_size"]),
                      "on" if c["cache"] else "off",
                      c["dp_shard"] + ("/reshard" if c["reshard_after_forward"] == "always" else ""),
                      c["activation_checkpoint"],
                      f"{row['step_time_s']:.2f} s", f"{row['tokens_per_s_per_gpu']:.0f}", f"{row['mfu']:.1%}",
                      f"{row['bubble_fraction']:.3f}", format_bytes(row["bytes_per_hop"]),
                      f"{row['peak_memory_bytes'] / GIB:.1f} GiB", row["dominated_by"],
                      "yes" if row["runnable"] else "no"])
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(r, widths, strict=True)) for r in table]
    cfg = request.model
    total, active = parameter_counts(cfg)
    sizes = f" ({total / 1e9:.2f}B parameters, {active / 1e9:.2f}B active)" if cfg.moe else ""
    return "\n".join([
        f"{cfg.n_layers} layers{sizes}, d={cfg.d_model}, {describe_recipe(cfg)}, {cfg.residual}, "
        f"batch {request.global_batch} x {cfg.seq_len} tokens; "
        f"{request.gpus} GPUs x {request.gpu_memory_gib:g} GiB ({request.gpus_per_node} per node), "
        f"{request.tflops:g} TFLOP/s achieved; planned in {seconds:.1f} s",
        *lines,
        "peak/rank: the fullest rank's predicted peak (params + grads + AdamW + activations + cache at its peak); "
        "fsdp/reshard: --fsdp-reshard-after-forward always (a chunk all-gathered only from its backward to its "
        "next F); T: tensor-parallel ranks (GPUs = T x P x D; SP on unless /noSP; bytes/hop per tp rank; tp "
        "terms derived); train runs: whether `attnres-pp train --device cuda` runs the row"
        + ("; EP: expert-parallel ranks (replicas of a stage sharing each MoE layer's routed experts, E / EP "
           "each; all-to-alls derived)" if moe else ""),
        *_not_runnable_notes(result.rows),
        *_run_lines(result),
    ])


def _not_runnable_notes(rows: list[dict]) -> list[str]:
    """One line per reason a row is not run by train, naming its rows."""
    by_reason: dict[str, list[int]] = {}
    for i, row in enumerate(rows, 1):
        if not row["runnable"]:
            by_reason.setdefault(row["not_runnable_reason"], []).append(i)
    return [f"row{'s' if len(numbers) > 1 else ''} {', '.join(map(str, numbers))}: {reason}"
            for reason, numbers in by_reason.items()]


def _run_lines(result: PlanResult) -> list[str]:
    """The command of the fastest row train runs: the top row, a lower one, or one beyond the table."""
    run = result.run
    if run is None:
        return ["none of the configurations train runs on these GPUs fits: see the rows' reasons"]
    if result.run_row == 1:
        title = "run the top row:"
    elif result.run_row is not None:
        title = f"run row {result.run_row}, the fastest that train runs:"
    else:
        c = run["config"]
        title = (f"run the fastest configuration train runs, below the table ({c['schedule']} T={c['tensor_parallel']} "
                 f"P={c['n_stages']} V={c['n_virtual']} D={c['data_parallel']} m={c['n_microbatches']}, "
                 f"{run['step_time_s']:.2f} s, {run['peak_memory_bytes'] / GIB:.1f} GiB):")
    return [title, "  " + run["command"]]
