"""`attnres-pp bench checkpoint`: what a checkpoint save costs the training loop, blocking against
`--async-checkpoint`.

One pipelined engine (local launcher, P = 2, 1F1B, a step of 2,048 tokens; rank processes of one
thread each), stepped in rounds. Each round runs three phases, in an order that rotates from round
to round so that drift in the machine's load falls on all of them alike:
- none: `STEPS_PER_PHASE` steps with no save (the baseline step time);
- async: `begin_checkpoint` (the time the loop is blocked: each rank copies its state), then
  steps until every rank's background write is done (`checkpoint_written`, polled after each step,
  as the training loop does); the step times of those steps are "while a save runs";
- blocking: `save_checkpoint` of the same engine, the whole save's time.
Reported: medians of each, the ratio of a step's time while an async save runs to a step with
none, and the checkpoint's size on disk. Every save goes into a scratch folder, removed after.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from attnres_pp.bench.common import TimedEngine, markdown_table, run_config

MODEL = {"vocab_size": 256, "n_layers": 8, "d_model": 256, "n_heads": 4, "seq_len": 128,
         "residual": "attnres", "block_size": 4}
QUICK_MODEL = {**MODEL, "d_model": 128, "seq_len": 64}
PIPELINE = {"stages": 2, "virtual": 1, "schedule": "1f1b", "microbatches": 4}
MICROBATCH_SIZE = 4  # 4 x 4 sequences of 128 tokens: 2,048 tokens a step (quick: 1,024)
STEPS_PER_PHASE = 4
PHASES = ("none", "async", "blocking")


def _folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def _phase(timed: TimedEngine, phase: str, scratch: Path, index: int, out: dict) -> None:
    engine = timed.engine
    if phase == "none":
        out["none_step_s"] += [timed.step().wall_s for _ in range(STEPS_PER_PHASE)]
        return
    folder = scratch / f"{phase}_{index}"
    folder.mkdir()
    if phase == "blocking":
        started = time.perf_counter()
        engine.save_checkpoint(folder)
        out["blocking_save_s"].append(time.perf_counter() - started)
    else:
        started = time.perf_counter()
        engine.begin_checkpoint(folder)
        out["async_begin_s"].append(time.perf_counter() - started)
        steps = 0
        while True:
            out["async_step_s"].append(timed.step().wall_s)
            steps += 1
            if engine.checkpoint_written():
                break
        engine.finish_checkpoint()
        out["async_write_s"].append(time.perf_counter() - started)
        out["async_steps_per_save"].append(steps)
    out["checkpoint_bytes"] = _folder_bytes(folder)
    shutil.rmtree(folder)


def run(quick: bool, out_dir: Path | None, progress: Callable[[str], None]) -> dict:
    del out_dir  # tables only
    model = QUICK_MODEL if quick else MODEL
    rounds, warmup = (3, 1) if quick else (8, 2)
    cfg = run_config(model, microbatch_size=MICROBATCH_SIZE, **PIPELINE)
    timed = TimedEngine(cfg)
    samples = {key: [] for key in ("none_step_s", "async_step_s", "async_begin_s", "async_write_s",
                                   "async_steps_per_save", "blocking_save_s")}
    samples["checkpoint_bytes"] = 0
    load_before = os.getloadavg()
    scratch = Path(tempfile.mkdtemp(prefix="attnres-bench-checkpoint-"))
    try:
        for _ in range(warmup):
            timed.step()
        for r in range(rounds):
            order = PHASES[r % 3:] + PHASES[:r % 3]
            for phase in order:
                _phase(timed, phase, scratch, r, samples)
            progress(f"  round {r + 1}/{rounds} ({', '.join(order)}): step "
                     f"{1e3 * statistics.median(samples['none_step_s']):.0f} ms without a save, "
                     f"{1e3 * statistics.median(samples['async_step_s']):.0f} ms beside an async one")
    finally:
        timed.close()
        shutil.rmtree(scratch, ignore_errors=True)
    med = {key: statistics.median(value) for key, value in samples.items() if isinstance(value, list)}
    tokens = MICROBATCH_SIZE * PIPELINE["microbatches"] * model["seq_len"]
    return {
        "model": model, "pipeline": PIPELINE, "tokens_per_step": tokens, "rounds": rounds, "warmup": warmup,
        "steps_per_phase": STEPS_PER_PHASE, "checkpoint_bytes": samples["checkpoint_bytes"],
        "median": med, "samples": {k: v for k, v in samples.items() if isinstance(v, list)},
        "step_ratio_async": med["async_step_s"] / med["none_step_s"],
        "loadavg_before": list(load_before), "loadavg_after": list(os.getloadavg()),
        "note": "step times are the driver's wall time of one optimiser step; async_begin_s is what a save "
                "blocks the loop with --async-checkpoint, blocking_save_s without it",
    }


def to_markdown(payload: dict) -> str:
    med = payload["median"]
    m = payload["model"]
    rows = [["step, no save", f"{1e3 * med['none_step_s']:.1f}", len(payload["samples"]["none_step_s"])],
            ["step while an async save runs", f"{1e3 * med['async_step_s']:.1f}",
             len(payload["samples"]["async_step_s"])],
            ["async save: loop blocked (ranks copy their state)", f"{1e3 * med['async_begin_s']:.1f}",
             len(payload["samples"]["async_begin_s"])],
            ["async save: begin to written", f"{1e3 * med['async_write_s']:.1f}",
             len(payload["samples"]["async_write_s"])],
            ["blocking save", f"{1e3 * med['blocking_save_s']:.1f}", len(payload["samples"]["blocking_save_s"])]]
    return "\n".join([
        "## Checkpoint saves: blocking against --async-checkpoint", "",
        f"{m['n_layers']} layers, d = {m['d_model']}, {m['residual']} (block size {m['block_size']}), "
        f"P = {payload['pipeline']['stages']} rank processes, {payload['pipeline']['schedule']}, "
        f"{payload['tokens_per_step']:,} tokens a step; checkpoint {payload['checkpoint_bytes'] / 2**20:.1f} MiB "
        f"on disk. {payload['rounds']} rounds after {payload['warmup']} warm-up steps, phases rotating; medians. "
        f"Load average {payload['loadavg_before'][0]:.2f} before, {payload['loadavg_after'][0]:.2f} after.", "",
        markdown_table(["what", "median (ms)", "samples"], rows), "",
        f"A step beside an async save takes **{payload['step_ratio_async']:.2f}x** a step with none; the loop "
        f"is blocked {1e3 * med['async_begin_s']:.0f} ms a save instead of {1e3 * med['blocking_save_s']:.0f} ms.",
        ""])
