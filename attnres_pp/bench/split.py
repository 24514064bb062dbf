"""`attnres-pp bench split`: the backward split in I and W against the fused backward B, per chunk.

The benchmark model (Block AttnRes with the cache, and the standard residual), cut into P = 2,
V = 2 chunks; one process, one thread. Per chunk and round: a forward, then B; a forward, then I
and W (the runtime's own functions, with its per-chunk cut cache warm: the weight store, and the
retained-graph twin beside it), in alternating order.
Both the thread's CPU time (what the split costs in work, little disturbed by other load) and wall
time are recorded; medians over rounds. Target: I + W within 10% of B.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from attnres_pp.bench.common import BENCH_MODEL, MICROBATCH_SIZE, markdown_table

MODELS = {"block_cached": {**BENCH_MODEL, "residual": "attnres", "block_size": 4},
          "standard": {**BENCH_MODEL, "residual": "standard", "block_size": 1}}
N_STAGES, N_VIRTUAL = 2, 2


def _chunk_runs(model_dict: dict, seed: int = 0):
    """Per chunk a function that runs one forward and returns (roots, root grads, input leaves)."""
    from attnres_pp.comm.partition import make_partition
    from attnres_pp.comm.plan import plan_for_model
    from attnres_pp.model import ModelConfig, Transformer
    from attnres_pp.pipeline.chunk import build_rank_chunks

    cfg = ModelConfig(**model_dict)
    torch.manual_seed(seed)
    model = Transformer(cfg)
    partition = make_partition(cfg.n_layers, N_STAGES, N_VIRTUAL)
    plan = plan_for_model(cfg, partition, cache=True)
    width = cfg.d_model if cfg.residual == "standard" else cfg.source_width
    generator = torch.Generator().manual_seed(seed)
    runs = []
    for c in range(partition.n_chunks):
        chunk = build_rank_chunks(model, partition, partition.rank_of(c))[c]
        io = plan.chunks[c]
        idx = torch.randint(0, cfg.vocab_size, (MICROBATCH_SIZE, cfg.seq_len), generator=generator)
        source = torch.randn(MICROBATCH_SIZE, cfg.seq_len, width, generator=generator)

        def run(chunk=chunk, io=io, idx=idx, source=source):
            inputs = [source.clone().requires_grad_(True) for _ in io.received + io.cache_reads]
            produced, loss = chunk(dict(zip(io.received + io.cache_reads, inputs, strict=True)), idx, idx)
            if loss is not None:
                return [loss], [torch.ones_like(loss)], inputs
            roots = list(produced.values())
            return roots, [torch.ones_like(r) for r in roots], inputs

        runs.append(run)
    return model, runs


def measure(model_dict: dict, rounds: int, warmup: int, *, retain: bool = False) -> list[dict]:
    """`retain`: the split's slow twin (I keeps the graph until W) instead of the weight store."""
    from attnres_pp.pipeline.graph_cut import CutCache
    from attnres_pp.pipeline.split_backward import backward_input, backward_weight, fused_backward
    from attnres_pp.pipeline.weight_store import drain_weight_store, stash_backward_input

    split_input, split_weight = ((backward_input, backward_weight) if retain
                                 else (stash_backward_input, drain_weight_store))

    model, runs = _chunk_runs(model_dict)
    cuts = CutCache()
    rows = []
    for c, run in enumerate(runs):
        samples: dict[str, list[float]] = {k: [] for k in ("B", "I", "W", "B_wall", "IW_wall")}
        for r in range(warmup + rounds):
            for kind in (("B", "IW") if r % 2 == 0 else ("IW", "B")):
                model.zero_grad(set_to_none=True)
                roots, grads, inputs = run()
                wall, cpu = time.perf_counter(), time.thread_time()
                if kind == "B":
                    fused_backward(roots, grads)
                    cpu_b, wall_b = time.thread_time() - cpu, time.perf_counter() - wall
                    if r >= warmup:
                        samples["B"].append(cpu_b)
                        samples["B_wall"].append(wall_b)
                    continue
                work = split_input(roots, grads, inputs, cuts, c)
                del roots, grads  # as the runtime does: the store's I lets the rest of the graph go
                cpu_i = time.thread_time() - cpu
                split_weight(work)
                cpu_w, wall_iw = time.thread_time() - cpu - cpu_i, time.perf_counter() - wall
                if r >= warmup:
                    samples["I"].append(cpu_i)
                    samples["W"].append(cpu_w)
                    samples["IW_wall"].append(wall_iw)
        med = {k: statistics.median(v) for k, v in samples.items()}
        ratios = [(i + w) / b for i, w, b in zip(samples["I"], samples["W"], samples["B"], strict=True)]
        rows.append({"chunk": c, "B_ms": 1e3 * med["B"], "I_ms": 1e3 * med["I"], "W_ms": 1e3 * med["W"],
                     "ratio": statistics.median(ratios), "wall_ratio": med["IW_wall"] / med["B_wall"]})
    return rows


def run(quick: bool, out_dir: Path | None, progress: Callable[[str], None]) -> dict:
    del out_dir  # tables only
    torch.set_num_threads(1)
    rounds, warmup = (20, 3) if quick else (60, 5)
    results = {}
    for name, model_dict in MODELS.items():
        for retain in (False, True):
            rows = measure(model_dict, rounds, warmup, retain=retain)
            total_b = sum(r["B_ms"] for r in rows)
            total = sum(r["I_ms"] + r["W_ms"] for r in rows) / total_b
            key = f"{name}_retained_graph" if retain else name
            results[key] = {"chunks": rows, "ratio": total}
            progress(f"  {key}: I + W = {total:.3f} x B (CPU time, all chunks); per chunk "
                     + ", ".join(f"{r['ratio']:.3f}" for r in rows))
    return {"models": results, "ratio": results["block_cached"]["ratio"], "rounds": rounds, "warmup": warmup,
            "layout": {"P": N_STAGES, "V": N_VIRTUAL, "microbatch_size": MICROBATCH_SIZE},
            "note": "ratio = (I + W) / B in thread CPU time, medians per chunk, summed over the chunks"}


def to_markdown(payload: dict) -> str:
    lines = ["## Split backward: I + W against B", "",
             f"Benchmark model cut into P = {payload['layout']['P']} x V = {payload['layout']['V']} chunks, "
             f"microbatches of {payload['layout']['microbatch_size']} sequences, one thread; per chunk the "
             f"median of {payload['rounds']} rounds (B and I + W alternating) after {payload['warmup']}; "
             "thread CPU time (wall time ratio beside it).", ""]
    for name, result in payload["models"].items():
        rows = [[r["chunk"], r["B_ms"], r["I_ms"], r["W_ms"], r["I_ms"] + r["W_ms"], f"{r['ratio']:.3f}",
                 f"{r['wall_ratio']:.3f}"] for r in result["chunks"]]
        lines += [f"**{name}**: I + W = **{result['ratio']:.3f} x B** over all chunks.", "",
                  markdown_table(["chunk", "B (ms)", "I (ms)", "W (ms)", "I + W (ms)", "(I + W) / B",
                                  "wall ratio"], rows), ""]
    return "\n".join(lines)
