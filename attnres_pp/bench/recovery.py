"""`attnres-pp bench recovery`: what a lost rank costs a D = 2, P = 2 run (local launcher), with
`--fault-tolerance replicas` against the restart from the last checkpoint.

Both runs lose global rank 3 (replica 1's last stage) mid-step at the same step, as
`--inject-failure` does. Measured from the moment the driver sees the loss:
- replicas (torchft, `train.ft_replicas`, `--min-replicas 1`): seconds to the first committed step
  (`first_commit_s`), to the first committed without the lost group where one came before it healed
  (`shrunk_commit_s`), and to the healed group's first committed step (`rejoin_s`);
- checkpoint (`train.loop`'s recovery): every rank is stopped and started again and the last
  checkpoint loaded; seconds to the first step completed after the restart, and to the step at
  which the rank was lost completed again (the steps since the checkpoint are trained twice).
Each run is repeated; medians and every sample are reported.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from attnres_pp.bench.common import markdown_table

MODEL = {"n_layers": 4, "d_model": 64, "n_heads": 2, "seq_len": 32, "vocab_size": 256}
QUICK_MODEL = {"n_layers": 2, "d_model": 32, "n_heads": 2, "seq_len": 16, "vocab_size": 256}
STEPS, FAIL_STEP, CHECKPOINT_EVERY = 16, 8, 5  # lost at step 8 (1-based): the checkpoint of step 5 is the last


class _StepClock:
    """An engine whose loss (WorkerLost) and later steps are timed: the checkpoint path's figures."""

    def __init__(self, engine) -> None:
        self.engine, self.lost_s, self.lost_step, self.after = engine, None, None, []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def train_step(self, step, inputs_BT, targets_BT, lr):
        from attnres_pp.pipeline.errors import WorkerLost

        try:
            result = self.engine.train_step(step, inputs_BT, targets_BT, lr)
        except WorkerLost:
            self.lost_s, self.lost_step = time.monotonic(), step
            raise
        if self.lost_s is not None:
            self.after.append((step, time.monotonic() - self.lost_s))
        return result


def _config(model: dict, fault_tolerance: str):
    from attnres_pp.train.config import RunConfig

    return RunConfig.from_dict({
        "model": model,
        "train": {"steps": STEPS, "batch_size": 8, "microbatches": 2, "warmup_steps": 0, "eval_batches": 1,
                  "eval_every": 0, "fault_tolerance": fault_tolerance, "device": "cpu"},
        "pipeline": {"stages": 2, "data_parallel": 2, "launcher": "local", "timeout_s": 60.0},
    })


def _run(model: dict, fault_tolerance: str, scratch: Path) -> dict:
    from attnres_pp.train.checkpoint import CheckpointConfig
    from attnres_pp.train.engines import make_engine
    from attnres_pp.train.loop import run_training

    cfg = _config(model, fault_tolerance)
    out = Path(tempfile.mkdtemp(dir=scratch))
    fail_at = (3, FAIL_STEP - 1)
    engine = _StepClock(make_engine(cfg, out, fail_at=fail_at))
    every = 0 if fault_tolerance == "replicas" else CHECKPOINT_EVERY
    try:
        summary = run_training(cfg, engine, out, progress=False,
                               checkpoints=CheckpointConfig(every=every, final=False, max_restarts=1))
    finally:
        engine.close()
    if fault_tolerance == "replicas":
        [recovery] = summary["recoveries"]
        return {key: recovery.get(key) for key in ("first_commit_s", "shrunk_commit_s", "rejoin_s",
                                                   "rejoined_at_step")} | {
            "participants_per_step": summary["participants_per_step"], "restarts": summary["restarts"],
            "replicas_equal": summary["replicas_equal"], "wall_time_s": summary["wall_time_s"]}
    after = dict(engine.after)
    first_step, first_s = engine.after[0]
    return {"first_step_s": first_s, "first_step_after": first_step, "lost_step_again_s": after[engine.lost_step],
            "steps_trained_twice": engine.lost_step - (engine.lost_step // CHECKPOINT_EVERY) * CHECKPOINT_EVERY,
            "restarts": summary["restarts"], "wall_time_s": summary["wall_time_s"]}


def run(quick: bool, out_dir: Path | None, progress: Callable[[str], None]) -> dict:
    del out_dir  # tables only
    model = QUICK_MODEL if quick else MODEL
    repeats = 1 if quick else 3
    samples: dict[str, list[dict]] = {"replicas": [], "checkpoint": []}
    load_before = os.getloadavg()
    scratch = Path(tempfile.mkdtemp(prefix="attnres-bench-recovery-"))
    try:
        for index in range(repeats):
            for mode in ("replicas", "checkpoint") if index % 2 == 0 else ("checkpoint", "replicas"):
                samples[mode].append(_run(model, "replicas" if mode == "replicas" else "off", scratch))
                progress(f"  {mode} {index + 1}/{repeats}: {samples[mode][-1]}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    def median(mode: str, key: str) -> float | None:
        values = [s[key] for s in samples[mode] if s.get(key) is not None]
        return statistics.median(values) if values else None

    return {
        "model": model, "steps": STEPS, "fail_step": FAIL_STEP, "checkpoint_every": CHECKPOINT_EVERY,
        "layout": "D = 2 x P = 2, local launcher, cpu", "repeats": repeats, "samples": samples,
        "median": {"replicas": {k: median("replicas", k) for k in ("first_commit_s", "shrunk_commit_s", "rejoin_s")},
                   "checkpoint": {k: median("checkpoint", k) for k in ("first_step_s", "lost_step_again_s")}},
        "loadavg_before": list(load_before), "loadavg_after": list(os.getloadavg()),
        "note": "seconds from the driver seeing the loss; replicas: --min-replicas 1, Lighthouse heartbeat timeout "
                "1 s; checkpoint: the loop's restart of every rank from the last checkpoint",
    }


def to_markdown(payload: dict) -> str:
    rep, ck = payload["median"]["replicas"], payload["median"]["checkpoint"]

    def cell(value) -> str:
        return "-" if value is None else f"{value:.2f}"

    rows = [["replicas (torchft)", "first committed step", cell(rep["first_commit_s"])],
            ["replicas (torchft)", "first committed step without the lost group", cell(rep["shrunk_commit_s"])],
            ["replicas (torchft)", "the healed group's first committed step", cell(rep["rejoin_s"])],
            ["checkpoint restart", "first step after the restart", cell(ck["first_step_s"])],
            ["checkpoint restart", f"step {payload['fail_step']} done again", cell(ck["lost_step_again_s"])]]
    m = payload["model"]
    return "\n".join([
        "## Recovery from a lost rank: torchft replica groups against the restart from a checkpoint", "",
        f"{m['n_layers']} layers, d = {m['d_model']}, {payload['layout']}; global rank 3 lost mid-step "
        f"{payload['fail_step']} of {payload['steps']}; checkpoints every {payload['checkpoint_every']} steps "
        f"(checkpoint path); medians of {payload['repeats']} run(s), seconds from the driver seeing the loss.", "",
        markdown_table(["path", "until", "seconds"], rows), ""])
