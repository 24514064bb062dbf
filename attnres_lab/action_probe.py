"""The runtime's own cost per chunk action: what a forward (backward) action costs beyond its units
of work (`attnres_lab.unit_probe`), for entering the chunk, its inputs, its outputs and its autograd call.

A run calibrated at V = 1 folds this cost into its units, so it prices V = 2 (twice the actions of
half the size) too cheap. It is measured here before any run it helps predict, never fitted to
them: one rank in this process (P = 1, the in-process launcher, so no message crosses a process)
runs the model as V = 1 and as V = 4 chunks, alternated round by round. A microbatch's forward
(backward) compute summed over the chunks grows by one action cost per extra chunk, less what the
units say the extra chunk boundaries cost (depth reads split into more segments):

    action = (sum_V4 - sum_V1 - (units_V4 - units_V1)) / (4 - 1)

with each sum the medians of the actions' wall seconds per (kind, chunk), taken over steps and then
over rounds. Returned as {"fwd_s", "bwd_s"} (never below 0), which `attnres_lab.transfer_fit` adds to
every chunk.
"""

from __future__ import annotations

import statistics

from attnres_lab.transfer_fit import unit_times_from_probe
from attnres_pp.bench.common import MICROBATCH_SIZE, TimedEngine, run_config
from attnres_pp.comm.partition import make_partition
from attnres_pp.model.config import ModelConfig
from attnres_pp.schedule.timeline import median_action_s
from attnres_pp.simulator.units import chunk_work

VIRTUALS = (1, 4)
SCHEDULE = "interleaved_1f1b"


def _per_microbatch_s(engine: TimedEngine) -> dict[str, float]:
    """{"fwd", "bwd"}: the median action's seconds per (kind, chunk), summed over chunks."""
    medians = median_action_s([sample.events for sample in engine.samples[1:]])  # the first step warms up
    return {"fwd": sum(s for (kind, _), s in medians.items() if kind == "F"),
            "bwd": sum(s for (kind, _), s in medians.items() if kind != "F")}


def _units_s(probe: dict, cfg: ModelConfig, virtual: int) -> dict[str, float]:
    partition = make_partition(cfg.n_layers, 1, virtual)
    works = [chunk_work(cfg, partition, c) for c in range(partition.n_chunks)]
    return {direction: sum(unit_times_from_probe({**probe, "action": {}}, direction).chunk_s(w) for w in works)
            for direction in ("fwd", "bwd")}


def probe_action_cost(model: dict, probe: dict, *, microbatches: int = 4, steps: int = 6,
                      rounds: int = 3) -> dict:
    """Seconds per action beyond its units, {"fwd_s", "bwd_s"}, for `model` (a ModelConfig dict)
    in microbatches of MICROBATCH_SIZE sequences; `probe` is `probe_units` of the same model."""
    cfg = ModelConfig.from_dict(model)
    sums: dict[int, list[dict[str, float]]] = {virtual: [] for virtual in VIRTUALS}
    for _ in range(rounds):
        for virtual in VIRTUALS:
            engine = TimedEngine(run_config(model, stages=1, virtual=virtual, schedule=SCHEDULE,
                                            microbatches=microbatches, launcher="inprocess"))
            try:
                for _ in range(steps + 1):
                    engine.step()
            finally:
                engine.close()
            sums[virtual].append(_per_microbatch_s(engine))
    low, high = VIRTUALS
    units = {virtual: _units_s(probe, cfg, virtual) for virtual in VIRTUALS}
    cost = {}
    for direction in ("fwd", "bwd"):
        measured = {v: statistics.median(s[direction] for s in sums[v]) for v in VIRTUALS}
        extra = measured[high] - measured[low] - (units[high][direction] - units[low][direction])
        cost[f"{direction}_s"] = max(0.0, extra / (high - low))
    return {**cost, "virtuals": list(VIRTUALS), "microbatch_size": MICROBATCH_SIZE,
            "rounds": rounds, "steps": steps}
