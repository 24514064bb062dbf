"""`attnres-pp simulate project`: flags -> ModelConfig + Cluster -> the per-mode table (`project`).

Numbers are parsed by `attnres_pp.cli_flags`' flag tables, so a bad value is one line `error: ...` and exit 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from attnres_pp.cli_flags import add_number_flags, parse_number_flags, refuse
from attnres_pp.model.config import ModelConfig
from attnres_pp.schedule.schedules import SCHEDULES
from attnres_pp.simulator.cli.flags import D_FF_HELP, add_recipe_flags
from attnres_pp.simulator.comm import DTYPE_BYTES, format_bytes
from attnres_pp.simulator.project import Cluster, project

# (flag, dest, type, default, help)
_NUMBERS = (
    ("--layers", "layers", int, None, "transformer layers (two sublayers each)"),
    ("--d-model", "d_model", int, None, "model width d"),
    ("--block-size", "block_size", int, None, "sublayers per Block AttnRes block"),
    ("--tokens", "tokens", int, None, "tokens per microbatch"),
    ("--d-ff", "d_ff", int, 0, D_FF_HELP),
    ("--heads", "heads", int, 1, "attention heads (read by --kv-heads, which must divide them)"),
    ("--kv-heads", "kv_heads", int, 0, "key/value heads, dividing --heads (0: as many as --heads)"),
    ("--seq-len", "seq_len", int, 4096, "tokens per sequence (attention FLOPs)"),
    ("--vocab-size", "vocab_size", int, 32000, "vocabulary"),
    ("--key-rank", "key_rank", int, 0, "projected low-rank keys: r extra numbers per source (0: none)"),
    ("--stages", "n_stages", int, None, "P, pipeline ranks"),
    ("--virtual", "n_virtual", int, 1, "V, chunks per rank"),
    ("--microbatches", "n_microbatches", int, None, "m, microbatches per step and replica"),
    ("--data-parallel", "data_parallel", int, 1, "D, data-parallel replicas of the pipeline"),
    ("--tflops", "tflops", float, 400.0, "achieved TFLOP/s per GPU (not peak)"),
    ("--hbm-tbs", "hbm_tbs", float, 3.0, "achieved memory bandwidth, TB/s (depth reads are bound by it)"),
    ("--link-gbs", "link_gbs", float, 50.0, "pipeline link bandwidth between neighbouring ranks, GB/s"),
    ("--latency-us", "link_latency_us", float, 10.0, "pipeline link latency, microseconds"),
    ("--dp-link-gbs", "dp_link_gbs", float, None, "data-parallel all-reduce bandwidth, GB/s (default: --link-gbs)"),
    ("--dp-latency-us", "dp_latency_us", float, None, "data-parallel link latency (default: --latency-us)"),
)
_REQUIRED = ("--layers", "--d-model", "--block-size", "--tokens", "--stages", "--microbatches")


def register(commands) -> None:
    parser = commands.add_parser(
        "project", help="plan a cluster: step time, bubble, bytes, cache memory per mode",
        description="Step time, bubble, bytes per step per link, peak cache memory per rank and the AttnRes "
                    "overhead over the standard residual, for standard / Full AttnRes naive / Block naive / "
                    "Block cached, from a model and a cluster (see docs/simulator.md's worked example).")
    add_number_flags(parser, _NUMBERS, _REQUIRED)
    add_recipe_flags(parser, kv_heads=False)
    parser.add_argument("--schedule", choices=sorted(SCHEDULES), default="interleaved_1f1b")
    parser.add_argument("--residual", choices=("attnres", "lr_attnres"), default="attnres",
                        help="the AttnRes variant of the three AttnRes rows (lr_attnres: --key-rank r keys)")
    parser.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="bf16")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=run)


def _values(args: argparse.Namespace) -> dict:
    values = parse_number_flags(args, _NUMBERS, _REQUIRED)
    if values["tokens"] < 1:
        raise ValueError(f"--tokens {values['tokens']} is invalid: tokens per microbatch must be >= 1")
    return values


def build(args: argparse.Namespace) -> tuple[ModelConfig, Cluster, int]:
    values = _values(args)
    key_rank = values["key_rank"]
    if args.residual == "lr_attnres" and not key_rank:
        raise ValueError("--residual lr_attnres needs --key-rank r (the width of the projected keys)")
    if values["kv_heads"] and args.heads is None:
        raise ValueError(f"--kv-heads {values['kv_heads']} needs --heads (the query heads it divides, which set the "
                         "head dimension)")
    cfg = ModelConfig(vocab_size=values["vocab_size"], n_layers=values["layers"], d_model=values["d_model"],
                      n_heads=values["heads"], d_ff=values["d_ff"], seq_len=values["seq_len"], residual=args.residual,
                      block_size=values["block_size"], key_mode="projected", key_rank=key_rank or 8,
                      positions=args.positions, mlp=args.mlp, n_kv_heads=values["kv_heads"], qk_norm=args.qk_norm,
                      tie_embeddings=args.tie_embeddings)
    cluster = Cluster(schedule=args.schedule, **{k: values[k] for k in (
        "n_stages", "n_virtual", "n_microbatches", "data_parallel", "tflops", "hbm_tbs", "link_gbs",
        "link_latency_us", "dp_link_gbs", "dp_latency_us")})
    return cfg, cluster, values["tokens"]


def run(args: argparse.Namespace) -> int:
    try:
        cfg, cluster, tokens = build(args)
        rows = project(cfg, tokens=tokens, dtype_bytes=DTYPE_BYTES[args.dtype], cluster=cluster)
    except ValueError as error:
        return refuse(error)
    if args.json:
        print(json.dumps({"model": cfg.to_dict(), "tokens_per_microbatch": tokens, "dtype": args.dtype,
                          "cluster": dataclasses.asdict(cluster), "modes": rows}))
        return 0
    print(format_table(cfg, cluster, tokens, args.dtype, rows))
    return 0


def format_table(cfg: ModelConfig, cluster: Cluster, tokens: int, dtype: str, rows: list[dict]) -> str:
    header = ["mode", "step", "pipeline", "all-reduce", "bubble", "busiest link/step", "all links/step",
              "peak cache/rank", "vs standard"]
    table = [header] + [[
        r["label"], f"{r['step_s'] * 1e3:.1f} ms", f"{r['pipeline_s'] * 1e3:.1f} ms",
        f"{(r['allreduce_s'] + r['embed_all_reduce_s']) * 1e3:.1f} ms",
        f"{r['bubble_fraction']:.3f}", format_bytes(r["bytes_per_step_busiest_link"]),
        format_bytes(r["bytes_per_step_all_links"]), format_bytes(r["peak_cache_bytes_per_rank"]),
        f"{r['overhead_vs_standard']:+.1%}"] for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w)
                       for i, (cell, w) in enumerate(zip(row, widths, strict=True))) for row in table]
    return "\n".join([
        f"model: {cfg.n_layers} layers, d={cfg.d_model}, block {cfg.block_size} sublayers, {tokens} tokens/mb, "
        f"{dtype}; "
        f"cluster: {cluster.schedule} P={cluster.n_stages} V={cluster.n_virtual} m={cluster.n_microbatches} "
        f"D={cluster.data_parallel} ({cluster.n_stages * cluster.data_parallel} GPUs), {cluster.tflops:g} TFLOP/s, "
        f"{cluster.hbm_tbs:g} TB/s HBM, links {cluster.link_gbs:g} GB/s + {cluster.link_latency_us:g} us",
        *lines,
        "step = simulated pipeline + ring all-reduce of each rank's gradients over D (not overlapped; with tied "
        "embeddings on two ranks, + their copies' sum between the first and the last rank); "
        "bytes: activations forward + gradients backward",
    ])
