"""`attnres-pp bench memory`: peak resident memory of each pipeline rank, where a rank builds only
its own chunks (the rest of the model stays on the meta device), and the counted `memory_per_rank`
table over D x dp_shard x activation checkpointing x schedule (`sweep`, below).

A 32-layer d = 512 Block AttnRes model (about 101 M parameters) split over P = 1, 2, 4 ranks
(`--quick`: 8 layers, P = 1, 2), local launcher (one spawned process per rank, gloo), 1F1B with m = P
microbatches of one sequence; two optimiser steps on random token batches, so the AdamW moments
exist. Per rank: the parameters it holds, what its training state needs in theory (parameter,
gradient and two AdamW moments, 4 x 4 bytes per parameter), its peak RSS once built (before any
step) and its peak RSS after the two steps (`ru_maxrss`). For comparison, two single processes:
one that only imports torch and this package (every rank's floor), and one that builds the whole
model, which is what every rank would allocate if it built the whole model.

The counted table (`sweep`; docs/spec.md section 8's `memory_per_rank`): a 32-layer, narrow (d = 64)
Block AttnRes model over P = 2 local rank processes, swept over D replicas x dp_shard x activation
checkpointing x schedule, with the counted bytes per rank, the peak RSS and the step time, and the
ratios the memory work targets (fsdp / replicate parameter + gradient + AdamW bytes at D = 2 and 4;
AC full / none activation peak; Block AttnRes under selective over the standard residual without
AC; the step-time cost of each policy). Rows (each a fresh local-launcher run, three optimiser steps
on random batches, step time = median of the last two): D = 1 with AC none / full / selective under
1F1B (16 layers per chunk) and ZB-V (8 layers per chunk), AC none / full under ZB-H1 (16),
interleaved ZB, V-Half and V-Min (V = 2, 8); D = 2 and 4 under 1F1B without AC, replicate and fsdp (D = 4 x P = 2 is 8
processes on this machine); the standard residual at D = 1, 1F1B, no AC (the reference of the Block
AttnRes under selective target).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from attnres_pp.bench.common import markdown_table, random_batch, run_config
from attnres_pp.launch.process_rank_group import rank_context

MODEL = {"vocab_size": 256, "n_layers": 32, "d_model": 512, "n_heads": 8, "seq_len": 64,
         "residual": "attnres", "block_size": 4}
QUICK_MODEL = {**MODEL, "n_layers": 8}
MiB = 2**20

# The counted table's model and rows.
SWEEP_MODEL = {"vocab_size": 256, "n_layers": 32, "d_model": 64, "n_heads": 4, "seq_len": 64,
               "residual": "attnres", "block_size": 4}
SWEEP_QUICK_MODEL = {**SWEEP_MODEL, "n_layers": 8}
SWEEP_STANDARD = {"residual": "standard", "block_size": 1}
SWEEP_MICROBATCHES, SWEEP_MICROBATCH_SIZE, SWEEP_STAGES = 4, 2, 2
KiB = 2**10
# (residual overrides, D, dp_shard, AC, schedule)
SWEEP_RUNS = [({}, 1, "replicate", ac, schedule) for schedule in ("1f1b", "zbv")
              for ac in ("none", "full", "selective")]
# The other split-backward schedules, whose W store frees the graph at I like zbv's.
SWEEP_RUNS += [({}, 1, "replicate", ac, schedule) for schedule in ("zb_h1", "interleaved_zb")
               for ac in ("none", "full")]
# The controllable-memory V schedules (held activations bounded below ZB-V's), with and without AC.
SWEEP_RUNS += [({}, 1, "replicate", ac, schedule) for schedule in ("v_half", "v_min") for ac in ("none", "full")]
# The fused-backward schedules beside them, so that the table shows every schedule with and without AC.
SWEEP_RUNS += [({}, 1, "replicate", ac, schedule) for schedule in ("gpipe", "interleaved_1f1b", "dualpipev")
               for ac in ("none", "full")]
SWEEP_VIRTUAL = {"zbv": 2, "interleaved_zb": 2, "v_half": 2, "v_min": 2, "interleaved_1f1b": 2, "dualpipev": 2}
SWEEP_SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b", "dualpipev", "zbv", "zb_h1", "interleaved_zb", "v_half",
                   "v_min")
SWEEP_RUNS += [({}, d, shard, "none", "1f1b") for d in (2, 4) for shard in ("replicate", "fsdp")]
SWEEP_RUNS += [(SWEEP_STANDARD, 1, "replicate", "none", "1f1b")]
SWEEP_QUICK_RUNS = [r for r in SWEEP_RUNS if r[1] <= 2]


def _timed_steps(engine, run_cfg, model: dict, steps: int) -> tuple[list[float], object]:
    """(seconds of each step, the last StepResult) of `steps` driver-fed steps on random batches."""
    step_s, result = [], None
    for step in range(steps):
        inputs_BT, targets_BT = random_batch(step, run_cfg.train.batch_size, model["seq_len"], model["vocab_size"])
        began = time.perf_counter()
        result = engine.train_step(step, inputs_BT, targets_BT, 1e-4)
        step_s.append(time.perf_counter() - began)
    return step_s, result


def _probe(model: dict | None, queue) -> None:
    """A fresh process's peak RSS after importing torch (and building the whole model if given)."""
    import torch

    from attnres_pp.model import ModelConfig, Transformer
    from attnres_pp.train.stage_worker import peak_rss_bytes

    torch.set_num_threads(1)
    if model is not None:
        Transformer(ModelConfig(**model))
    queue.put(peak_rss_bytes())


