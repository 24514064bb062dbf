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

from attnres_pp.pipeline.loopback import run_loopback_step
from scripts.overhead_counts import loopback_pipeline


def pipelined(name: str):
    """A function running one step of variant `name` (meter on or off) and returning its CPU seconds."""
    model, m, runtimes, inputs, targets = loopback_pipeline(name)

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
