"""`attnres-pp bench data`: what reading batches from a data folder (memory-mapped shards, read
through `data.token_folder.ShardedTokens`) adds to a training step, against the same tokens as one
in-memory array.

A folder of random tokens is written to a temporary directory (16 shards; 4M tokens with --quick,
64M otherwise); the benchmark model trains in one process, one thread, on batches of 16 x 64 = 1,024
tokens, and each round times one step whose batch comes from the folder and one from the array, in
alternating order (the same step index, so the same windows). Two figures: `step_overhead`, the
median step time with the folder over the one with the array, minus 1 (read and step together, as
the loop runs them; noisy on a loaded machine), and `read_overhead`, the median extra time of the
folder's read alone over the median step (the loader's own cost, little disturbed by load).
Target: under 2%. Beside them, informative, `step_overhead_paired`: the median over rounds of the
folder step over the array step of the same round, minus 1 (the drift of the machine's load between
rounds cancels in each ratio).
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from attnres_pp.bench.common import BENCH_MODEL, markdown_table, run_config

N_SHARDS = 16
MICROBATCHES = 4  # 4 microbatches of 4 sequences of 64: 1,024 tokens a step, the benchmarks' floor
TARGET = 0.02


def write_random_folder(folder: Path, n_tokens: int, vocab_size: int, seed: int = 0) -> None:
    """A data folder (raw-bytes tokenizer) of `n_tokens` random ids in N_SHARDS train shards, one val shard."""
    import json

    rng = np.random.default_rng(seed)
    per = -(-n_tokens // N_SHARDS)
    train = []
    for i in range(N_SHARDS):
        n = min(per, n_tokens - i * per)
        rng.integers(0, vocab_size, n, dtype=np.uint16).tofile(folder / f"train_{i:05d}.bin")
        train.append({"file": f"train_{i:05d}.bin", "tokens": n})
    n_val = 4096
    rng.integers(0, vocab_size, n_val, dtype=np.uint16).tofile(folder / "val_00000.bin")
    meta = {"format": "attnres-pp-tokens", "version": 1, "tokenizer": "bytes", "tokenizer_sha256": "bytes",
            "vocab_size": vocab_size, "dtype": "uint16", "eot_id": None, "seed": seed, "val_fraction": 0.0,
            "shard_tokens": per, "documents": {"train": 0, "val": 0}, "tokens": {"train": n_tokens, "val": n_val},
            "input_bytes": 0, "shards": {"train": train, "val": [{"file": "val_00000.bin", "tokens": n_val}]}}
    (folder / "meta.json").write_text(json.dumps(meta))


def measure(n_tokens: int, rounds: int, warmup: int, progress: Callable[[str], None]) -> dict:
    from attnres_pp.data import batch_at
    from attnres_pp.data.token_folder import open_token_folder
    from attnres_pp.train.engines import make_engine

    run_cfg = run_config(BENCH_MODEL, stages=1, virtual=1, schedule="1f1b", microbatches=MICROBATCHES)
    train, seq_len = run_cfg.train, run_cfg.model.seq_len
    root = Path(tempfile.mkdtemp(prefix="attnres-pp-bench-data-"))
    try:
        write_random_folder(root, n_tokens, run_cfg.model.vocab_size)
        folder = open_token_folder(root)
        in_memory = np.asarray(folder.train).copy()  # the baseline: the same tokens, one array in memory
        engine = make_engine(run_cfg)
        samples: dict[str, list[float]] = {k: [] for k in ("step_folder", "step_memory", "read_folder",
                                                           "read_memory")}
        for r in range(warmup + rounds):
            for source in (("folder", "memory") if r % 2 == 0 else ("memory", "folder")):
                tokens = folder.train if source == "folder" else in_memory
                t0 = time.perf_counter()
                inputs, targets = batch_at(tokens, r, train.batch_size, seq_len, train.seed)
                t1 = time.perf_counter()
                engine.train_step(r, inputs, targets, train.lr)
                t2 = time.perf_counter()
                if r >= warmup:
                    samples[f"read_{source}"].append(t1 - t0)
                    samples[f"step_{source}"].append(t2 - t0)
        engine.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in samples.items()}
    paired = statistics.median(f / m - 1 for f, m in zip(samples["step_folder"], samples["step_memory"], strict=True))
    result = {"tokens": n_tokens, "shards": N_SHARDS, "batch_size": train.batch_size, "seq_len": seq_len,
              **{f"{k}_ms": 1e3 * v for k, v in med.items()},
              "step_overhead": med["step_folder"] / med["step_memory"] - 1,
              "step_overhead_paired": paired,
              "read_overhead": (med["read_folder"] - med["read_memory"]) / med["step_memory"]}
    progress(f"  {n_tokens:,} tokens: step {result['step_memory_ms']:.2f} ms (array) vs "
             f"{result['step_folder_ms']:.2f} ms (folder), {100 * result['step_overhead']:+.2f}% "
             f"(per round {100 * paired:+.2f}%); read "
             f"{1e3 * result['read_memory_ms']:.1f} us vs {1e3 * result['read_folder_ms']:.1f} us, "
             f"{100 * result['read_overhead']:+.3f}% of a step")
    return result


def run(quick: bool, out_dir: Path | None, progress: Callable[[str], None]) -> dict:
    del out_dir  # tables only
    torch.set_num_threads(1)
    n_tokens, rounds, warmup = (4 << 20, 30, 3) if quick else (64 << 20, 100, 5)
    result = measure(n_tokens, rounds, warmup, progress)
    return {**result, "rounds": rounds, "warmup": warmup, "target": TARGET,
            "meets_target": result["read_overhead"] < TARGET and result["step_overhead"] < TARGET,
            "note": "step_overhead = median step (read + train) from the folder / from the array - 1; "
                    "step_overhead_paired = median over rounds of (folder step / array step of the round) - 1 "
                    "(informative: load drift between rounds cancels); "
                    "read_overhead = (median folder read - median array read) / median array step"}


def to_markdown(payload: dict) -> str:
    rows = [["in-memory array", payload["read_memory_ms"] * 1e3, payload["step_memory_ms"], ""],
            ["data folder (memmap)", payload["read_folder_ms"] * 1e3, payload["step_folder_ms"],
             f"{100 * payload['step_overhead']:+.2f}%"]]
    return "\n".join([
        "## Data loader: a data folder's memory-mapped shards against an in-memory array", "",
        f"{payload['tokens']:,} random tokens in {payload['shards']} shards; benchmark model, one process, one "
        f"thread, batch {payload['batch_size']} x {payload['seq_len']}; medians of {payload['rounds']} rounds "
        f"(folder and array alternating) after {payload['warmup']}.", "",
        markdown_table(["source", "read (us)", "step incl. read (ms)", "step overhead"], rows), "",
        f"Read overhead: **{100 * payload['read_overhead']:+.3f}% of a step**; step overhead "
        f"{100 * payload['step_overhead']:+.2f}% (target under {100 * payload['target']:.0f}%: "
        f"{'met' if payload['meets_target'] else 'not met'}); the median of each round's folder step over "
        f"its array step: {100 * payload.get('step_overhead_paired', float('nan')):+.2f}%.", ""])
