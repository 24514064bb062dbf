"""Resuming a run: whether a checkpoint can be continued with the flags given (`check_resume`),
whether there is anything left to train (`nothing_to_do`), and restoring the engine and the run's
history from the newest complete checkpoint, once a crash's leftovers are mended (`resume`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from attnres_pp.data import Corpus
from attnres_pp.train.checkpoint import (
    CheckpointConfig,
    check_format,
    latest_checkpoint,
    read_meta,
    remove_interrupted_saves,
    restore_replaced_checkpoints,
)
from attnres_pp.train.config import RunConfig
from attnres_pp.train.recovery import RunHistory
from attnres_pp.train.summary import describe_summary, read_metrics


def resume(engine, run_cfg: RunConfig, ckpt: CheckpointConfig, out_dir: Path, corpus: Corpus,
            say) -> tuple[RunHistory, Path]:
    """The run's history and last checkpoint once a crash's leftovers are mended and the newest
    complete checkpoint is loaded into `engine`."""
    for name in restore_replaced_checkpoints(out_dir):
        say(f"restored {name} from {name}.old: a crash came between the renames of a save that replaced it",
            flush=True)
    for name in remove_interrupted_saves(out_dir):
        say(f"removed {name}: a checkpoint save that a crash interrupted", flush=True)
    last_checkpoint = latest_checkpoint(out_dir)
    check_resume(read_meta(last_checkpoint), run_cfg, corpus)
    history = restore(engine, last_checkpoint, _read_records(out_dir / "metrics.jsonl"))
    say(f"resuming from {last_checkpoint} (continuing at step {history.steps_done + 1}; "
        f"{_describe_settings(run_cfg, ckpt)})", flush=True)
    return history, last_checkpoint


def restore(engine, step_dir: Path, records: list[dict]) -> RunHistory:
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
    """metrics.jsonl's records; what a crash tore or a disk damaged is ignored with one warning line
    (the steps after the checkpoint are trained and written again, the earlier ones keep their losses
    in meta.json)."""
    records, warning = read_metrics(path)
    if warning is not None:
        print(f"warning: {warning}", file=sys.stderr, flush=True)
    return records
