"""MSAR's stream convolutions before and after `stream_conv.shifted_streams`, paired in one process.

`python scripts/msar_streams_ab.py single|loopback WARMUP ROUNDS` (one thread): the standard
residual, MSAR with the slow twin (`shifted_streams_twin`, the graph the code built before) and MSAR
with the fast function, at bench variants' target shape (16 layers, d = 256, 4 x 256 tokens), built
once and stepped in rotation, so load drift falls on all three alike; ratios are paired within a
round, of wall time and of the thread's CPU time. `single`: forward + backward of the whole batch.
`loopback`: every rank of bench variants' pipeline (P = 2, V = 2, interleaved 1F1B, 4 microbatches,
cache on) in this process over loopback hops: the ranks run one after another, so a step is the
pipeline's total compute, not its wall time.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch

import attnres_pp.model.depth as depth
from attnres_pp.bench.common import random_batch
from attnres_pp.bench.variants import PIPELINE, SINGLE_BATCH, TARGET_SHAPE, _rotations, variant_overrides
from attnres_pp.model import ModelConfig, Transformer
from attnres_pp.model.stream_conv import shifted_streams, shifted_streams_twin

IMPLEMENTATIONS = {"standard": shifted_streams, "msar_before": shifted_streams_twin, "msar_after": shifted_streams}


def build_step(name: str, mode: str, inputs_BT: torch.Tensor, targets_BT: torch.Tensor):
    cfg = ModelConfig.from_dict({**TARGET_SHAPE, **variant_overrides(4)[name.split("_")[0]]})
    torch.manual_seed(0)
    model = Transformer(cfg)
    if mode == "single":
        def run() -> None:
            model(inputs_BT, targets_BT).backward()
    else:
        from attnres_pp.comm.partition import make_partition
        from attnres_pp.comm.plan import plan_for_model
        from attnres_pp.pipeline.chunk import build_rank_chunks
        from attnres_pp.pipeline.loopback import make_loopback_runtimes, run_loopback_step
        from attnres_pp.schedule.passes import insert_comm
        from attnres_pp.schedule.schedules import build_schedule, schedule_placement

        p, v, m, schedule = PIPELINE["stages"], PIPELINE["virtual"], PIPELINE["microbatches"], PIPELINE["schedule"]
        partition = make_partition(cfg.n_layers, p, v, placement=schedule_placement(schedule))
        chunks = [build_rank_chunks(model, partition, r) for r in range(p)]
        runtimes = make_loopback_runtimes(cfg, chunks, plan_for_model(cfg, partition, True),
                                          insert_comm(build_schedule(schedule, p, v, m)),
                                          (SINGLE_BATCH // m, cfg.seq_len))

        def run() -> None:
            run_loopback_step(runtimes, list(inputs_BT.chunk(m)), list(targets_BT.chunk(m)), 1.0 / m)

    def step() -> tuple[float, float]:
        depth.shifted_streams = IMPLEMENTATIONS[name]  # what this model's stream expansions call
        started, started_cpu = time.perf_counter(), time.thread_time()
        run()
        elapsed, cpu = time.perf_counter() - started, time.thread_time() - started_cpu
        for param in model.parameters():
            param.grad = None
        return elapsed, cpu

    return step


def main(mode: str, warmup: int, rounds: int) -> None:
    torch.set_num_threads(1)
    print("load before", os.getloadavg(), flush=True)
    inputs_BT, targets_BT = random_batch(0, SINGLE_BATCH, TARGET_SHAPE["seq_len"], TARGET_SHAPE["vocab_size"])
    steps = {name: build_step(name, mode, inputs_BT, targets_BT) for name in IMPLEMENTATIONS}
    walls: dict[str, list[float]] = {name: [] for name in steps}
    cpus: dict[str, list[float]] = {name: [] for name in steps}
    for index, order in _rotations(tuple(steps), warmup + rounds):
        for name in order:
            elapsed, cpu = steps[name]()
            if index >= warmup:
                walls[name].append(elapsed)
                cpus[name].append(cpu)
    # The thread's CPU time beside the wall time: on a shared machine the wall time of a step also
    # counts the time the thread waited for a core.
    for label, times in (("wall", walls), ("thread CPU", cpus)):
        print(f"-- {label} time")
        report(times)
    print("load after", os.getloadavg())


def report(times: dict[str, list[float]]) -> None:
    for name in ("msar_before", "msar_after"):
        ratios = [a / b for a, b in zip(times[name], times["standard"], strict=True)]
        print(f"{name} / standard: median {statistics.median(ratios):.3f}, rounds", [round(r, 3) for r in ratios])
    ratios = [a / b for a, b in zip(times["msar_after"], times["msar_before"], strict=True)]
    print(f"after / before: median {statistics.median(ratios):.3f}, rounds", [round(r, 3) for r in ratios])
    print("median step (s):", {name: round(statistics.median(t), 3) for name, t in times.items()})


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] not in ("single", "loopback"):
        sys.exit("error: usage: python scripts/msar_streams_ab.py single|loopback WARMUP ROUNDS")
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
