"""The one training loop, shared by the single-process engine and the pipeline: it owns the data
position, the learning-rate schedule, evaluation, progress, checkpoint cadence and the run records;
an Engine owns the model, the optimiser and how a global batch is computed.

The data position of a run is its step: batch `step` is a pure function of (seed, step)
(`data.batches`), and a batch of B rows begins with the rows of a smaller batch of the same step.
So a resume continues at the checkpoint's step whatever `--batch-size` or `--data-parallel` it
is given (the global batch is split over the replicas by rows); each step's token count is
recorded, so `tokens_seen` stays exact across such a change. Another `--seed` would read another
stream and is refused, and so is a data folder whose tokenizer is another (its sha256 is recorded).

A run on a data folder keeps a copy of the folder's tokenizer.json in its run directory, so that
`attnres-pp generate` reads and writes text with it wherever the data folder has gone."""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from attnres_pp.data import Corpus, load_corpus
from attnres_pp.data.tokenizer import TOKENIZER_FILE
from attnres_pp.train.checkpoint import (
    CheckpointConfig,
    PendingCheckpoint,
    begin_checkpoint,
    check_format,
    check_run_dir,
    latest_checkpoint,
    read_meta,
    remove_interrupted_saves,
    restore_replaced_checkpoints,
    save_checkpoint,
)
from attnres_pp.train.config import RunConfig
from attnres_pp.train.optim import lr_at
from attnres_pp.train.rank_data import replica_rows
from attnres_pp.train.recovery import RunFailed, RunHistory, WorkerLost, describe_rank
from attnres_pp.train.summary import MetricsLog, describe_summary, median, progress_line, write_json_atomic
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

    def begin_checkpoint(self, step_dir: Path) -> float:
        """`save_checkpoint` in the background (`--async-checkpoint`): returns once every rank has
        copied its state, with the seconds that took (a rank first waits for its previous write)."""

    def checkpoint_written(self) -> bool:
        """Whether every rank's background write is done."""

    def finish_checkpoint(self) -> None:
        """Wait for every rank's background write; raises if one failed."""

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

    `checkpoints` (default: none saved at all, no resume, 3 restarts; `attnres-pp train` passes its
    flags, which save the final step by default): save `out_dir/checkpoints/step_N` every `every`
    steps and after the last step (`final`), keeping `train.keep_checkpoints` of them; with `resume`,
    continue from the newest one, or, if it has `steps` or more steps done already, say so and
    return the saved summary (`{}` if the run has none). When the engine raises WorkerLost and has
    `restart_workers()`, the loop restarts it from the last checkpoint (or from scratch) up to
    `max_restarts` times, then raises RunFailed. `tensorboard`: also write each step's record as
    TensorBoard scalars under that directory (`train.tensorboard`)."""
    ckpt = checkpoints if checkpoints is not None else CheckpointConfig(final=False)
    train_cfg, seq_len = run_cfg.train, run_cfg.model.seq_len
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    check_run_dir(out_dir, ckpt.resume)
    corpus = corpus if corpus is not None else load_corpus(train_cfg.data)
    corpus.check_fits(vocab_size=run_cfg.model.vocab_size, seq_len=seq_len)
    tokens_per_step = train_cfg.batch_size * seq_len
    say = print if progress else (lambda *args, **kwargs: None)
    if ckpt.resume:
        idle = nothing_to_do(out_dir, latest_checkpoint(out_dir), train_cfg.steps)
        if idle is not None:
            say(idle[0], flush=True)
            return idle[1]
    keep_tokenizer(corpus, out_dir)
    params = engine.param_count()
    say(f"training {params:,} parameters on {corpus.name} ({corpus.n_tokens:,} tokens) for "
        f"{train_cfg.steps} steps of {tokens_per_step:,} tokens", flush=True)

    history, last_checkpoint, final_checkpoint = RunHistory(), None, None
    if ckpt.resume:
        for name in restore_replaced_checkpoints(out_dir):
            say(f"restored {name} from {name}.old: a crash came between the renames of a save that replaced it",
                flush=True)
        for name in remove_interrupted_saves(out_dir):
            say(f"removed {name}: a checkpoint save that a crash interrupted", flush=True)
        last_checkpoint = latest_checkpoint(out_dir)
        check_resume(read_meta(last_checkpoint), run_cfg, corpus)
        history = _restore(engine, last_checkpoint, _read_records(out_dir / "metrics.jsonl"))
        say(f"resuming from {last_checkpoint} (continuing at step {history.steps_done + 1}; "
            f"{_describe_settings(run_cfg, ckpt)})", flush=True)
    log = MetricsLog(out_dir / "metrics.jsonl")
    for record in history.records:
        log.write(record)
    tb = TensorBoardLog(tensorboard) if tensorboard else None
    start = time.perf_counter()
    pending: PendingCheckpoint | None = None  # --async-checkpoint: the save in flight
    try:
        step = history.steps_done
        while step < train_cfg.steps:
            try:
                record = _train_one_step(engine, run_cfg, step, history)
                if pending is not None:
                    record["checkpoint_in_flight"] = True  # this step ran beside a background write
                    if pending.written(engine):
                        last_checkpoint, pending = pending.finish(engine), None
                log.write(record)
                if tb is not None:
                    tb.write(record, history.extras)
                say(progress_line(step, train_cfg.steps, record["loss"], record["lr"], record["tokens_per_s"])
                    + (f" | val {record['val_loss']:.4f}" if "val_loss" in record else ""), flush=True)
                if ckpt.saves_after(step + 1, train_cfg.steps):
                    meta = checkpoint_meta(run_cfg, ckpt, history, corpus)
                    if ckpt.async_save:
                        if pending is not None:  # at most one save in flight: the next waits for it
                            last_checkpoint, pending = pending.finish(engine), None
                        pending = begin_checkpoint(out_dir, step + 1, engine, meta, keep=train_cfg.keep_checkpoints)
                    else:
                        last_checkpoint = save_checkpoint(out_dir, step + 1, engine, meta,
                                                          keep=train_cfg.keep_checkpoints)
                if step + 1 == train_cfg.steps:
                    if pending is not None:  # the run ends once its last save is complete
                        last_checkpoint, pending = pending.finish(engine), None
                    if ckpt.saves_after(step + 1, train_cfg.steps):
                        final_checkpoint = last_checkpoint
            except WorkerLost as lost:
                pending = None  # the lost ranks' write is gone with them: its .tmp is never committed
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
        "tokens_per_s": history.tokens_seen / train_time if train_time > 0 else None,
        "train_time_s": train_time,
        "wall_time_s": time.perf_counter() - start,
        "tokens_seen": history.tokens_seen,
        "final_checkpoint": None if final_checkpoint is None else str(final_checkpoint),
        "params": params,
        "restarts": history.restarts,
        "data": {"name": corpus.name, "train_tokens": len(corpus.train_tokens_N),
                 "val_tokens": len(corpus.val_tokens_N), **data_record(corpus)},
        "config": run_cfg.to_dict(),
        **history.extras,
    }
    write_json_atomic(out_dir / "summary.json", summary)
    say(f"done: {describe_summary(summary)}; wrote {out_dir / 'summary.json'}"
        + (f" and {final_checkpoint}" if final_checkpoint else ""), flush=True)
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
              "tokens_per_s": tokens_per_step / step_time, "tokens_seen": history.tokens_seen + tokens_per_step,
              **result.metrics}
    if train_cfg.log_routing_every and (step + 1) % train_cfg.log_routing_every == 0:
        record.update(engine.routing_metrics())  # scalars per site, computed where the sites live
    if step == train_cfg.steps - 1 or (train_cfg.eval_every and (step + 1) % train_cfg.eval_every == 0):
        record["val_loss"] = float(engine.evaluate())
        history.val_losses.append([step, record["val_loss"]])
    history.losses.append(float(result.loss))
    history.step_times.append(step_time)
    history.tokens.append(tokens_per_step)
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
        history.losses, history.step_times, history.tokens = restored.losses, restored.step_times, restored.tokens
        history.val_losses, history.records = restored.val_losses, restored.records
    history.restarts = restarts


def _restore(engine: Engine, step_dir: Path, records: list[dict]) -> RunHistory:
    """Load `step_dir` into the engine; returns the run history as of that checkpoint."""
    check_format(step_dir)
    meta = read_meta(step_dir)
    history = RunHistory.from_meta(meta, records)
    position = meta.get("data_position")
    if position is not None and (position["next_step"], position["tokens_seen"]) != (history.steps_done,
                                                                                   history.tokens_seen):
        raise ValueError(f"checkpoint {step_dir} is inconsistent: its data position {position} does not match "
                         f"{history.steps_done} steps of {history.tokens_seen} tokens")
    engine.load_checkpoint(step_dir)
    return history


def data_record(corpus: Corpus | None) -> dict:
    """What a run records of its data beside the name: the data folder (absolute) and its tokenizer."""
    if corpus is None:
        return {}
    record = {"tokenizer": corpus.tokenizer_kind, "tokenizer_sha256": corpus.tokenizer_sha256}
    if corpus.folder is not None:
        record["folder"] = str(Path(corpus.folder).expanduser().resolve())
    return record


def keep_tokenizer(corpus: Corpus, out_dir: Path) -> None:
    """Copy the data folder's tokenizer.json into the run directory (BPE folders only), so that text
    in and out of the model needs only the run; a copy already there must be the same tokenizer."""
    if corpus.folder is None or corpus.tokenizer_kind != "bpe":
        return
    source, kept = Path(corpus.folder) / TOKENIZER_FILE, out_dir / TOKENIZER_FILE
    data = source.read_bytes()
    if hashlib.sha256(data).hexdigest() != corpus.tokenizer_sha256:
        raise ValueError(f"{source} has sha256 {hashlib.sha256(data).hexdigest()[:12]}.., not the "
                         f"{corpus.tokenizer_sha256[:12]}.. its meta.json names: the folder was changed; "
                         "prepare it again")
    if kept.is_file() and hashlib.sha256(kept.read_bytes()).hexdigest() == corpus.tokenizer_sha256:
        return
    tmp = kept.with_name(f".{kept.name}.tmp")
    shutil.copyfile(source, tmp)
    tmp.replace(kept)


def checkpoint_meta(run_cfg: RunConfig, ckpt: CheckpointConfig, history: RunHistory,
                    corpus: Corpus | None = None) -> dict:
    """What a checkpoint's meta.json holds besides its format and step: the config, the checkpoint
    settings, whether it is the run's last step ("final", which retention never deletes), the data
    position and the history. The data position: the next step's batch, the stream's seed, what the
    run has read, the data and its tokenizer, and the rows of each global batch every replica reads
    (a batch is a function of (seed, step), so these are where each replica stands)."""
    steps_done, tokens_seen = history.steps_done, history.tokens_seen
    train, replicas = run_cfg.train, run_cfg.pipeline.data_parallel
    position = {"next_step": steps_done, "seed": train.seed,
                "sequences_seen": tokens_seen // run_cfg.model.seq_len, "tokens_seen": tokens_seen,
                "data": train.data, **data_record(corpus), "batch_size": train.batch_size,
                "replicas": [{"dp_rank": r, "rows": [rows.start, rows.stop], "next_step": steps_done}
                             for r in range(replicas) for rows in [replica_rows(train.batch_size, replicas, r)]]}
    return {"config": run_cfg.to_dict(), "checkpointing": ckpt.settings(), "final": steps_done == run_cfg.train.steps,
            "data_position": position, **history.to_meta()}


def check_resume(meta: dict, run_cfg: RunConfig, corpus: Corpus | None = None, *,
                 tokenizer_sha256: str | None = None, data: str | None = None, seed: bool = True) -> None:
    """Raise ValueError if `run_cfg` cannot continue the checkpoint with `meta`: batches are keyed by
    the seed, so another seed would read another data stream (and other validation batches); a data
    folder with another tokenizer holds other tokens; and the recorded replica positions must be
    those of one step of the recorded batch (any D then resumes: each reads its rows of that step).
    `tokenizer_sha256` and `data` stand for `corpus` where it is not loaded yet; `seed=False` skips
    the seed (the caller's config is not the run's yet)."""
    position = meta.get("data_position", {})
    saved = position.get("seed", meta.get("config", {}).get("train", {}).get("seed"))
    if seed and saved is not None and saved != run_cfg.train.seed:
        raise ValueError(f"--seed {run_cfg.train.seed} differs from the checkpoint's seed {saved}: the run's batches "
                         f"are drawn from the stream of seed {saved}, so resume with --seed {saved} (or drop --seed)")
    sha = position.get("tokenizer_sha256")
    if corpus is not None:
        tokenizer_sha256, data = corpus.tokenizer_sha256, corpus.name
    if data is not None and sha is not None and tokenizer_sha256 != sha:
        raise ValueError(f"--data {data} has tokenizer {_short(tokenizer_sha256)}, the checkpoint's "
                         f"run used tokenizer {_short(sha)} (data {position.get('folder', position.get('data'))}): "
                         "the tokens would mean other text; resume with that run's data folder")
    replicas = position.get("replicas")
    if replicas is not None:
        batch = position.get("batch_size")
        ok = isinstance(replicas, list) and all(isinstance(r, dict) for r in replicas) and isinstance(batch, int)
        spans = [r.get("rows") for r in replicas] if ok else []
        covered = ok and spans and all(isinstance(x, list) and len(x) == 2 for x in spans) and \
            spans[0][0] == 0 and spans[-1][1] == batch and \
            all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))
        same_step = ok and all(r.get("next_step") == position.get("next_step") for r in replicas)
        if not (covered and same_step):
            raise ValueError(f"the checkpoint's data position is inconsistent: its replicas {replicas} do not read "
                             f"one step's batch of {batch} rows; load an earlier checkpoint")


def _short(sha: str | None) -> str:
    return "none" if sha is None else sha if len(sha) <= 16 else sha[:12] + ".."


def nothing_to_do(out_dir: Path, step_dir: Path | None, steps: int) -> tuple[str, dict] | None:
    """When checkpoint `step_dir` has `steps` or more steps done already: (what to tell the user, the
    run's saved summary, `{}` if it has none or it cannot be read), and the run directory is left
    as it is. None when there are steps left to train (or no checkpoint)."""
    if step_dir is None:
        return None
    done = int(read_meta(step_dir)["steps_done"])
    if done < steps:
        return None
    lines = [f"nothing to do: {step_dir} has {done} steps done and --steps {steps} asks for no more "
             f"(give --steps above {done} to train on)"]
    path = Path(out_dir) / "summary.json"
    try:
        summary = json.loads(path.read_text())
        lines.append(f"the run's summary, kept: {describe_summary(summary)} ({path})")
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        summary = {}
        lines.append(f"no readable {path}: the run stopped before its end; its checkpoints are kept")
    return "\n".join(lines), summary


def _describe_settings(run_cfg: RunConfig, ckpt: CheckpointConfig) -> str:
    """The settings a resumed run goes on with (saved ones unless a flag overrode them), for the progress line."""
    train_cfg = run_cfg.train
    if ckpt.every:
        saving = f"checkpoint every {ckpt.every} steps" + (" and at the end" if ckpt.final else ", none at the end")
    else:
        saving = "checkpoint at the end" if ckpt.final else "no checkpoints"
    saving += f", keep {train_cfg.keep_checkpoints or 'all'}"
    evaluating = f"eval every {train_cfg.eval_every} steps" if train_cfg.eval_every else "eval at the end"
    return f"{saving}, max restarts {ckpt.max_restarts}, {evaluating}, data {train_cfg.data}"


def _read_records(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
