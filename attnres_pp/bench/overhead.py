"""`attnres-pp bench overhead`: end-to-end step time of Block AttnRes with the cross-stage cache
against the standard residual on the same pipeline (same P, V, m, schedule and model size), and
Block AttnRes without the cache for reference.

All engines are started first and then stepped in rotation (A B C, B C A, C A B, ...), so drift in
the machine's load falls on every variant alike; warm-up rounds are dropped. Reported per variant:
the median driver wall time of an optimiser step (pipeline, gradient clipping, AdamW, pipes), the
median pipeline window, and where the time goes (compute, send, waiting), so that an overhead can
be traced to compute (the depth reads) or to communication. The headline ratio is the median over
rounds of block_cached / standard within a round. Also: the same ratio for the whole model in one
process (the model's own compute cost, no pipeline) and a torch.profiler table of the ops that grow.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path

from attnres_pp.bench.common import (
    BENCH_MODEL,
    MICROBATCH_SIZE,
    TimedEngine,
    account,
    markdown_table,
    run_config,
)

VARIANTS = {
    "standard": ({"residual": "standard", "block_size": 1}, False),
    "block_cached": ({"residual": "attnres", "block_size": 4}, True),
    "block_naive": ({"residual": "attnres", "block_size": 4}, False),
}
PIPELINE = {"stages": 2, "virtual": 2, "schedule": "interleaved_1f1b", "microbatches": 8}


def _compute_by_kind(events) -> dict[str, float]:
    """Seconds in F and in B actions, summed over ranks."""
    out = {"F": 0.0, "B": 0.0}
    for _rank, name, start, end, category in events:
        if category == "compute":
            out[name[0]] += end - start
    return out


def _model_config(name: str, model: dict):
    from attnres_pp.model.config import ModelConfig

    return ModelConfig.from_dict({**model, **VARIANTS[name][0]})


def single_process_ratio(model: dict, rounds: int) -> dict[str, float]:
    """Forward + backward of one microbatch through the whole model in this process (one thread),
    block AttnRes against standard, alternating: the model's own compute overhead, no pipeline."""
    import torch

    from attnres_pp.bench.common import random_batch
    from attnres_pp.model import Transformer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        models = {}
        for name in ("standard", "block_cached"):
            torch.manual_seed(0)
            models[name] = Transformer(_model_config(name, model))
        inputs_BT, targets_BT = random_batch(0, MICROBATCH_SIZE, model["seq_len"], model["vocab_size"])
        times: dict[str, list[float]] = {name: [] for name in models}
        for index in range(rounds + 2):
            for name in (("standard", "block_cached") if index % 2 else ("block_cached", "standard")):
                started = time.perf_counter()
                models[name](inputs_BT, targets_BT).backward()
                if index >= 2:
                    times[name].append(time.perf_counter() - started)
    finally:
        torch.set_num_threads(threads)
    standard, block = statistics.median(times["standard"]), statistics.median(times["block_cached"])
    return {"standard_s": standard, "block_s": block, "ratio": block / standard}


