"""A one-process training run two ways, in one process, step for step: the whole model in the driver
(`SingleProcessEngine`, what `--launcher local` with one chunk runs) against one rank on the thread
rank group (`--launcher inprocess` with one stage: the one `Engine` under `OneGroup`), on the
demo's model and batch (`attnres-pp train`'s defaults), CPU, one thread.

    OMP_NUM_THREADS=1 PYTHONPATH=. python3 scripts/one_rank_speed.py [ROUNDS]    # default 60

Both engines read the same corpus; each round steps both, their order alternating, so the
machine's drift falls on both alike; the first 5 rounds are warm-up. Prints the largest loss
difference (the two compute the same step), each engine's median step time, the median per-round
ratio one_rank / single, and the load average.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch

from attnres_pp.data import load_corpus
from attnres_pp.train.config import RunConfig
from attnres_pp.train.engines import make_engine

WARMUP = 5


def main(rounds: int) -> None:
    torch.set_num_threads(1)
    single_cfg = RunConfig.from_dict({"train": {"steps": rounds + WARMUP, "device": "cpu"},
                                      "pipeline": {"launcher": "local"}})
    rank_cfg = RunConfig.from_dict({**single_cfg.to_dict(),
                                    "pipeline": {**single_cfg.pipeline.to_dict(), "launcher": "inprocess"}})
    corpus = load_corpus(single_cfg.train.data)
    engines = {"single": make_engine(single_cfg, corpus=corpus), "one_rank": make_engine(rank_cfg, corpus=corpus)}
    times: dict[str, list[float]] = {name: [] for name in engines}
    losses: dict[str, list[float]] = {name: [] for name in engines}
    try:
        for step in range(rounds + WARMUP):
            for name in (("single", "one_rank") if step % 2 == 0 else ("one_rank", "single")):
                start = time.perf_counter()
                losses[name].append(engines[name].train_step(step, None, None, 1e-3).loss)
                if step >= WARMUP:
                    times[name].append(time.perf_counter() - start)
    finally:
        for engine in engines.values():
            engine.close()
    ratios = [b / a for a, b in zip(times["single"], times["one_rank"], strict=True)]
    print(f"engines: {', '.join(f'{n} = {type(e).__name__}' for n, e in engines.items())}")
    print(f"largest loss difference: {max(abs(a - b) for a, b in zip(*losses.values(), strict=True)):.3g}")
    for name, seconds in times.items():
        print(f"{name}: median step {1000 * statistics.median(seconds):.1f} ms over {len(seconds)} steps")
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"median per-round ratio one_rank / single: {statistics.median(ratios):.4f} (load average {load})")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 60)