def _single_process_rss(model: dict | None) -> int:
    # The ranks' own start (the fork server, torch preloaded), so the RSS figures compare like with like.
    ctx = rank_context(__name__)
    queue = ctx.Queue()
    proc = ctx.Process(target=_probe, args=(model, queue), daemon=True)
    proc.start()
    try:
        return int(queue.get(timeout=300))
    finally:
        proc.join(timeout=30)


def _measure(model: dict, n_stages: int, progress: Callable[[str], None]) -> dict:
    from attnres_pp.train.engines import make_pipeline_engine

    run_cfg = run_config(model, stages=n_stages, virtual=1, schedule="1f1b", microbatches=n_stages,
                         microbatch_size=1)
    started = time.perf_counter()
    engine = make_pipeline_engine(run_cfg)
    try:
        build = [d["peak_rss_bytes"] for d in engine.rank_descriptions]
        params = [d["params"] for d in engine.rank_descriptions]
        step_s, result = _timed_steps(engine, run_cfg, model, 2)
    finally:
        engine.close()
    row = {"stages": n_stages, "params_per_rank": params, "state_bytes_per_rank": [16 * n for n in params],
           "rss_after_build_per_rank": build, "peak_rss_per_rank": result.extras["peak_rss_bytes_per_rank"],
           "step_s": statistics.median(step_s), "elapsed_s": time.perf_counter() - started}
    progress(f"P={n_stages}: peak RSS per rank {[round(b / MiB) for b in row['peak_rss_per_rank']]} MiB, "
             f"{row['elapsed_s']:.0f} s")
    return row



def run(quick: bool, out_dir: Path, progress: Callable[[str], None]) -> dict:
    del out_dir  # no pictures or traces
    model = QUICK_MODEL if quick else MODEL
    floor = _single_process_rss(None)
    whole = _single_process_rss(model)
    progress(f"one process: {floor / MiB:.0f} MiB after imports, {whole / MiB:.0f} MiB after building the whole model")
    rows = [_measure(model, n_stages, progress) for n_stages in ((1, 2) if quick else (1, 2, 4))]
    return {"model": model, "microbatch_size": 1, "steps": 2, "import_rss": floor, "whole_model_build_rss": whole,
            "rows": rows, "counted": sweep(quick, progress)}


