"""Count what each pipeline rank holds during one real training step, action by action: the bytes
saved for backward that are alive (each storage once, parameters excluded) and the cross-stage
cache's entries plus gradient deposits, for comparison with `simulator.memory`.

The step is the real runtime (`StageRuntime`, every schedule, I/W split included) over the loopback
transport, all ranks in this process taking turns. Each rank's own activation meter
(`pipeline.memory_meter`, the counter behind `memory_per_rank`) counts its saved storages; the
peak and the action it was reached in are read after every action, the cache after every action.
"""

from __future__ import annotations

import torch

from attnres_pp.comm.partition import make_partition
from attnres_pp.comm.plan import plan_for_model
from attnres_pp.model.config import ModelConfig
from attnres_pp.pipeline.chunk import build_rank_model
from attnres_pp.pipeline.loopback import make_loopback_runtimes, run_loopback_step
from attnres_pp.schedule.passes import insert_comm
from attnres_pp.schedule.schedules import build_schedule, schedule_placement


def _cache_bytes(runtime) -> int:
    # Deposits are the gradients the cache holds until their entry's chunk collects them.
    return runtime.cache.held_bytes


def count_step(cfg: ModelConfig, *, schedule_name: str, n_stages: int, n_virtual: int, n_microbatches: int,
               n_sequences: int, cache: bool = True, dtype: str = "fp32", activation_checkpoint: str = "none",
               seed: int = 0) -> list[dict]:
    """Per pipeline rank: {"activation_peak_bytes", "cache_peak_bytes"} of one step, and the action
    (its printed form) after which the activation count peaked. `activation_checkpoint`: the chunks'
    policy (`pipeline.activation_checkpoint`), as a training run applies it."""
    torch.manual_seed(seed)
    precision = "bf16" if dtype == "bf16" else "fp32"
    partition = make_partition(cfg.n_layers, n_stages, n_virtual, placement=schedule_placement(schedule_name))
    built = [build_rank_model(cfg, partition, r, seed=seed, precision=precision,
                              activation_checkpoint=activation_checkpoint) for r in range(n_stages)]
    schedule = insert_comm(build_schedule(schedule_name, n_stages, n_virtual, n_microbatches))
    plan = plan_for_model(cfg, partition, cache)
    act_dtype = torch.bfloat16 if dtype == "bf16" else None
    runtimes = make_loopback_runtimes(cfg, [chunks for _model, chunks in built], plan, schedule,
                                      (n_sequences, cfg.seq_len), activation_dtype=act_dtype)
    # The runtime's own meter (`pipeline.memory_meter`, what `memory_per_rank` reports) counts what
    # each rank saves; an outer saved-tensor hook would see nothing, as the meter's hooks are inner.
    peaks = [{"activation_peak_bytes": 0, "cache_peak_bytes": 0, "peak_action": ""} for _ in range(n_stages)]
    for runtime in runtimes:
        original = runtime.run_next

        def run_next(runtime=runtime, original=original):
            action = str(runtime.actions[runtime.cursor])
            result = original()
            peak = peaks[runtime.pp_rank]
            if runtime.memory.peak_bytes > peak["activation_peak_bytes"]:
                peak["activation_peak_bytes"], peak["peak_action"] = runtime.memory.peak_bytes, action
            peak["cache_peak_bytes"] = max(peak["cache_peak_bytes"], _cache_bytes(runtime))
            return result

        runtime.run_next = run_next
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (n_microbatches * n_sequences, cfg.seq_len + 1), generator=generator)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    run_loopback_step(runtimes, list(inputs.chunk(n_microbatches)), list(targets.chunk(n_microbatches)),
                      1.0 / n_microbatches)
    return peaks
