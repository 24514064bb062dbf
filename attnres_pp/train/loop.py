"""The one training loop, shared by every engine (the one-process run's and the pipeline's): it owns the data
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
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from attnres_pp.data import Corpus, load_corpus
from attnres_pp.data.tokenizer import TOKENIZER_FILE
from attnres_pp.launch.rank_group import RankHung
from attnres_pp.launch.storage_fault import StorageFault, find_storage_fault
from attnres_pp.model.transformer import active_parameter_count
from attnres_pp.train.checkpoint import (
    CheckpointConfig,
    PendingCheckpoint,
    begin_checkpoint,
    check_run_dir,
    checkpoints_dir,
    latest_checkpoint,
    read_meta,
    save_checkpoint,
)
from attnres_pp.train.config import RunConfig
from attnres_pp.train.optim import lr_at
from attnres_pp.train.rank_data import replica_rows
from attnres_pp.train.recovery import RunFailed, RunHistory, WorkerLost, describe_rank, first_line, storage_stop
from attnres_pp.train.resume import nothing_to_do, restore, resume
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
    checkpoints: CheckpointConfig | None = None, tensorboard: str | Path | None = None, startup_restarts: int = 0,
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
    TensorBoard scalars under that directory (`train.tensorboard`). `startup_restarts`: the restarts
    the engine's start took (`recovery.start_engine`), counted with the run's."""
    ckpt = checkpoints if checkpoints is not None else CheckpointConfig(final=False)
    train_cfg, seq_len = run_cfg.train, run_cfg.model.seq_len
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    check_run_dir(out_dir, ckpt.resume)
    corpus = corpus if corpus is not None else load_corpus(train_cfg.data)
    corpus.check_fits(vocab_size=run_cfg.model.vocab_size, seq_len=seq_len)
    say = print if progress else (lambda *args, **kwargs: None)
    if ckpt.resume:
        idle = nothing_to_do(out_dir, latest_checkpoint(out_dir), train_cfg.steps)
        if idle is not None:
            say(idle[0], flush=True)
            return idle[1]
    keep_tokenizer(corpus, out_dir)
    params = engine.param_count()
    active = f" ({active_parameter_count(run_cfg.model):,} active per token)" if run_cfg.model.moe else ""
    say(f"training {params:,} parameters{active} on {corpus.name} ({corpus.n_tokens:,} tokens) for "
        f"{train_cfg.steps} steps of {train_cfg.batch_size * seq_len:,} tokens", flush=True)
    history, last_checkpoint = (resume(engine, run_cfg, ckpt, out_dir, corpus, say) if ckpt.resume
                                else (RunHistory(), None))
    history.restarts += startup_restarts
    saves = _Saves(out_dir, engine, run_cfg, ckpt, corpus, last_checkpoint)
    try:
        summary = _train_steps(saves, history, tensorboard, say, params)
    except (OSError, StorageFault) as error:  # a full disk or an unwritable folder: the operator's to fix
        fault = find_storage_fault(error)
        if fault is None:
            raise
        _remove_staged_saves(out_dir)  # never complete, and the space they hold is what ran out
        raise storage_stop(fault, saves.writing or fault.path or str(out_dir), out_dir, saves.last) from None
    say(f"done: {describe_summary(summary)}; wrote {out_dir / 'summary.json'}"
        + (f" and {saves.final}" if saves.final else ""), flush=True)
    return summary


def _train_steps(saves: _Saves, history: RunHistory, tensorboard, say, params: int) -> dict:
    """The steps left after `history`, with their records, checkpoints and restarts (the run's
    engine, config and folder are `saves`'); returns the summary, written to `summary.json`."""
    engine, run_cfg, out_dir, ckpt, corpus = saves.engine, saves.run_cfg, saves.out_dir, saves.ckpt, saves.corpus
    train_cfg = run_cfg.train
    log = _metrics_log(out_dir, history)
    tb = TensorBoardLog(tensorboard) if tensorboard else None
    start = time.perf_counter()
    try:
        step = history.steps_done
        while step < train_cfg.steps:
            try:
                record = _train_one_step(engine, run_cfg, step, history)
                saves.note_step(record)
                log.write(record)
                if tb is not None:
                    tb.write(record, history.extras)
                say(progress_line(step, train_cfg.steps, record["loss"], record["lr"], record["tokens_per_s"])
                    + (f" | val {record['val_loss']:.4f}" if "val_loss" in record else ""), flush=True)
                saves.after_step(step, history)
            except WorkerLost as lost:
                saves.lost()
                _restart_or_fail(engine, lost, step, history, saves.last, ckpt, train_cfg.steps, say)
                log.close()
                log = _metrics_log(out_dir, history)
            step = history.steps_done
    finally:
        log.close()
        if tb is not None:
            tb.close()
    summary = _summary(run_cfg, history, corpus, params=params, final_checkpoint=saves.final,
                       wall_time_s=time.perf_counter() - start)
    write_json_atomic(out_dir / "summary.json", summary)
    return summary


def _metrics_log(out_dir: Path, history: RunHistory) -> MetricsLog:
    """metrics.jsonl replaced by the records of `history` (what the run kept), then appended to."""
    return MetricsLog(out_dir / "metrics.jsonl", history.records)


