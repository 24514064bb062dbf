"""`attnres-pp train`: build a RunConfig from defaults < `--config FILE` (TOML) < flags, pick the
engine (this process, or the pipeline's `make_engine`) and run the shared training loop."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from attnres_pp.data import load_corpus
from attnres_pp.model.config import KEY_MODES, RESIDUALS
from attnres_pp.pipeline.config import LAUNCHERS, SCHEDULE_NAMES
from attnres_pp.train.config import RunConfig, merge_tables, read_toml
from attnres_pp.train.loop import run_training

# (flag, table, key, type, help); a flag left unset keeps the TOML or default value.
_FLAGS = (
    ("--residual", "model", "residual", str, f"residual variant: {' | '.join(RESIDUALS)}"),
    ("--block-size", "model", "block_size", int, "sublayers per AttnRes block (1 = Full AttnRes)"),
    ("--key-mode", "model", "key_mode", str, f"low-rank key mode: {' | '.join(KEY_MODES)}"),
    ("--key-rank", "model", "key_rank", int, "low-rank key dimension r"),
    ("--layers", "model", "n_layers", int, "transformer layers (two sublayers each)"),
    ("--d-model", "model", "d_model", int, "model width d"),
    ("--heads", "model", "n_heads", int, "attention heads"),
    ("--seq-len", "model", "seq_len", int, "tokens per sequence"),
    ("--vocab-size", "model", "vocab_size", int, "vocabulary size (256 for byte corpora)"),
    ("--batch-size", "train", "batch_size", int, "global sequences per step"),
    ("--microbatches", "train", "microbatches", int, "microbatches per step (gradient accumulation)"),
    ("--steps", "train", "steps", int, "optimiser steps"),
    ("--lr", "train", "lr", float, "peak learning rate"),
    ("--warmup-steps", "train", "warmup_steps", int, "linear warmup steps"),
    ("--seed", "train", "seed", int, "seed for init and data"),
    ("--data", "train", "data", str, "'builtin' (stdlib source bytes), FILE.txt or FILE.bin (uint16 tokens)"),
    ("--eval-every", "train", "eval_every", int, "evaluate every k steps (0 = only at the end)"),
    ("--threads", "train", "threads", int, "torch threads per process"),
    ("--stages", "pipeline", "stages", int, "pipeline stages P (ranks)"),
    ("--virtual", "pipeline", "virtual", int, "virtual stages V per rank"),
    ("--schedule", "pipeline", "schedule", str, f"pipeline schedule: {' | '.join(SCHEDULE_NAMES)}"),
    ("--launcher", "pipeline", "launcher", str, f"how ranks start: {' | '.join(LAUNCHERS)}"),
    ("--timeout", "pipeline", "timeout_s", float, "pipeline timeout in seconds"),
)


class ConfigError(ValueError):
    """A flag value that cannot be parsed into a config field."""


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "train", help="train a model (single process or pipelined)",
        description="Train an Attention-Residual transformer. Flags override --config, which overrides defaults.",
    )
    parser.add_argument("--config", metavar="FILE", help="TOML file with [model], [train], [pipeline] tables")
    for flag, _table, _key, _kind, help_text in _FLAGS:
        # Parsed as strings and converted here, so a bad value is one clear `error:` line.
        parser.add_argument(flag, metavar=_key.upper(), help=help_text)
    parser.add_argument("--cache", choices=("on", "off"), help="cross-stage block cache")
    parser.add_argument("--layer-counts", metavar="N,N,..", help="transformer layers per chunk, comma separated")
    parser.add_argument("--out", metavar="DIR", help="run directory (default runs/<timestamp>)")
    parser.add_argument("--quiet", action="store_true", help="no per-step progress lines")
    parser.set_defaults(func=main)


def build_run_config(args: argparse.Namespace) -> RunConfig:
    """defaults < TOML (`args.config`) < flags. Raises ValueError naming the field to fix."""
    base = read_toml(args.config) if args.config else {}
    return RunConfig.from_dict(merge_tables(base, flag_overrides(args)))


def flag_overrides(args: argparse.Namespace) -> dict:
    overrides: dict[str, dict] = {"model": {}, "train": {}, "pipeline": {}}
    for flag, table, key, kind, _help in _FLAGS:
        raw = getattr(args, flag[2:].replace("-", "_"))
        if raw is not None:
            overrides[table][key] = _convert(flag, raw, kind)
    if args.cache is not None:
        overrides["pipeline"]["cache"] = args.cache == "on"
    if args.layer_counts is not None:
        overrides["pipeline"]["layer_counts"] = [
            _convert("--layer-counts", part, int) for part in args.layer_counts.split(",")
        ]
    return {table: values for table, values in overrides.items() if values}


def _convert(flag: str, raw: str, kind: type):
    try:
        return kind(raw)
    except ValueError:
        expected = {int: "an integer", float: "a number"}.get(kind, kind.__name__)
        raise ConfigError(f"{flag} {raw!r} is invalid: expected {expected}") from None


def make_run_engine(run_cfg: RunConfig, out_dir: Path):
    """LocalEngine for one chunk with the local launcher; otherwise the pipeline's engine (which
    may write traces under `out_dir`)."""
    if run_cfg.pipeline.is_single_process and run_cfg.pipeline.launcher == "local":
        from attnres_pp.train.local_engine import LocalEngine

        return LocalEngine(run_cfg.model, run_cfg.train)
    try:
        from attnres_pp.pipeline.launch import make_engine
    except ModuleNotFoundError as error:
        if error.name and error.name.startswith("attnres_pp"):
            raise ConfigError(
                f"--launcher {run_cfg.pipeline.launcher} with --stages/--virtual > 1 needs the pipeline engine, "
                "which is not installed yet (use --stages 1 --virtual 1 --launcher local)"
            ) from None
        raise ConfigError(
            f"--launcher {run_cfg.pipeline.launcher} needs the Python package {error.name!r}, which is missing: "
            f"pip install {error.name} (or use --stages 1 --virtual 1 --launcher local)"
        ) from None
    return make_engine(run_cfg, out_dir=out_dir)


def main(args: argparse.Namespace) -> int:
    try:
        run_cfg = build_run_config(args)
        # Load and check the data before starting any engine, so a bad --data fails in a second.
        corpus = load_corpus(run_cfg.train.data)
        corpus.check_fits(vocab_size=run_cfg.model.vocab_size, seq_len=run_cfg.model.seq_len)
        out_dir = Path(args.out) if args.out else Path("runs") / time.strftime("%Y%m%d-%H%M%S")
        engine = make_run_engine(run_cfg, out_dir)
    except ValueError as error:  # config mistakes: one line, no traceback
        print(f"error: {error}", file=sys.stderr)
        return 2
    try:
        run_training(run_cfg, engine, out_dir, progress=not args.quiet, corpus=corpus)
    finally:
        engine.close()
    return 0