def to_markdown(payload: dict) -> str:
    model = payload["model"]

    def mib(values: list[int]) -> str:
        return ", ".join(f"{v / MiB:,.0f}" for v in values)

    floor = payload["import_rss"]
    rows = [[r["stages"], ", ".join(f"{n / 1e6:.1f} M" for n in r["params_per_rank"]),
             mib(r["state_bytes_per_rank"]), mib(r["rss_after_build_per_rank"]), mib(r["peak_rss_per_rank"]),
             f"{max(r['peak_rss_per_rank']) / MiB:,.0f}", f"{(max(r['peak_rss_per_rank']) - floor) / MiB:,.0f}"]
            for r in payload["rows"]]
    return "\n".join([
        f"## Peak resident memory per rank: {model['n_layers']} layers, d = {model['d_model']}, rank-local chunks",
        "",
        f"Local launcher, 1F1B, m = P microbatches of 1 x {model['seq_len']} tokens, 2 optimiser steps (fp32, AdamW). "
        "State = parameters + gradients + two AdamW moments (16 B per parameter). MiB, one entry per rank.",
        "",
        markdown_table(["P", "parameters per rank", "state (MiB)", "RSS after build (MiB)",
                        "peak RSS after 2 steps (MiB)", "largest rank (MiB)", "largest rank above the floor (MiB)"],
                       rows),
        "",
        f"One process that only imports torch and attnres_pp: {payload['import_rss'] / MiB:,.0f} MiB (every rank's "
        f"floor). One process that builds the whole model, as every rank did before building only its chunks: "
        f"{payload['whole_model_build_rss'] / MiB:,.0f} MiB before any training state.",
        *(["", sweep_markdown(payload["counted"])] if "counted" in payload else []),
    ])



def _counted_run(model: dict, data_parallel: int, dp_shard: str, ac: str, schedule: str) -> dict:
    from attnres_pp.train.engines import make_engine

    run_cfg = run_config(model, stages=SWEEP_STAGES, virtual=SWEEP_VIRTUAL.get(schedule, 1), schedule=schedule,
                         microbatches=SWEEP_MICROBATCHES, microbatch_size=SWEEP_MICROBATCH_SIZE)
    run_cfg = dataclasses.replace(
        run_cfg, train=dataclasses.replace(run_cfg.train, activation_checkpoint=ac,
                                           batch_size=data_parallel * SWEEP_MICROBATCHES * SWEEP_MICROBATCH_SIZE),
        pipeline=dataclasses.replace(run_cfg.pipeline, data_parallel=data_parallel, dp_shard=dp_shard))
    engine = make_engine(run_cfg)
    try:
        step_s, result = _timed_steps(engine, run_cfg, model, 3)
    finally:
        engine.close()
    return {"residual": model["residual"], "data_parallel": data_parallel, "dp_shard": dp_shard,
            "activation_checkpoint": ac, "schedule": schedule, "memory_per_rank": result.extras["memory_per_rank"],
            "step_s": statistics.median(step_s[1:])}


def sweep(quick: bool, progress: Callable[[str], None]) -> dict:
    base = SWEEP_QUICK_MODEL if quick else SWEEP_MODEL
    rows = []
    for overrides, d, shard, ac, schedule in (SWEEP_QUICK_RUNS if quick else SWEEP_RUNS):
        began = time.perf_counter()
        rows.append(_counted_run({**base, **overrides}, d, shard, ac, schedule))
        peak = max(m["activation_peak_bytes"] for m in rows[-1]["memory_per_rank"])
        progress(f"{rows[-1]['residual']} D={d} {shard} AC={ac} {schedule}: activation peak {peak / KiB:,.0f} KiB, "
                 f"step {rows[-1]['step_s'] * 1e3:.0f} ms ({time.perf_counter() - began:.0f} s)")
    return {"model": base, "stages": SWEEP_STAGES, "microbatches": SWEEP_MICROBATCHES,
            "microbatch_size": SWEEP_MICROBATCH_SIZE, "rows": rows, "ratios": sweep_ratios(rows)}


def _find(rows: list, **match) -> dict | None:
    return next((r for r in rows if all(r[k] == v for k, v in match.items())), None)


def _max(row: dict, key: str) -> int:
    return max(m[key] for m in row["memory_per_rank"])


def sweep_ratios(rows: list) -> dict:
    """AC full / none activation peak and the step-time cost of each policy per schedule; Block AttnRes
    under selective over the standard residual without AC (largest rank each)."""
    out: dict = {}
    for schedule in SWEEP_SCHEDULES:
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


def sweep_markdown(payload: dict) -> str:
    model = payload["model"]

    def kib(row: dict, key: str) -> str:
        return ", ".join(f"{m[key] / KiB:,.0f}" for m in row["memory_per_rank"][:SWEEP_STAGES])

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