def profile_extra_ops(top: int = 8) -> list[dict]:
    """torch.profiler of one forward + backward per model: the ops whose self CPU time grows most
    from standard to Block AttnRes (where the overhead goes)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from attnres_pp.bench.common import random_batch
    from attnres_pp.model import Transformer

    inputs_BT, targets_BT = random_batch(0, MICROBATCH_SIZE, BENCH_MODEL["seq_len"], BENCH_MODEL["vocab_size"])
    per_op: dict[str, dict[str, float]] = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for name in ("standard", "block_cached"):
            torch.manual_seed(0)
            model = Transformer(_model_config(name, BENCH_MODEL))
            model(inputs_BT, targets_BT).backward()  # warm-up
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(5):
                    model(inputs_BT, targets_BT).backward()
            for event in prof.key_averages():
                entry = per_op.setdefault(event.key, {"standard": 0.0, "block_cached": 0.0, "calls": 0})
                entry[name] += event.self_cpu_time_total / 5e3  # ms per forward + backward
                if name == "block_cached":
                    entry["calls"] = event.count // 5
    finally:
        torch.set_num_threads(threads)
    rows = [{"op": op, "standard_ms": v["standard"], "block_ms": v["block_cached"],
             "extra_ms": v["block_cached"] - v["standard"], "block_calls": v["calls"]} for op, v in per_op.items()]
    return sorted(rows, key=lambda r: -r["extra_ms"])[:top]


def measure(model: dict, warmup: int, rounds: int, progress: Callable[[str], None]) -> dict:
    """Every variant on `model`, stepped in rotation; per variant the medians, and the ratios to standard."""
    variants = tuple(VARIANTS)
    engines: dict[str, TimedEngine] = {}
    try:
        for name in variants:
            overrides, cache = VARIANTS[name]
            engines[name] = TimedEngine(run_config({**model, **overrides}, cache=cache, **PIPELINE))
        for index in range(warmup + rounds):
            shift = index % len(variants)
            for name in variants[shift:] + variants[:shift]:
                engines[name].step()
    finally:
        for engine in engines.values():
            engine.close()
    n_stages = PIPELINE["stages"]
    results = {}
    for name, engine in engines.items():
        samples = engine.samples[warmup:]
        accounts = [account(s.events, n_stages) for s in samples]
        compute = [_compute_by_kind(s.events) for s in samples]
        results[name] = {
            "wall_step_s": statistics.median(s.wall_s for s in samples),
            "pipeline_step_s": statistics.median(a["step_s"] for a in accounts),
            "compute_s_per_rank": statistics.median(a["compute_s_per_rank"] for a in accounts),
            "forward_s": statistics.median(c["F"] for c in compute),
            "backward_s": statistics.median(c["B"] for c in compute),
            "bubble": statistics.median(a["bubble"] for a in accounts),
            "send_fraction": statistics.median(a["send"] for a in accounts),
            "bytes_per_step": samples[-1].bytes_sent,
            "wall_step_s_all": [s.wall_s for s in samples],
        }
        progress(f"  d={model['d_model']} {name}: step {results[name]['wall_step_s'] * 1e3:.1f} ms (pipeline "
                 f"{results[name]['pipeline_step_s'] * 1e3:.1f} ms, compute/rank "
                 f"{results[name]['compute_s_per_rank'] * 1e3:.1f} ms, bubble {results[name]['bubble']:.3f})")
    base = results["standard"]

    def ratios(name: str) -> dict[str, float]:
        mine = results[name]
        paired = [a / b for a, b in zip(mine["wall_step_s_all"], base["wall_step_s_all"], strict=True)]
        # Headline: the median over rounds of the ratio within a round (adjacent steps: drift cancels).
        return {"ratio": statistics.median(paired),
                "ratio_of_medians": mine["wall_step_s"] / base["wall_step_s"],
                "ratio_pipeline": mine["pipeline_step_s"] / base["pipeline_step_s"],
                "ratio_compute": mine["compute_s_per_rank"] / base["compute_s_per_rank"]}

    # 20 rounds even in --quick: the single-process ratio is the figure's largest noise, a few seconds.
    single = single_process_ratio(model, 20)
    cached = ratios("block_cached")
    progress(f"  d={model['d_model']} ratio block_cached / standard = {cached['ratio']:.3f} (ratio of medians "
             f"{cached['ratio_of_medians']:.3f}; pipeline window {cached['ratio_pipeline']:.3f}, compute "
             f"{cached['ratio_compute']:.3f}); one process, one microbatch: {single['ratio']:.3f}")
    return {**cached, "model": {**model, "microbatch_size": MICROBATCH_SIZE,
                                "block_size": VARIANTS["block_cached"][0]["block_size"]},
            "variants": results, "ratios": {name: ratios(name) for name in results if name != "standard"},
            "single_process": single, "pipeline_added_overhead": cached["ratio_compute"] / single["ratio"]}


def run(quick: bool, out_dir: Path | None, progress: Callable[[str], None]) -> dict:
    del out_dir  # tables only
    warmup, rounds = (2, 10) if quick else (3, 30)
    main = measure(BENCH_MODEL, warmup, rounds, progress)
    payload = {
        **main,
        "profile_extra_ops": profile_extra_ops(),
        "pipeline": PIPELINE,
        "warmup_rounds": warmup, "rounds": rounds,
        "note": "ratio = median over rounds of (block_cached step / standard step in the same round), "
                "step = the driver's wall time of a whole optimiser step; variants stepped in rotation",
    }
    if not quick:  # the overhead against width: the depth reads are O(d), the matmuls O(d^2)
        payload["larger_models"] = [measure({**BENCH_MODEL, "d_model": 256}, warmup, rounds // 2, progress)]
    return payload


def _variants_table(result: dict) -> str:
    rows = []
    for name, r in result["variants"].items():
        ratio = result["ratios"].get(name, dict.fromkeys(("ratio", "ratio_of_medians", "ratio_pipeline",
                                                          "ratio_compute"), 1.0))
        rows.append([name, 1e3 * r["wall_step_s"], f"{ratio['ratio']:.3f}", f"{ratio['ratio_of_medians']:.3f}",
                     1e3 * r["pipeline_step_s"], f"{ratio['ratio_pipeline']:.3f}", 1e3 * r["forward_s"],
                     1e3 * r["backward_s"], f"{ratio['ratio_compute']:.3f}", r["bubble"], r["bytes_per_step"] / 2**20])
    return markdown_table(["variant", "step (ms)", "ratio (paired)", "ratio of medians", "pipeline (ms)", "ratio",
                           "F total (ms)", "B total (ms)", "compute ratio", "bubble", "MiB/step"], rows)


def _single_process_line(result: dict) -> str:
    single = result["single_process"]
    return (f"The same two models in one process (d = {result['model']['d_model']}), forward + backward of one "
            f"microbatch, alternating: standard {1e3 * single['standard_s']:.1f} ms, Block AttnRes "
            f"{1e3 * single['block_s']:.1f} ms, ratio {single['ratio']:.3f}. Pipelined compute ratio / "
            f"single-process ratio = {result['pipeline_added_overhead']:.3f} (what the pipeline runtime and the "
            "cache add on top of the model's own compute).")


def to_markdown(payload: dict) -> str:
    pipe = payload["pipeline"]
    lines = [
        "## Overhead of Block AttnRes (cached) over the standard residual, same pipeline", "",
        f"Model {payload['model']}; {pipe['schedule']} P={pipe['stages']} V={pipe['virtual']} "
        f"m={pipe['microbatches']}; medians of {payload['rounds']} rounds after {payload['warmup_rounds']} "
        "warm-up rounds, variants stepped in rotation. Step = the driver's wall time of a whole optimiser "
        "step; pipeline = first to last action of any rank; compute = F + B time per rank.", "",
        _variants_table(payload), "",
        f"**ratio block_cached / standard = {payload['ratio']:.3f}** (the paper: under 1.04 with pipeline "
        "parallelism).", "",
        _single_process_line(payload), "",
        "Where the extra time goes (torch.profiler, self CPU time per forward + backward of one microbatch, "
        "top ops by extra time):", "",
        markdown_table(["op", "standard (ms)", "Block AttnRes (ms)", "extra (ms)", "calls (Block)"],
                       [[r["op"], r["standard_ms"], r["block_ms"], r["extra_ms"], r["block_calls"]]
                        for r in payload["profile_extra_ops"]]),
    ]
    for result in payload.get("larger_models", []):
        lines += ["", f"### d_model = {result['model']['d_model']} (same pipeline, {payload['rounds'] // 2} rounds)",
                  "", _variants_table(result), "",
                  f"**ratio block_cached / standard = {result['ratio']:.3f}**. " + _single_process_line(result)]
    return "\n".join(lines)
