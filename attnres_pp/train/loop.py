"""The one training loop, shared by the single-process engine and the pipeline: it owns the data,
the learning-rate schedule, evaluation, progress and the run records; an Engine owns the model,
the optimiser and how a global batch is computed."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from attnres_pp.data import Corpus, load_corpus
from attnres_pp.train.checkpoint import (
    CheckpointConfig,
    check_format,
    check_run_dir,
    latest_checkpoint,
    read_meta,
    remove_interrupted_saves,
    save_checkpoint,
)
from attnres_pp.train.config import RunConfig
from attnres_pp.train.optim import lr_at
from attnres_pp.train.recovery import RunFailed, RunHistory, WorkerLost, describe_rank
from attnres_pp.train.summary import MetricsLog, median, progress_line, write_json_atomic
from attnres_pp.train.tensorboard import TensorBoardLog


@dataclass(frozen=True)
class StepResult:
    """What one optimiser step returns. `loss` is the mean cross-entropy over the global batch.
    `extras` is merged into summary.json (the last step's values win); `metrics` are per-step
    scalars (e.g. grad_norm) written to that step's line of metrics.jsonl."""

    loss: float
    extras: dict = field(default_factory=dict)
    metrics: dict = field(default_factory=dict)


class Engine(Protocol):
    """Runs the model and reads its data: batches are pure functions of (seed, step), so the engine
    (in a pipeline, each rank) reads the run's global batch of `step` itself. `inputs_BT` /
    `targets_BT`, int64 `[batch_size, seq_len]`, are given only by tests and benchmarks that feed
    their own batches; the loop passes None."""

    def train_step(
        self, step: int, inputs_BT: torch.Tensor | None, targets_BT: torch.Tensor | None, lr: float
    ) -> StepResult: ...

    def evaluate(self) -> float:
        """Mean loss over the run's fixed validation batches (`data.val_batches`)."""

    def param_count(self) -> int: ...

    def save_checkpoint(self, step_dir: Path) -> None:
        """Write every rank's shard into `step_dir` (see attnres_pp.train.checkpoint and .shards)."""

    def load_checkpoint(self, step_dir: Path) -> None:
        """Load parameters, optimizer and RNG states from the shards in `step_dir`, whatever split wrote them."""

    def close(self) -> None: ...


def run_training(
    run_cfg: RunConfig, engine: Engine, out_dir: str | Path, *, progress: bool = True, corpus: Corpus | None = None,
    checkpoints: CheckpointConfig | None = None, tensorboard: str | Path | None = None,
) -> dict:
    """Train `engine` for `run_cfg.train.steps` steps and return the summary dict, also written to
    `out_dir/summary.json`; per-step records go to `out_dir/metrics.jsonl`. The caller owns the
    engine (and closes it). `corpus`, if given, must be `load_corpus(run_cfg.train.data)`.

    `checkpoints` (default: none saved, no resume, 3 restarts): save `out_dir/checkpoints/step_N`
    every `every` steps; with `resume`, continue from the newest one. When the engine raises
    WorkerLost and has `restart_workers()`, the loop restarts it from the last checkpoint (or from
    scratch) up to `max_restarts` times, then raises RunFailed. `tensorboard`: also write each step's
    record as TensorBoard scalars under that directory (`train.tensorboard`)."""
    ckpt = checkpoints or CheckpointConfig()
    train_cfg, seq_len = run_cfg.train, run_cfg.model.seq_len
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    check_run_dir(out_dir, ckpt.resume)
    corpus = corpus if corpus is not None else load_corpus(train_cfg.data)
    corpus.check_fits(vocab_size=run_cfg.model.vocab_size, seq_len=seq_len)
    tokens_per_step = train_cfg.batch_size * seq_len
    params = engine.param_count()
    say = print if progress else (lambda *args, **kwargs: None)
    say(f"training {params:,} parameters on {corpus.name} ({corpus.n_tokens:,} tokens) for "
        f"{train_cfg.steps} steps of {tokens_per_step:,} tokens", flush=True)

    history, last_checkpoint = RunHistory(), None
    if ckpt.resume:
        for name in remove_interrupted_saves(out_dir):
            say(f"removed {name}: a checkpoint save that a crash interrupted", flush=True)
        last_checkpoint = latest_checkpoint(out_dir)
        history = _restore(engine, last_checkpoint, _read_records(out_dir / "metrics.jsonl"))
        say(f"resuming from {last_checkpoint} (continuing at step {history.steps_done + 1}; "
            f"{_describe_settings(run_cfg, ckpt)})", flush=True)
    log = MetricsLog(out_dir / "metrics.jsonl")
    for record in history.records:
        log.write(record)
    tb = TensorBoardLog(tensorboard) if tensorboard else None
    start = time.perf_counter()
    try:
        step = history.steps_done
        while step < train_cfg.steps:
            try:
                record = _train_one_step(engine, run_cfg, step, history)
                log.write(record)
                if tb is not None:
                    tb.write(record, history.extras)
                say(progress_line(step, train_cfg.steps, record["loss"], record["lr"], record["tokens_per_s"])
                    + (f" | val {record['val_loss']:.4f}" if "val_loss" in record else ""), flush=True)
                if ckpt.every and (step + 1) % ckpt.every == 0 and step + 1 < train_cfg.steps:
                    meta = {"config": run_cfg.to_dict(), "checkpointing": ckpt.settings(), **history.to_meta()}
                    last_checkpoint = save_checkpoint(out_dir, step + 1, engine, meta)
            except WorkerLost as lost:
                _restart_or_fail(engine, lost, step, history, last_checkpoint, ckpt, train_cfg.steps, say)
                log.close()
                log = MetricsLog(out_dir / "metrics.jsonl")
                for kept in history.records:
                    log.write(kept)
            step = history.steps_done
    finally:
        log.close()
        if tb is not None:
            tb.close()

    losses, step_times = history.losses, history.step_times
    train_time = sum(step_times)
    summary = {
        "losses": losses,
        "val_loss": history.val_losses[-1][1],
        "val_losses": history.val_losses,
        "step_time_s": median(step_times),
        "tokens_per_s": tokens_per_step * len(step_times) / train_time if train_time > 0 else None,
        "train_time_s": train_time,
        "wall_time_s": time.perf_counter() - start,
        "tokens_seen": tokens_per_step * len(step_times),
        "params": params,
        "restarts": history.restarts,
        "data": {"name": corpus.name, "train_tokens": len(corpus.train_tokens_N),
                 "val_tokens": len(corpus.val_tokens_N)},
        "config": run_cfg.to_dict(),
        **history.extras,
    }
    write_json_atomic(out_dir / "summary.json", summary)
    say(f"done: loss {losses[0]:.4f} -> {losses[-1]:.4f}, val {summary['val_loss']:.4f}, "
        f"median step {summary['step_time_s'] * 1e3:.1f} ms; wrote {out_dir / 'summary.json'}", flush=True)
    return summary


def _train_one_step(engine: Engine, run_cfg: RunConfig, step: int, history: RunHistory) -> dict:
    """Step `step` (0-based): train, evaluate when due, append to `history`; returns its record.
    History changes only after every engine call succeeded, so a WorkerLost leaves it as it was."""
    train_cfg = run_cfg.train
    tokens_per_step = train_cfg.batch_size * run_cfg.model.seq_len
    lr = lr_at(step, train_cfg)
    t0 = time.perf_counter()
    result = engine.train_step(step, None, None, lr)  # the engine reads batch `step` itself
    step_time = time.perf_counter() - t0
    record = {"step": step, "loss": float(result.loss), "lr": lr, "step_time_s": step_time,
              "tokens_per_s": tokens_per_step / step_time, **result.metrics}
    if train_cfg.log_routing_every and (step + 1) % train_cfg.log_routing_every == 0:
        record.update(engine.routing_metrics())  # scalars per site, computed where the sites live
    if step == train_cfg.steps - 1 or (train_cfg.eval_every and (step + 1) % train_cfg.eval_every == 0):
        record["val_loss"] = float(engine.evaluate())
        history.val_losses.append([step, record["val_loss"]])
    history.losses.append(float(result.loss))
    history.step_times.append(step_time)
    history.records.append(record)
    history.extras.update(result.extras)
    return record


def _restart_or_fail(engine: Engine, lost: WorkerLost, step: int, history: RunHistory,
                     last_checkpoint: Path | None, ckpt: CheckpointConfig, steps: int, say) -> None:
    """Restart the engine's workers and rewind `history` to the last checkpoint (or to the start),
    or raise RunFailed naming the lost rank and step when no restart is left."""
    where = f"{describe_rank(lost.pp_rank)} lost at step {step + 1}/{steps}"
    restart = getattr(engine, "restart_workers", None)
    if restart is None:
        raise RunFailed(f"{where}: {lost} (this launcher cannot restart workers)") from lost
    if history.restarts >= ckpt.max_restarts:
        raise RunFailed(f"{where} after {history.restarts} restart(s), the limit set by --max-restarts: "
                        f"{lost}") from lost
    restarts = history.restarts + 1
    origin = (f"checkpoint step {read_meta(last_checkpoint)['steps_done']}" if last_checkpoint
              else "step 0 (no checkpoint yet)")
    cause = (str(lost).splitlines() or [""])[0]
    say(f"{where}; restarting from {origin} (restart {restarts}/{ckpt.max_restarts})\n  cause: {cause}", flush=True)
    try:
        restart()
        restored = _restore(engine, last_checkpoint, history.records) if last_checkpoint else None
    except RuntimeError as again:  # WorkerLost again, or no room for the new workers (a node is gone)
        raise RunFailed(f"{where}; the restart failed too: {again}") from again
    if restored is None:
        history.rewind(0)
    else:
        history.losses, history.step_times = restored.losses, restored.step_times
        history.val_losses, history.records = restored.val_losses, restored.records
    history.restarts = restarts


def _restore(engine: Engine, step_dir: Path, records: list[dict]) -> RunHistory:
    """Load `step_dir` into the engine; returns the run history as of that checkpoint."""
    check_format(step_dir)
    engine.load_checkpoint(step_dir)
    return RunHistory.from_meta(read_meta(step_dir), records)


def _describe_settings(run_cfg: RunConfig, ckpt: CheckpointConfig) -> str:
    """The settings a resumed run goes on with (saved ones unless a flag overrode them), for the progress line."""
    train_cfg = run_cfg.train
    saving = f"checkpoint every {ckpt.every} steps" if ckpt.every else "no checkpoints"
    evaluating = f"eval every {train_cfg.eval_every} steps" if train_cfg.eval_every else "eval at the end"
    return f"{saving}, max restarts {ckpt.max_restarts}, {evaluating}, data {train_cfg.data}"


def _read_records(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
