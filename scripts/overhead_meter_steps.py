"""What the activation meter costs a pipelined step, timed within one process: `attnres-pp bench
overhead`'s model and pipeline (interleaved 1F1B, P = 2, V = 2, m = 8, the cache on for Block AttnRes),
every rank's runtime over the loopback transport, the standard and Block AttnRes runs stepped in
rotation with the meter on (`StageRuntime.meter_every_step`, the slow twin) and off (steps after the
first metered ones, `pipeline.meter_steps`). Timed in CPU seconds of this thread (`time.thread_time`:
every rank's actions run in it), which a loaded machine's waiting does not enter, whole steps
(compute and the loopback's messages). Reported: the medians of a step's CPU seconds, the Block /
standard ratio with the meter on and off, paired by round, and their quotient: what metering every
step adds to the pipelined Block / standard ratio.

Usage: PYTHONPATH=. python scripts/overhead_meter_steps.py [ROUNDS]   (default 8)
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from attnres_pp.bench.common import BENCH_MODEL, MICROBATCH_SIZE, random_batch
from attnres_pp.bench.overhead import PIPELINE, VARIANTS
from attnres_pp.comm.partition import make_partition
from attnres_pp.comm.plan import plan_for_model
from attnres_pp.model import ModelConfig, Transformer
from attnres_pp.pipeline.chunk import build_rank_chunks
from attnres_pp.pipeline.loopback import make_loopback_runtimes, run_loopback_step
from attnres_pp.schedule.passes import insert_comm
from attnres_pp.schedule.schedules import build_schedule, schedule_placement


def pipelined(name: str):
    """A function running one step of variant `name` (meter on or off) and returning its CPU seconds."""
    cfg, m = ModelConfig.from_dict({**BENCH_MODEL, **VARIANTS[name][0]}), PIPELINE["microbatches"]
    torch.manual_seed(0)
    model = Transformer(cfg)
    partition = make_partition(cfg.n_layers, PIPELINE["stages"], PIPELINE["virtual"],
                               placement=schedule_placement(PIPELINE["schedule"]))
    chunks = [build_rank_chunks(model, partition, r) for r in range(PIPELINE["stages"])]
    schedule = insert_comm(build_schedule(PIPELINE["schedule"], PIPELINE["stages"], PIPELINE["virtual"], m))
    runtimes = make_loopback_runtimes(cfg, chunks, plan_for_model(cfg, partition, VARIANTS[name][1]), schedule,
                                      (MICROBATCH_SIZE, cfg.seq_len))
    inputs, targets = random_batch(0, MICROBATCH_SIZE * m, cfg.seq_len, cfg.vocab_size)

    def step(meter_on: bool) -> float:
        for runtime in runtimes:
            runtime.meter_every_step = meter_on
        started = time.thread_time()
        run_loopback_step(runtimes, list(inputs.chunk(m)), list(targets.chunk(m)), 1.0 / m)
        spent = time.thread_time() - started
        model.zero_grad(set_to_none=True)
        return spent

    for _ in range(2):  # the metered first steps (`meter_steps.METERED_STEPS`)
        step(False)
    return step


def main(rounds: int) -> None:
    torch.set_num_threads(1)
    steps = {name: pipelined(name) for name in ("standard", "block_cached")}
    runs = [(name, on) for on in (True, False) for name in steps]
    seconds: dict = {run: [] for run in runs}
    for index in range(rounds):
        shift = index % len(runs)
        for name, on in runs[shift:] + runs[:shift]:
            seconds[(name, on)].append(steps[name](on))
    med = {run: statistics.median(v) for run, v in seconds.items()}
    for (name, on), value in med.items():
        print(f"{name} meter {'on ' if on else 'off'}: {value * 1e3:.1f} CPU ms a step (median of {rounds})")
    ratio_on = statistics.median(b / s for b, s in zip(seconds[("block_cached", True)], seconds[("standard", True)],
                                                       strict=True))
    ratio_off = statistics.median(b / s for b, s in zip(seconds[("block_cached", False)],
                                                        seconds[("standard", False)], strict=True))
    print(f"Block / standard CPU time, paired by round: meter on {ratio_on:.3f}, off {ratio_off:.3f}; "
          f"on / off {ratio_on / ratio_off:.3f}")
    for name in steps:
        share = statistics.median(a / b for a, b in zip(seconds[(name, True)], seconds[(name, False)], strict=True))
        print(f"{name}: meter on / off, paired by round: {share:.3f}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 8)
