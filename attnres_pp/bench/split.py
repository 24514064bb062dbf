"""`attnres-pp bench split`: the backward split in I and W against the fused backward B, per chunk.

The benchmark model (Block AttnRes with the cache, and the standard residual), cut into P = 2,
V = 2 chunks, at a user's step (16 sequences of 64: 1,024 tokens a microbatch), in fp32 and under
bf16 autocast; one process, one thread. Per chunk and round: a forward, then B; a forward, then I
and W (the runtime's own functions, with its per-chunk cut cache warm: the weight store, and in
fp32 the retained-graph twin beside it), in alternating order.
Both the thread's CPU time (what the split costs in work, little disturbed by other load) and wall
time are recorded; medians over rounds. Target: I + W within 5% of B. Beside the times, the
backward's matrix-product FLOPs counted in I and in W (`bench.split_flops`), for these models and
a mixture of experts: W's share must not depend on the precision.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from attnres_pp.bench.common import BENCH_MODEL, markdown_table

MODELS = {"block_cached": {**BENCH_MODEL, "residual": "attnres", "block_size": 4},
          "standard": {**BENCH_MODEL, "residual": "standard", "block_size": 1}}
# Counted only (FLOPs): Block AttnRes with eight routed experts (two a token) and a shared one.
MOE_MODEL = {**MODELS["block_cached"], "moe_experts": 8, "moe_top_k": 2, "moe_shared_experts": 1, "moe_d_ff": 64,
             "moe_dense_layers": 1}
PRECISIONS = ("fp32", "bf16")
N_STAGES, N_VIRTUAL = 2, 2
MICROBATCH_SIZE = 16  # sequences of 64: 1,024 tokens a microbatch
# (precision, retained graph, activation checkpointing, store): the weight store, bf16, the slow
# twin; under full checkpointing the gradient store (W recomputes each layer) and the operand store.
RUNS = (("fp32", False, "none", None), ("bf16", False, "none", None), ("fp32", True, "none", None),
        ("fp32", False, "full", None), ("fp32", False, "full", "operands"))


def _chunk_runs(model_dict: dict, seed: int = 0, precision: str = "fp32", activation_checkpoint: str = "none"):
    """Per chunk a function that runs one forward and returns (roots, root grads, input leaves)."""
    from attnres_pp.comm.partition import make_partition
    from attnres_pp.comm.plan import plan_for_model
    from attnres_pp.model import ModelConfig, Transformer
    from attnres_pp.model.precision import activation_dtype
    from attnres_pp.pipeline.chunk import build_rank_chunks

    cfg = ModelConfig(**model_dict)
    torch.manual_seed(seed)
    model = Transformer(cfg, precision=precision)
    partition = make_partition(cfg.n_layers, N_STAGES, N_VIRTUAL)
    plan = plan_for_model(cfg, partition, cache=True)
    width = cfg.d_model if cfg.residual == "standard" else cfg.source_width
    generator = torch.Generator().manual_seed(seed)
    runs = []
    for c in range(partition.n_chunks):
        chunk = build_rank_chunks(model, partition, partition.rank_of(c),
                                  activation_checkpoint=activation_checkpoint)[c]
        io = plan.chunks[c]
        idx = torch.randint(0, cfg.vocab_size, (MICROBATCH_SIZE, cfg.seq_len), generator=generator)
        source = torch.randn(MICROBATCH_SIZE, cfg.seq_len, width, generator=generator).to(activation_dtype(precision))

        def run(chunk=chunk, io=io, idx=idx, source=source):
            inputs = [source.clone().requires_grad_(True) for _ in io.received + io.cache_reads]
            produced, loss = chunk(dict(zip(io.received + io.cache_reads, inputs, strict=True)), idx, idx)
            if loss is not None:
                return [loss], [torch.ones_like(loss)], inputs
            roots = list(produced.values())
            return roots, [torch.ones_like(r) for r in roots], inputs

        runs.append(run)
    return model, runs


def measure(model_dict: dict, rounds: int, warmup: int, *, retain: bool = False, precision: str = "fp32",
            activation_checkpoint: str = "none", store: str | None = None) -> list[dict]:
    """`retain`: the split's slow twin (I keeps the graph until W) instead of the weight store;
    `store`: None, the store the rule chooses (under full checkpointing the gradient store, whose W
    recomputes the layers), or "operands"."""
    from attnres_pp.pipeline.graph_cut import CutCache
    from attnres_pp.pipeline.split_backward import backward_input, backward_weight, fused_backward
    from attnres_pp.pipeline.weight_store import drain_weight_store, stash_backward_input

    split_input, split_weight = ((backward_input, backward_weight) if retain
                                 else (functools.partial(stash_backward_input, kind=store), drain_weight_store))

    model, runs = _chunk_runs(model_dict, precision=precision, activation_checkpoint=activation_checkpoint)
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


def flop_shares(model_dict: dict, precision: str) -> dict:
    """Counted FLOPs of B, I and W per chunk (one microbatch) and W's share of I + W."""
    from attnres_pp.bench.split_flops import chunk_backward_flops, w_share

    model, runs = _chunk_runs(model_dict, precision=precision)
    rows = [{"chunk": c, **{k: v for k, v in chunk_backward_flops(run, model, c).items() if not k.endswith("_ops")}}
            for c, run in enumerate(runs)]
    return {"chunks": rows, "w_share": w_share(rows)}


