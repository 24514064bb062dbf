"""The counted-memory table of `attnres-pp bench memory` (docs/spec.md section 8's `memory_per_rank`): a
32-layer, narrow (d = 64) Block AttnRes model over P = 2 local rank processes, swept over D replicas
x dp_shard x activation checkpointing x schedule, with the counted bytes per rank, the peak RSS and
the step time, and the ratios the memory work targets (fsdp / replicate parameter + gradient +
AdamW bytes at D = 2 and 4; AC full / none activation peak; Block AttnRes under selective over the
standard residual without AC; the step-time cost of each policy).

Rows (each a fresh local-launcher run, three optimiser steps on random batches, step time = median
of the last two): D = 1 with AC none / full / selective under 1F1B (16 layers per chunk) and ZB-V
(8 layers per chunk), AC none / full under ZB-H1 (16) and interleaved ZB (V = 2, 8); D = 2 and 4
under 1F1B without AC, replicate and fsdp (D = 4 x P = 2 is 8 processes on this machine); the
standard residual at D = 1, 1F1B, no AC (the reference of the Block AttnRes under selective target).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable

from attnres_pp.bench.common import markdown_table, random_batch, run_config

MODEL = {"vocab_size": 256, "n_layers": 32, "d_model": 64, "n_heads": 4, "seq_len": 64,
         "residual": "attnres", "block_size": 4}
QUICK_MODEL = {**MODEL, "n_layers": 8}
STANDARD = {"residual": "standard", "block_size": 1}
MICROBATCHES, MICROBATCH_SIZE, STAGES = 4, 2, 2
KiB = 2**10
# (residual overrides, D, dp_shard, AC, schedule)
RUNS = [({}, 1, "replicate", ac, schedule) for schedule in ("1f1b", "zbv") for ac in ("none", "full", "selective")]
# The other split-backward schedules, whose W store frees the graph at I like zbv's.
RUNS += [({}, 1, "replicate", ac, schedule) for schedule in ("zb_h1", "interleaved_zb") for ac in ("none", "full")]
VIRTUAL = {"zbv": 2, "interleaved_zb": 2}
RUNS += [({}, d, shard, "none", "1f1b") for d in (2, 4) for shard in ("replicate", "fsdp")]
RUNS += [(STANDARD, 1, "replicate", "none", "1f1b")]
QUICK_RUNS = [r for r in RUNS if r[1] <= 2]


def _one(model: dict, data_parallel: int, dp_shard: str, ac: str, schedule: str) -> dict:
    from attnres_pp.train.engines import make_engine

    run_cfg = run_config(model, stages=STAGES, virtual=VIRTUAL.get(schedule, 1), schedule=schedule,
                         microbatches=MICROBATCHES, microbatch_size=MICROBATCH_SIZE)
    run_cfg = dataclasses.replace(
        run_cfg, train=dataclasses.replace(run_cfg.train, activation_checkpoint=ac,
                                           batch_size=data_parallel * MICROBATCHES * MICROBATCH_SIZE),
        pipeline=dataclasses.replace(run_cfg.pipeline, data_parallel=data_parallel, dp_shard=dp_shard))
    engine = make_engine(run_cfg)
    try:
        step_s, result = [], None
        for step in range(3):
            inputs_BT, targets_BT = random_batch(step, run_cfg.train.batch_size, model["seq_len"], model["vocab_size"])
            began = time.perf_counter()
            result = engine.train_step(step, inputs_BT, targets_BT, 1e-4)
            step_s.append(time.perf_counter() - began)
    finally:
        engine.close()
    return {"residual": model["residual"], "data_parallel": data_parallel, "dp_shard": dp_shard,
            "activation_checkpoint": ac, "schedule": schedule, "memory_per_rank": result.extras["memory_per_rank"],
            "step_s": statistics.median(step_s[1:])}


def sweep(quick: bool, progress: Callable[[str], None]) -> dict:
    base = QUICK_MODEL if quick else MODEL
    rows = []
    for overrides, d, shard, ac, schedule in (QUICK_RUNS if quick else RUNS):
        began = time.perf_counter()
        rows.append(_one({**base, **overrides}, d, shard, ac, schedule))
        peak = max(m["activation_peak_bytes"] for m in rows[-1]["memory_per_rank"])
        progress(f"{rows[-1]['residual']} D={d} {shard} AC={ac} {schedule}: activation peak {peak / KiB:,.0f} KiB, "
                 f"step {rows[-1]['step_s'] * 1e3:.0f} ms ({time.perf_counter() - began:.0f} s)")
    return {"model": base, "stages": STAGES, "microbatches": MICROBATCHES, "microbatch_size": MICROBATCH_SIZE,
            "rows": rows, "ratios": ratios(rows)}


def _find(rows: list, **match) -> dict | None:
    return next((r for r in rows if all(r[k] == v for k, v in match.items())), None)


def _max(row: dict, key: str) -> int:
    return max(m[key] for m in row["memory_per_rank"])


def ratios(rows: list) -> dict:
    """AC full / none activation peak and the step-time cost of each policy per schedule; Block AttnRes
    under selective over the standard residual without AC (largest rank each)."""
    out: dict = {}
    for schedule in ("1f1b", "zbv", "zb_h1", "interleaved_zb"):
        none = _find(rows, residual="attnres", activation_checkpoint="none", schedule=schedule, data_parallel=1)
        for ac in ("full", "selective"):
            row = _find(rows, residual="attnres", activation_checkpoint=ac, schedule=schedule, data_parallel=1)
            if none and row:
                out[f"{schedule}_{ac}_over_none_activation"] = _max(row, "activation_peak_bytes") / _max(
                    none, "activation_peak_bytes")
                out[f"{schedule}_{ac}_over_none_step_time"] = row["step_s"] / none["step_s"]
    for d in (2, 4):
        replicate = _find(rows, data_parallel=d, dp_shard="replicate")
        fsdp = _find(rows, data_parallel=d, dp_shard="fsdp")
        if replicate and fsdp:
            def state(row):
                return max(m["param_bytes"] + m["grad_bytes"] + m["optimizer_bytes"] for m in row["memory_per_rank"])
            out[f"D{d}_fsdp_over_replicate_state"] = state(fsdp) / state(replicate)
    standard = _find(rows, residual="standard", activation_checkpoint="none")
    selective = _find(rows, residual="attnres", activation_checkpoint="selective", schedule="1f1b")
    if standard and selective:
        out["block_selective_over_standard_none_activation"] = _max(selective, "activation_peak_bytes") / _max(
            standard, "activation_peak_bytes")
    return out


def to_markdown(payload: dict) -> str:
    model = payload["model"]

    def kib(row: dict, key: str) -> str:
        return ", ".join(f"{m[key] / KiB:,.0f}" for m in row["memory_per_rank"][:STAGES])

    rows = [[r["residual"], r["data_parallel"], r["dp_shard"], r["activation_checkpoint"], r["schedule"],
             kib(r, "param_bytes"), kib(r, "grad_bytes"), kib(r, "optimizer_bytes"), kib(r, "activation_peak_bytes"),
             kib(r, "cache_peak_bytes"), ", ".join(f"{m['peak_rss_bytes'] / 2**20:,.0f}" for m in r["memory_per_rank"]),
             f"{r['step_s'] * 1e3:,.0f}"] for r in payload["rows"]]
    ratio_lines = [f"- {name}: {value:.3f}" for name, value in payload["ratios"].items()]
    return "\n".join([
        f"## Counted memory per rank (`memory_per_rank`): {model['n_layers']} layers, d = {model['d_model']}, "
        f"P = {payload['stages']}",
        "",
        f"Local launcher, m = {payload['microbatches']} microbatches of {payload['microbatch_size']} x "
        f"{model['seq_len']} tokens per replica, fp32. KiB per rank of replica 0 (pp rank 0, 1); peak RSS in MiB "
        "for every rank; step time = median of steps 2-3.",
        "",
        markdown_table(["residual", "D", "dp_shard", "AC", "schedule", "params (KiB)", "grads (KiB)",
                        "AdamW (KiB)", "activation peak (KiB)", "cache peak (KiB)", "peak RSS (MiB)", "step (ms)"],
                       rows),
        "",
        "Ratios (largest rank):",
        *ratio_lines,
    ])
