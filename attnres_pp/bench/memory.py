"""`attnres-pp bench memory`: peak resident memory of each pipeline rank, where a rank builds only
its own chunks (the rest of the model stays on the meta device), and the counted `memory_per_rank`
table over D x dp_shard x activation checkpointing x schedule (`bench.memory_sweep`).

A 32-layer d = 512 Block AttnRes model (about 101 M parameters) split over P = 1, 2, 4 ranks
(`--quick`: 8 layers, P = 1, 2), local launcher (one spawned process per rank, gloo), 1F1B with m = P
microbatches of one sequence; two optimiser steps on random token batches, so the AdamW moments
exist. Per rank: the parameters it holds, what its training state needs in theory (parameter,
gradient and two AdamW moments, 4 x 4 bytes per parameter), its peak RSS once built (before any
step) and its peak RSS after the two steps (`ru_maxrss`). For comparison, two single processes:
one that only imports torch and this package (every rank's floor), and one that builds the whole
model, which is what every rank would allocate if it built the whole model.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path

from attnres_pp.bench import memory_sweep
from attnres_pp.bench.common import markdown_table, random_batch, run_config
from attnres_pp.launch.process_rank_group import rank_context

MODEL = {"vocab_size": 256, "n_layers": 32, "d_model": 512, "n_heads": 8, "seq_len": 64,
         "residual": "attnres", "block_size": 4}
QUICK_MODEL = {**MODEL, "n_layers": 8}
MiB = 2**20


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
        step_s, result = [], None
        for step in range(2):
            inputs_BT, targets_BT = random_batch(step, run_cfg.train.batch_size, model["seq_len"], model["vocab_size"])
            began = time.perf_counter()
            result = engine.train_step(step, inputs_BT, targets_BT, 1e-4)
            step_s.append(time.perf_counter() - began)
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
            "rows": rows, "counted": memory_sweep.sweep(quick, progress)}


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
        *(["", memory_sweep.to_markdown(payload["counted"])] if "counted" in payload else []),
    ])