def run(quick: bool, out_dir: Path | None, progress: Callable[[str], None]) -> dict:
    del out_dir  # tables only
    torch.set_num_threads(1)
    rounds, warmup = (12, 2) if quick else (30, 3)
    results, flops = {}, {}
    for name, model_dict in {**MODELS, "block_cached_moe": MOE_MODEL}.items():
        for precision in PRECISIONS:
            flops[f"{name} {precision}"] = counted = flop_shares(model_dict, precision)
            progress(f"  {name} {precision}: W = {counted['w_share']:.3f} of the split's backward FLOPs")
    for name, model_dict in MODELS.items():
        for precision, retain, ac, store in RUNS:
            rows = measure(model_dict, rounds, warmup, retain=retain, precision=precision, activation_checkpoint=ac,
                           store=store)
            total_b = sum(r["B_ms"] for r in rows)
            total = sum(r["I_ms"] + r["W_ms"] for r in rows) / total_b
            key = f"{name} {precision}" + (" retained_graph" if retain else "") + (f" ac_{ac}" if ac != "none" else "")
            key += f" {store}_store" if store else ""
            results[key] = {"chunks": rows, "ratio": total}
            progress(f"  {key}: I + W = {total:.3f} x B (CPU time, all chunks); per chunk "
                     + ", ".join(f"{r['ratio']:.3f}" for r in rows))
    return {"models": results, "ratio": results["block_cached fp32"]["ratio"],
            "ratio_bf16": results["block_cached bf16"]["ratio"], "flops": flops, "rounds": rounds,
            "warmup": warmup, "layout": {"P": N_STAGES, "V": N_VIRTUAL, "microbatch_size": MICROBATCH_SIZE},
            "note": "ratio = (I + W) / B in thread CPU time, medians per chunk, summed over the chunks"}


def to_markdown(payload: dict) -> str:
    lines = ["## Split backward: I + W against B", "",
             f"Benchmark model cut into P = {payload['layout']['P']} x V = {payload['layout']['V']} chunks, "
             f"microbatches of {payload['layout']['microbatch_size']} sequences, one thread; per chunk the "
             f"median of {payload['rounds']} rounds (B and I + W alternating) after {payload['warmup']}; "
             "thread CPU time (wall time ratio beside it).", "",
             "**Backward FLOPs counted** (matrix products, one microbatch, chunks 1-3: chunk 0's whole "
             "backward is W):", "",
             markdown_table(["model", "B (MFLOP)", "I (MFLOP)", "W (MFLOP)", "W share"],
                            [[name, sum(r["B"] for r in f["chunks"][1:]) / 1e6,
                              sum(r["I"] for r in f["chunks"][1:]) / 1e6, sum(r["W"] for r in f["chunks"][1:]) / 1e6,
                              f"{f['w_share']:.3f}"] for name, f in payload["flops"].items()]), ""]
    for name, result in payload["models"].items():
        rows = [[r["chunk"], r["B_ms"], r["I_ms"], r["W_ms"], r["I_ms"] + r["W_ms"], f"{r['ratio']:.3f}",
                 f"{r['wall_ratio']:.3f}"] for r in result["chunks"]]
        lines += [f"**{name}**: I + W = **{result['ratio']:.3f} x B** over all chunks.", "",
                  markdown_table(["chunk", "B (ms)", "I (ms)", "W (ms)", "I + W (ms)", "(I + W) / B",
                                  "wall ratio"], rows), ""]
    return "\n".join(lines)
