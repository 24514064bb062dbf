"""The one training loop, shared by the single-process engine and the pipeline: it owns the data,
the learning-rate schedule, evaluation, progress and the run records; an Engine owns the model,
the optimiser and how a global batch is computed."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from attnres_pp.data import Corpus, batch_at, load_corpus, val_batches
from attnres_pp.train.config import RunConfig
from attnres_pp.train.optim import lr_at
from attnres_pp.train.summary import MetricsLog, median, progress_line, write_json_atomic


@dataclass(frozen=True)
class StepResult:
    """What one optimiser step returns. `loss` is the mean cross-entropy over the global batch.
    `extras` is merged into summary.json (the last step's values win); `metrics` are per-step
    scalars (e.g. grad_norm) written to that step's line of metrics.jsonl."""

    loss: float
    extras: dict = field(default_factory=dict)
    metrics: dict = field(default_factory=dict)


class Engine(Protocol):
    """Runs the model. `inputs_BT` / `targets_BT` are the global batch, int64 `[batch_size, seq_len]`."""

    def train_step(
        self, step: int, inputs_BT: torch.Tensor, targets_BT: torch.Tensor, lr: float
    ) -> StepResult: ...

    def eval_loss(self, inputs_BT: torch.Tensor, targets_BT: torch.Tensor) -> float: ...

    def param_count(self) -> int: ...

    def close(self) -> None: ...


def run_training(
    run_cfg: RunConfig, engine: Engine, out_dir: str | Path, *, progress: bool = True, corpus: Corpus | None = None
) -> dict:
    """Train `engine` for `run_cfg.train.steps` steps and return the summary dict, also written to
    `out_dir/summary.json`; per-step records go to `out_dir/metrics.jsonl`. The caller owns the
    engine (and closes it). `corpus`, if given, must be `load_corpus(run_cfg.train.data)`."""
    train_cfg, seq_len = run_cfg.train, run_cfg.model.seq_len
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    corpus = corpus if corpus is not None else load_corpus(train_cfg.data)
    corpus.check_fits(vocab_size=run_cfg.model.vocab_size, seq_len=seq_len)
    val_set = val_batches(corpus.val_tokens_N, train_cfg.eval_batches, train_cfg.batch_size, seq_len, train_cfg.seed)
    tokens_per_step = train_cfg.batch_size * seq_len
    params = engine.param_count()
    say = print if progress else (lambda *args, **kwargs: None)
    say(f"training {params:,} parameters on {corpus.name} ({corpus.n_tokens:,} tokens) for "
        f"{train_cfg.steps} steps of {tokens_per_step:,} tokens", flush=True)

    losses: list[float] = []
    step_times: list[float] = []
    val_losses: list[list] = []
    extras: dict = {}
    log = MetricsLog(out_dir / "metrics.jsonl")
    start = time.perf_counter()
    try:
        for step in range(train_cfg.steps):
            inputs_BT, targets_BT = batch_at(
                corpus.train_tokens_N, step, train_cfg.batch_size, seq_len, train_cfg.seed
            )
            lr = lr_at(step, train_cfg)
            t0 = time.perf_counter()
            result = engine.train_step(step, inputs_BT, targets_BT, lr)
            step_time = time.perf_counter() - t0
            losses.append(float(result.loss))
            step_times.append(step_time)
            extras.update(result.extras)
            record = {"step": step, "loss": float(result.loss), "lr": lr, "step_time_s": step_time,
                      "tokens_per_s": tokens_per_step / step_time, **result.metrics}
            last = step == train_cfg.steps - 1
            if last or (train_cfg.eval_every and (step + 1) % train_cfg.eval_every == 0):
                val_loss = _evaluate(engine, val_set)
                val_losses.append([step, val_loss])
                record["val_loss"] = val_loss
            log.write(record)
            say(progress_line(step, train_cfg.steps, result.loss, lr, tokens_per_step / step_time)
                + (f" | val {record['val_loss']:.4f}" if "val_loss" in record else ""), flush=True)
    finally:
        log.close()

    train_time = sum(step_times)
    summary = {
        "losses": losses,
        "val_loss": val_losses[-1][1],
        "val_losses": val_losses,
        "step_time_s": median(step_times),
        "tokens_per_s": tokens_per_step * len(step_times) / train_time if train_time > 0 else None,
        "train_time_s": train_time,
        "wall_time_s": time.perf_counter() - start,
        "tokens_seen": tokens_per_step * len(step_times),
        "params": params,
        "data": {"name": corpus.name, "train_tokens": len(corpus.train_tokens_N),
                 "val_tokens": len(corpus.val_tokens_N)},
        "config": run_cfg.to_dict(),
        **extras,
    }
    write_json_atomic(out_dir / "summary.json", summary)
    say(f"done: loss {losses[0]:.4f} -> {losses[-1]:.4f}, val {summary['val_loss']:.4f}, "
        f"median step {summary['step_time_s'] * 1e3:.1f} ms; wrote {out_dir / 'summary.json'}", flush=True)
    return summary


def _evaluate(engine: Engine, val_set: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Mean loss over the fixed validation batches (equal sizes, so the mean of means is exact)."""
    return sum(engine.eval_loss(inputs_BT, targets_BT) for inputs_BT, targets_BT in val_set) / len(val_set)
