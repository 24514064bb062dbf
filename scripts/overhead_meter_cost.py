"""CPU time of the one-process model's forward + backward of one microbatch (`bench overhead`'s model,
standard and Block AttnRes) with no saved-tensor meter, and with the memory meter of each tree named,
in rotation; thread CPU time, medians. What the meter costs per microbatch, as the pipeline pays it
on every saved tensor.

Usage: PYTHONPATH=. python scripts/overhead_meter_cost.py ROUNDS TREE [TREE ...]
(each TREE a checkout whose attnres_pp/pipeline/memory_meter.py is loaded under its own name)
"""

from __future__ import annotations

import contextlib
import importlib.util
import statistics
import sys
import time

import torch

from attnres_pp.bench.common import BENCH_MODEL, MICROBATCH_SIZE, random_batch
from attnres_pp.bench.overhead import VARIANTS
from attnres_pp.model import ModelConfig, Transformer


def load_meter(tree: str, index: int):
    spec = importlib.util.spec_from_file_location(f"meter_{index}", f"{tree}/attnres_pp/pipeline/memory_meter.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ActivationMeter


def main(rounds: int, trees: list[str]) -> None:
    torch.set_num_threads(1)
    meters = {tree: load_meter(tree, i) for i, tree in enumerate(trees)}
    modes = {"none": contextlib.nullcontext, **{tree: (lambda m=m: m().saving()) for tree, m in meters.items()}}
    medians = {}
    for name in ("standard", "block_cached"):
        torch.manual_seed(0)
        model = Transformer(ModelConfig.from_dict({**BENCH_MODEL, **VARIANTS[name][0]}))
        inputs, targets = random_batch(0, MICROBATCH_SIZE, BENCH_MODEL["seq_len"], BENCH_MODEL["vocab_size"])
        times: dict[str, list[float]] = {k: [] for k in modes}
        for r in range(rounds + 2):
            for mode in (list(modes) if r % 2 else list(modes)[::-1]):
                started = time.thread_time()
                with modes[mode]():
                    loss = model(inputs, targets)
                loss.backward()
                if r >= 2:
                    times[mode].append(time.thread_time() - started)
        medians[name] = {k: statistics.median(v) for k, v in times.items()}
        print(f"{name}: " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in medians[name].items())
              + "; meter cost " + ", ".join(f"{k} {(medians[name][k] - medians[name]['none']) * 1e3:.2f} ms"
                                          for k in meters))
    for k in modes:
        print(f"{k}: Block / standard {medians['block_cached'][k] / medians['standard'][k]:.4f}")


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2:])
