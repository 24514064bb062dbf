"""`attnres-pp bench peer`: our pipeline runtime against torch.distributed.pipelining on the same
work: the standard-residual benchmark model, identical chunks (our partition and chunk modules,
same seed, so step 0's loss agrees), the same P, V, m and batches, gloo, one thread per rank, and
the same optimiser step after the pipeline. Ours: `interleaved_1f1b` / `1f1b` / `interleaved_zb` /
`dualpipev` through the local launcher; torch: `ScheduleInterleaved1F1B` / `Schedule1F1B` /
`ScheduleInterleavedZeroBubble` / `ScheduleDualPipeV` (`bench.torch_pipe`). Each side runs its own
runtime and transport: ours hands hops over in shared memory between the two ranks of this host,
torch's sends them over gloo.

Both engines are started, then stepped alternately (ours, torch, torch, ours, ...) on the same
global batch, so drift in the machine's load cancels; warm-up steps are dropped. Reported:
ratio = the median over steps of ours / torch on the same batch, back to back (below 1: ours is
faster), the ratio of the two medians, and the pipeline part alone (ours: the action window;
torch: `schedule.step` on the slowest rank).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path

from attnres_pp.bench.common import (
    BENCH_MODEL,
    MICROBATCH_SIZE,
    TimedEngine,
    account,
    markdown_table,
    random_batch,
    run_config,
)

TORCH_SCHEDULES = {"interleaved_1f1b": "ScheduleInterleaved1F1B", "1f1b": "Schedule1F1B",
                   "interleaved_zb": "ScheduleInterleavedZeroBubble", "dualpipev": "ScheduleDualPipeV"}
MODEL = {**BENCH_MODEL, "residual": "standard", "block_size": 1}


def compare(schedule: str, n_virtual: int, n_microbatches: int, warmup: int, steps: int,
            progress: Callable[[str], None]) -> dict:
    from attnres_pp.bench.torch_pipe import TorchPipeEngine

    n_stages = 2
    run_cfg = run_config(MODEL, stages=n_stages, virtual=n_virtual, schedule=schedule,
                         microbatches=n_microbatches, cache=False)
    ours = TimedEngine(run_cfg)
    started = time.perf_counter()
    try:
        theirs = TorchPipeEngine(run_cfg)
    except Exception:
        ours.close()
        raise
    torch_startup_s = time.perf_counter() - started
    torch_wall, torch_pipeline, torch_losses = [], [], []
    train = run_cfg.train
    try:
        for step in range(warmup + steps):
            inputs_BT, targets_BT = random_batch(step, train.batch_size, MODEL["seq_len"], MODEL["vocab_size"],
                                                 train.seed)
            for side in (("ours", "torch") if step % 2 == 0 else ("torch", "ours")):
                if side == "ours":
                    ours.step()  # draws the same batch: random_batch(step, ...) with the same seed
                    continue
                began = time.perf_counter()
                ranks = theirs.train_step(inputs_BT, targets_BT, 1e-3)
                torch_wall.append(time.perf_counter() - began)
                torch_pipeline.append(max(r["pipeline_s"] for r in ranks))
                losses = [loss for r in ranks for loss in r["losses"]]
                torch_losses.append(sum(losses) / len(losses))
    finally:
        ours.close()
        theirs.close()
    samples = ours.samples[warmup:]
    ours_wall = [s.wall_s for s in samples]
    ours_pipeline = [account(s.events, n_stages)["step_s"] for s in samples]
    tw, tp = torch_wall[warmup:], torch_pipeline[warmup:]
    row = {
        "schedule": schedule, "torch_schedule": TORCH_SCHEDULES[schedule], "P": n_stages, "V": n_virtual,
        "m": n_microbatches,
        "ours_step_s": statistics.median(ours_wall), "torch_step_s": statistics.median(tw),
        # Headline: the median of the per-step ratios (adjacent runs: drift cancels).
        "ratio": statistics.median(a / b for a, b in zip(ours_wall, tw, strict=True)),
        "ratio_of_medians": statistics.median(ours_wall) / statistics.median(tw),
        "ours_pipeline_s": statistics.median(ours_pipeline), "torch_pipeline_s": statistics.median(tp),
        "ratio_pipeline": statistics.median(ours_pipeline) / statistics.median(tp),
        "step0_loss_ours": ours.samples[0].loss, "step0_loss_torch": torch_losses[0],
        "same_model": abs(ours.samples[0].loss - torch_losses[0]) < 1e-4,
        "ours_startup_s": ours.startup_s, "torch_startup_s": torch_startup_s,
        "steps_measured": steps,
    }
    progress(f"  {schedule} V={n_virtual} m={n_microbatches}: ours {row['ours_step_s'] * 1e3:.1f} ms, "
             f"torch {row['torch_step_s'] * 1e3:.1f} ms, ratio {row['ratio']:.3f} (of medians "
             f"{row['ratio_of_medians']:.3f}, pipeline only {row['ratio_pipeline']:.3f}); step-0 loss "
             f"{row['step0_loss_ours']:.6f} vs {row['step0_loss_torch']:.6f}")
    return row


def run(quick: bool, out_dir: Path | None, progress: Callable[[str], None]) -> dict:
    del out_dir  # tables only
    warmup, steps = (2, 20) if quick else (3, 30)
    cases = [("interleaved_1f1b", 2, 8), ("1f1b", 1, 8), ("interleaved_zb", 2, 8), ("dualpipev", 2, 8)]
    if not quick:
        cases += [("interleaved_1f1b", 4, 8), ("interleaved_1f1b", 2, 16)]
    rows = [compare(name, v, m, warmup, steps, progress) for name, v, m in cases]
    return {
        "ratio": rows[0]["ratio"],
        "ratio_1f1b": rows[1]["ratio"],
        "ratio_zb": rows[2]["ratio"],
        "ratio_dualpipev": rows[3]["ratio"],
        "schedules": rows,
        "model": {**MODEL, "microbatch_size": MICROBATCH_SIZE},
        "warmup_steps": warmup, "steps": steps,
        "note": "ratio = median over steps of (our step / torch.distributed.pipelining's step on the same "
                "batch, run back to back), first case (interleaved 1F1B); below 1 means ours is faster",
    }


def to_markdown(payload: dict) -> str:
    rows = [[r["schedule"], r["torch_schedule"], r["P"], r["V"], r["m"], 1e3 * r["ours_step_s"],
             1e3 * r["torch_step_s"], f"{r['ratio']:.3f}", f"{r['ratio_of_medians']:.3f}",
             1e3 * r["ours_pipeline_s"], 1e3 * r["torch_pipeline_s"], f"{r['ratio_pipeline']:.3f}",
             "yes" if r["same_model"] else "NO"] for r in payload["schedules"]]
    return "\n".join([
        "## Our runtime vs torch.distributed.pipelining", "",
        f"Model {payload['model']}, one thread per rank, each side with its own transport (ours: shared memory "
        "between the ranks of one host, else gloo; torch: gloo); medians of "
        f"{payload['steps']} steps after "
        f"{payload['warmup_steps']} warm-up steps, the two engines stepped alternately on the same batches. "
        "Step = the driver's wall time of a whole optimiser step; pipeline = ours: first to last action of "
        "any rank, torch: `schedule.step` on the slowest rank.", "",
        markdown_table(["ours", "torch", "P", "V", "m", "ours step (ms)", "torch step (ms)", "ratio (paired)",
                        "ratio of medians", "ours pipeline (ms)", "torch pipeline (ms)", "ratio",
                        "step-0 loss equal"], rows), "",
        f"**ratio ours / torch = {payload['ratio']:.3f}** (interleaved 1F1B), {payload['ratio_1f1b']:.3f} (1F1B), "
        f"{payload.get('ratio_zb', float('nan')):.3f} (interleaved zero bubble), "
        f"{payload.get('ratio_dualpipev', float('nan')):.3f} (DualPipeV).",
    ])
