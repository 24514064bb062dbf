"""What the pipeline adds to a microbatch's F + B, counted rather than timed (the counts do not depend on
the machine's load): `attnres-pp bench overhead`'s model and pipeline (interleaved 1F1B, P = 2, V = 2,
m = 8, the cache on for Block AttnRes), every rank's runtime in this process over the loopback
transport, against the whole model's forward + backward of one microbatch in one process.

Per variant (standard, block_cached) it prints the dispatched aten ops per compute action (F0..F3,
B0..B3, per microbatch), the ops per microbatch that the pipelined path runs and the one-process path
does not, the Python calls per microbatch inside compute actions (cProfile) against one process, and
the tensors saved for backward per microbatch (the memory meter's packs) against one process.

Usage: PYTHONPATH=. python scripts/overhead_counts.py [--by-function]
(--by-function: also the Python calls per microbatch by function, pipelined minus one process, the
largest 25 differences)
"""

from __future__ import annotations

import collections
import cProfile
import pstats
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from attnres_pp.bench.common import BENCH_MODEL, MICROBATCH_SIZE, random_batch
from attnres_pp.bench.overhead import PIPELINE, VARIANTS
from attnres_pp.comm.partition import make_partition
from attnres_pp.comm.plan import plan_for_model
from attnres_pp.model import ModelConfig, Transformer
from attnres_pp.pipeline.chunk import build_rank_chunks
from attnres_pp.pipeline.loopback import make_loopback_runtimes, next_turn
from attnres_pp.pipeline.memory_meter import ActivationMeter
from attnres_pp.schedule.passes import insert_comm
from attnres_pp.schedule.schedules import build_schedule, schedule_placement


class OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _config(name: str) -> ModelConfig:
    return ModelConfig.from_dict({**BENCH_MODEL, **VARIANTS[name][0]})


def loopback_pipeline(name: str):
    """Variant `name` of `bench overhead`'s pipeline in this process: (model, m, every rank's loopback
    runtime, one step's inputs, targets)."""
    cfg, m = _config(name), PIPELINE["microbatches"]
    torch.manual_seed(0)
    model = Transformer(cfg)
    partition = make_partition(cfg.n_layers, PIPELINE["stages"], PIPELINE["virtual"],
                               placement=schedule_placement(PIPELINE["schedule"]))
    chunks = [build_rank_chunks(model, partition, r) for r in range(PIPELINE["stages"])]
    schedule = insert_comm(build_schedule(PIPELINE["schedule"], PIPELINE["stages"], PIPELINE["virtual"], m))
    runtimes = make_loopback_runtimes(cfg, chunks, plan_for_model(cfg, partition, VARIANTS[name][1]), schedule,
                                      (MICROBATCH_SIZE, cfg.seq_len))
    return model, m, runtimes, *random_batch(0, MICROBATCH_SIZE * m, cfg.seq_len, cfg.vocab_size)


def _pipelined_step(name: str):
    """A function running one pipelined step that calls `around(action, run)` for each compute action."""
    model, m, runtimes, inputs, targets = loopback_pipeline(name)

    def step(around) -> None:
        for runtime in runtimes:
            runtime.start_step(list(inputs.chunk(m)), list(targets.chunk(m)), 1.0 / m)
        index = -1
        while (index := next_turn(runtimes, index, "count")) is not None:
            runtime = runtimes[index]
            action = runtime.actions[runtime.cursor]
            if action.is_compute:
                around(action, runtime.run_next)
            else:
                runtime.run_next()
        for runtime in runtimes:
            runtime.finish_step()
        model.zero_grad(set_to_none=True)

    step(lambda _action, run: run())  # warm-up
    return step, m


def _one_process(name: str):
    cfg = _config(name)
    torch.manual_seed(0)
    model = Transformer(cfg)
    inputs, targets = random_batch(0, MICROBATCH_SIZE, cfg.seq_len, cfg.vocab_size)
    model(inputs, targets).backward()  # warm-up
    return lambda: model(inputs, targets).backward(), model, (inputs, targets)


def _python_calls(profile: cProfile.Profile, per: int) -> float:
    return sum(nc for (_f, _l, _n), (_cc, nc, *_rest) in pstats.Stats(profile).stats.items()) / per


def _calls_by_function(profile: cProfile.Profile, per: int) -> collections.Counter:
    calls: collections.Counter = collections.Counter()
    for (file, line, function), (_cc, nc, *_rest) in pstats.Stats(profile).stats.items():
        calls[f"{file.rsplit('/', 2)[-1]}:{line}:{function}"] += nc / per
    return calls


def print_calls_by_function(name: str, pipelined: cProfile.Profile, m: int, one: cProfile.Profile) -> None:
    a, b = _calls_by_function(pipelined, m), _calls_by_function(one, 1)
    extra = sorted(((a[k] - b[k], k) for k in set(a) | set(b)), key=lambda kv: -abs(kv[0]))[:25]
    print(f"{name}: Python calls per microbatch by function, pipelined minus one process: "
          + ", ".join(f"{k} {n:+g}" for n, k in extra if n))


def count(name: str, by_function: bool = False) -> None:
    step, m = _pipelined_step(name)
    per_action: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)

    def ops(action, run) -> None:
        with OpCounter() as counter:
            run()
        per_action[f"{action.kind.name}{action.chunk_index}"] += counter.counts

    step(ops)
    pipelined = sum(per_action.values(), collections.Counter())
    print(f"{name}: aten ops per microbatch and compute action: "
          + ", ".join(f"{k} {sum(v.values()) / m:g}" for k, v in sorted(per_action.items())))
    one_step, model, (inputs, targets) = _one_process(name)
    with OpCounter() as single:
        one_step()
    extra = {op: pipelined[op] / m - single.counts[op] for op in set(pipelined) | set(single.counts)}
    print(f"{name}: aten ops per microbatch, pipelined {sum(pipelined.values()) / m:g}, one process "
          f"{sum(single.counts.values())}; pipelined minus one process: "
          + ", ".join(f"{op} {n:+g}" for op, n in sorted(extra.items(), key=lambda kv: -abs(kv[1])) if n))
    profile = cProfile.Profile()

    def profiled(_action, run) -> None:
        profile.enable()
        run()
        profile.disable()

    step(profiled)
    one = cProfile.Profile()
    one.enable()
    one_step()
    one.disable()
    print(f"{name}: Python calls per microbatch in compute actions, pipelined {_python_calls(profile, m):g}, "
          f"one process {_python_calls(one, 1):g}")
    if by_function:
        print_calls_by_function(name, profile, m, one)
    packs = [0]
    original = ActivationMeter.pack

    def pack(meter, t):
        packs[0] += 1
        return original(meter, t)

    ActivationMeter.pack = pack  # every runtime's meter, for one step
    try:
        step(lambda _action, run: run())
    finally:
        ActivationMeter.pack = original
    pipelined_saves, packs[0] = packs[0] / m, 0
    loss = pack_counted(model, inputs, targets, ActivationMeter(), packs)
    loss.backward()
    print(f"{name}: tensors saved for backward per microbatch, pipelined {pipelined_saves:g}, one process {packs[0]}")


def pack_counted(model, inputs, targets, meter, packs):
    """The one-process forward with every saved tensor counted through `meter`."""
    def pack(t):
        packs[0] += 1
        return meter.pack(t)

    with torch.autograd.graph.saved_tensors_hooks(pack, meter.unpack):
        return model(inputs, targets)


if __name__ == "__main__":
    torch.set_num_threads(1)
    for variant in ("standard", "block_cached"):
        count(variant, by_function="--by-function" in sys.argv[1:])