class _Saves:
    """The run's checkpoint cadence: what is saved after each step, at once or in the background
    (`--async-checkpoint`: at most one write in flight, the next waits for it), the last complete
    checkpoint (`last`) and the final step's (`final`)."""

    def __init__(self, out_dir: Path, engine: Engine, run_cfg: RunConfig, ckpt: CheckpointConfig, corpus: Corpus,
                 last: Path | None) -> None:
        self.out_dir, self.engine, self.run_cfg, self.ckpt, self.corpus = out_dir, engine, run_cfg, ckpt, corpus
        self.last, self.final = last, None
        self.pending: PendingCheckpoint | None = None
        self.writing: str | None = None  # the checkpoint being written, for a full disk's message

    def _finish_pending(self) -> None:
        self.writing = f"checkpoint {checkpoints_dir(self.out_dir) / f'step_{self.pending.steps_done}'}"
        self.last, self.pending = self.pending.finish(self.engine), None
        self.writing = None

    def note_step(self, record: dict) -> None:
        """Mark a step that ran beside a background write, and commit the write once it is done."""
        if self.pending is not None:
            record["checkpoint_in_flight"] = True
            if self.pending.written(self.engine):
                self._finish_pending()

    def after_step(self, step: int, history: RunHistory) -> None:
        steps, keep = self.run_cfg.train.steps, self.run_cfg.train.keep_checkpoints
        saves = self.ckpt.saves_after(step + 1, steps)
        if saves:
            meta = checkpoint_meta(self.run_cfg, self.ckpt, history, self.corpus)
            if self.ckpt.async_save and self.pending is not None:
                self._finish_pending()
            self.writing = f"checkpoint {checkpoints_dir(self.out_dir) / f'step_{step + 1}'}"
            if self.ckpt.async_save:
                self.pending = begin_checkpoint(self.out_dir, step + 1, self.engine, meta, keep=keep)
            else:
                self.last = save_checkpoint(self.out_dir, step + 1, self.engine, meta, keep=keep)
            self.writing = None
        if step + 1 == steps:
            if self.pending is not None:  # the run ends once its last save is complete
                self._finish_pending()
            if saves:
                self.final = self.last

    def lost(self) -> None:
        """A rank was lost: its write in flight is gone with it (its .tmp is never committed)."""
        self.pending = self.writing = None


def _remove_staged_saves(out_dir: Path) -> None:
    """Delete the `step_N.tmp` folders of saves that will not complete (the run is stopping). Not the
    `.old` ones: one may be the only complete copy of its step (`restore_replaced_checkpoints`)."""
    root = checkpoints_dir(out_dir)
    for tmp in root.glob("step_*.tmp") if root.is_dir() else ():
        shutil.rmtree(tmp, ignore_errors=True)


def _summary(run_cfg: RunConfig, history: RunHistory, corpus: Corpus, *, params: int, final_checkpoint: Path | None,
             wall_time_s: float) -> dict:
    """summary.json's contents for a finished run."""
    step_times = history.step_times
    train_time = sum(step_times)
    return {
        "losses": history.losses,
        "val_loss": history.val_losses[-1][1],
        "val_losses": history.val_losses,
        "step_time_s": median(step_times),
        "tokens_per_s": history.tokens_seen / train_time if train_time > 0 else None,
        "train_time_s": train_time,
        "wall_time_s": wall_time_s,
        "tokens_seen": history.tokens_seen,
        "final_checkpoint": None if final_checkpoint is None else str(final_checkpoint),
        "params": params,
        # what one token's forward uses: K of the E routed experts of each MoE sublayer
        "active_params": active_parameter_count(run_cfg.model) if run_cfg.model.moe else params,
        "restarts": history.restarts,
        "data": {"name": corpus.name, "train_tokens": len(corpus.train_tokens_N),
                 "val_tokens": len(corpus.val_tokens_N), **data_record(corpus)},
        "config": run_cfg.to_dict(),
        **history.extras,
    }


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
    or raise RunFailed naming the lost (or hung: RankHung) rank and step when no restart is left.
    Each says it in one line: the cause's first line (a rank's report may carry its traceback)."""
    where, cause = f"{describe_rank(lost.pp_rank)} lost at step {step + 1}/{steps}", f": {first_line(lost)}"
    if isinstance(lost, RankHung):  # the sign is the cause: said once
        where, cause = f"{describe_rank(lost.pp_rank)} stopped answering at step {step + 1}/{steps} ({lost.why})", ""
    restart = getattr(engine, "restart_workers", None)
    if restart is None:
        raise RunFailed(f"{where}{cause} (this launcher cannot restart workers)") from lost
    if history.restarts >= ckpt.max_restarts:
        limit = f"{history.restarts} restart(s), the limit set by --max-restarts"
        raise RunFailed(f"{where} after {limit}{cause}") from lost
    restarts = history.restarts + 1
    origin = (f"checkpoint step {read_meta(last_checkpoint)['steps_done']}" if last_checkpoint
              else "step 0 (no checkpoint yet)")
    say(f"{where}; restarting from {origin} (restart {restarts}/{ckpt.max_restarts})"
        + (f"; cause{cause}" if cause else ""), flush=True)
    try:
        restart()
        restored = restore(engine, last_checkpoint, history.records) if last_checkpoint else None
    except RuntimeError as again:  # WorkerLost again, or no room for the new workers (a node is gone)
        raise RunFailed(f"{where}; the restart failed too: {first_line(again)}") from again
    if restored is None:
        history.rewind(0)
    else:
        history.losses, history.step_times, history.tokens = restored.losses, restored.step_times, restored.tokens
        history.val_losses, history.records = restored.val_losses, restored.records
    history.restarts = restarts


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
