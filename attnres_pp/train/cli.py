"""`attnres-pp train`: build a RunConfig from defaults < `--config FILE` (TOML) < flags, pick the
engine (`train.engines.make_engine`: this process, or a pipeline on the launcher's ranks) and run
the shared training loop, with checkpoints, resume and recovery from lost workers
(`attnres_pp.train.checkpoint`, `.recovery`).
With `--resume DIR` the defaults are the checkpoint's own settings: its config and its checkpoint
cadence and restart limit. One-off flags (`--inject-failure`, `--address`, `--quiet`, `--tensorboard`) are
never saved."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

from attnres_pp.cli_flags import convert_flag
from attnres_pp.data import load_corpus
from attnres_pp.data.token_folder import is_token_folder, read_folder_meta
from attnres_pp.model.config import ModelConfig
from attnres_pp.model_flags import add_layer_counts_flag, add_model_flags, layer_counts_flag, model_overrides
from attnres_pp.out_paths import check_out_dir
from attnres_pp.pipeline.config import (
    DP_SHARDS,
    LAUNCHERS,
    P2P_SEMANTICS,
    PLACEMENTS,
    RESHARD_AFTER_FORWARD,
    SCHEDULE_NAMES,
)
from attnres_pp.train.checkpoint import (
    CheckpointConfig,
    check_run_dir,
    kill_point,
    latest_checkpoint,
    read_meta,
)
from attnres_pp.train.config import (
    ACTIVATION_CHECKPOINTS,
    DEVICES,
    DTYPES,
    FAULT_TOLERANCES,
    KERNELS,
    RunConfig,
    TrainConfig,
    merge_tables,
    read_toml,
)
from attnres_pp.train.loop import check_resume, nothing_to_do, run_training
from attnres_pp.train.metadata_pickle import CheckpointRefused
from attnres_pp.train.recovery import RunFailed
from attnres_pp.train.tensorboard import check_tensorboard

# (flag, table, key, type, help); a flag left unset keeps the TOML or default value. The model's flags are
# `model_flags`' (shared with `simulate memory` and `simulate plan`).
_FLAGS = (
    ("--batch-size", "train", "batch_size", int, "global sequences per step"),
    ("--microbatches", "train", "microbatches", int, "microbatches per step (gradient accumulation)"),
    ("--steps", "train", "steps", int, "optimiser steps"),
    ("--lr", "train", "lr", float, "peak learning rate"),
    ("--warmup-steps", "train", "warmup_steps", int, "linear warmup steps"),
    ("--seed", "train", "seed", int, "seed for init and data"),
    ("--data", "train", "data", str, "'builtin' (stdlib source bytes), FILE.txt, FILE.bin "
     "(uint16 tokens) or a data folder of `attnres-pp prepare` (DIR with meta.json; sets --vocab-size)"),
    ("--eval-every", "train", "eval_every", int, "evaluate every k steps (0 = only at the end)"),
    ("--log-routing-every", "train", "log_routing_every", int,
     "every k steps add routing entropy and embedding weight per reading site to metrics.jsonl (0 = never)"),
    ("--threads", "train", "threads", int, "torch threads per process"),
    ("--keep-checkpoints", "train", "keep_checkpoints", int,
     "checkpoints kept: the newest K (default 2; 0 keeps all), and always the final one"),
    ("--device", "train", "device", str, f"{' | '.join(DEVICES)}: cuda gives every rank its own GPU (nccl), "
     "cpu uses gloo; auto picks cuda when there are enough GPUs"),
    ("--dtype", "train", "dtype", str, f"{' | '.join(DTYPES)}: bf16 autocast with fp32 master weights and bf16 "
     "hops; auto: bf16 on cuda, fp32 on cpu"),
    ("--kernels", "train", "kernels", str, f"depth-attention backend: {' | '.join(KERNELS)} "
     "(auto: triton on cuda, torch on cpu)"),
    ("--activation-checkpoint", "train", "activation_checkpoint", str,
     f"{' | '.join(ACTIVATION_CHECKPOINTS)}: full recomputes each layer in its backward, selective keeps the "
     "projections and recomputes norms, softmax and depth-attention intermediates"),
    ("--stages", "pipeline", "stages", int, "pipeline stages P (ranks)"),
    ("--virtual", "pipeline", "virtual", int, "virtual stages V per rank"),
    ("--data-parallel", "pipeline", "data_parallel", int,
     "replicas D of the pipeline (D x P ranks; --batch-size stays the global batch)"),
    ("--schedule", "pipeline", "schedule", str, f"pipeline schedule: {' | '.join(SCHEDULE_NAMES)}"),
    ("--launcher", "pipeline", "launcher", str, f"how ranks start: {' | '.join(LAUNCHERS)}"),
    ("--timeout", "pipeline", "timeout_s", float, "pipeline timeout in seconds"),
    ("--placement", "pipeline", "placement", str,
     f"ray placement of the ranks: {' | '.join(PLACEMENTS)} (PACK or SPREAD for several nodes)"),
    ("--p2p-semantics", "pipeline", "p2p_semantics", str,
     f"point-to-point rules: {' | '.join(P2P_SEMANTICS)} (nccl under --launcher inprocess: the loopback "
     "enforces NCCL's in-order, rendezvous matching; auto: the process group's backend)"),
    ("--link-gbps", "pipeline", "link_gbps", float,
     "emulate a slow link between ranks on one host: its bandwidth in Gb/s (off by default)"),
    ("--link-latency-us", "pipeline", "link_latency_us", float, "the emulated link's latency in microseconds"),
    ("--dp-shard", "pipeline", "dp_shard", str,
     f"{' | '.join(DP_SHARDS)}: how the D replicas hold parameters, gradients and optimizer state"),
    ("--tensor-parallel", "pipeline", "tensor_parallel", int,
     "tensor-parallel ranks T per chunk, on one node (D x P x T ranks; default 1)"),
    ("--fault-tolerance", "train", "fault_tolerance", str,
     f"{' | '.join(FAULT_TOLERANCES)}: replicas makes each of the D pipelines a torchft replica group that "
     "restarts alone and heals from a live one (needs the [ft] extra; docs/ray.md)"),
    ("--lighthouse", "train", "lighthouse", str,
     "--fault-tolerance replicas: the torchft Lighthouse URL to join (default: one started for the job)"),
    ("--min-replicas", "train", "min_replicas", int,
     "--fault-tolerance replicas: replica groups a step needs to commit (default 1; fewer wait, up to --timeout)"),
    ("--fsdp-reshard-after-forward", "pipeline", "fsdp_reshard_after_forward", str,
     f"{' | '.join(RESHARD_AFTER_FORWARD)} (--dp-shard fsdp only; default never)"),
)


class ConfigError(ValueError):
    """A flag value that cannot be parsed into a config field."""


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "train", help="train a model (single process or pipelined)",
        description="Train an Attention-Residual transformer. Flags override --config, which overrides defaults.",
    )
    parser.add_argument("--config", metavar="FILE", help="TOML file with [model], [train], [pipeline] tables")
    add_model_flags(parser)
    for flag, _table, _key, _kind, help_text in _FLAGS:
        # Parsed as strings and converted here, so a bad value is one clear `error:` line.
        parser.add_argument(flag, metavar=_key.upper(), help=help_text)
    parser.add_argument("--cache", choices=("on", "off"), help="cross-stage block cache")
    parser.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=None,
                        help="with --tensor-parallel > 1, split every sequence over the tp ranks between layers "
                             "(default on when T > 1)")
    parser.add_argument("--compile", action="store_true", default=None,
                        help="torch.compile each sublayer and its depth read (single-process runs only)")
    add_layer_counts_flag(parser)
    parser.add_argument("--out", metavar="DIR", help="run directory (default runs/<timestamp>)")
    parser.add_argument("--quiet", action="store_true", help="no per-step progress lines")
    parser.add_argument("--tensorboard", metavar="DIR",
                        help="also write the per-step scalars as TensorBoard events in DIR (needs the [tb] extra)")
    parser.add_argument("--address", metavar="ADDR",
                        help="--launcher ray: the cluster to join (default RAY_ADDRESS, else a private local "
                             "instance; 'auto' joins the `ray start` cluster of this machine)")
    parser.add_argument("--checkpoint-every", metavar="K",
                        help="save DIR/checkpoints/step_N every K steps too (default 0: only the final one; "
                             "--resume: as saved)")
    parser.add_argument("--final-checkpoint", action=argparse.BooleanOptionalAction, default=None,
                        help="save a checkpoint of the last step, the trained model (default; --resume: as saved)")
    parser.add_argument("--async-checkpoint", action=argparse.BooleanOptionalAction, default=None,
                        help="write checkpoints in the background while training goes on (DCP async_save; one "
                             "save in flight, the next waits for it; each rank holds a copy of its state until "
                             "its write is done; default off; --resume: as saved)")
    parser.add_argument("--resume", metavar="DIR",
                        help="continue the run in DIR from its newest complete checkpoint, with its saved config, "
                             "checkpoint cadence and restart limit (flags override them)")
    parser.add_argument("--max-restarts", metavar="N",
                        help="restarts after a lost rank before the run stops (default 3; --resume: as saved; "
                             "ray and local launchers)")
    parser.add_argument("--inject-failure", metavar="RANK:STEP[:allreduce]",
                        help="rehearse a failure: that rank's worker exits during that step (1-based), mid-pipeline, "
                             "or with ':allreduce' as it would join the replicas' gradient all-reduce, its peers "
                             "already in it (--fault-tolerance replicas)")
    parser.set_defaults(func=main)


def build_run_config(args: argparse.Namespace) -> RunConfig:
    """defaults (or the resumed checkpoint's config) < TOML (`args.config`) < flags. Raises
    ValueError naming the field to fix."""
    resumed = _resumed_meta(args.resume) if getattr(args, "resume", None) else {}
    saved = resumed.get("config", {})
    overrides = flag_overrides(args)
    if saved and ({"stages", "virtual"} & set(overrides.get("pipeline", {}))) and args.layer_counts is None:
        # A resumed run may change the split (the shards load into any); the saved per-chunk layer
        # counts belong to the old split, so without new ones the layers split evenly.
        saved = {**saved, "pipeline": {k: v for k, v in saved.get("pipeline", {}).items() if k != "layer_counts"}}
    toml = read_toml(args.config) if args.config else {}
    base = merge_tables(saved, toml) if args.config else saved
    merged = merge_tables(base, overrides)
    given_vocab = {**toml.get("model", {}), **overrides.get("model", {})}.get("vocab_size")
    run_cfg = RunConfig.from_dict(_vocab_from_data_folder(merged, given_vocab, resumed))
    if run_cfg.train.log_routing_every and not run_cfg.model.uses_depth_attention:
        raise ConfigError("--log-routing-every needs a depth-attention residual (the standard one has no "
                          "routing): drop it or choose --residual attnres, lr_attnres or msar")
    # The saved model read back through ModelConfig: a checkpoint from before a field existed has its default.
    saved_model = ModelConfig.from_dict(saved["model"]).to_dict() if saved else {}
    if saved and run_cfg.model.to_dict() != saved_model:
        changed = sorted(k for k, v in run_cfg.model.to_dict().items() if saved_model.get(k) != v)
        raise ConfigError(f"--resume {args.resume}: the checkpoint holds another model (model {changed} differ); "
                          "drop the flags or TOML keys that change the model")
    return run_cfg


def _vocab_from_data_folder(tables: dict, given_vocab, resumed: dict) -> dict:
    """`tables` with [model] vocab_size set to the data folder's (its meta.json) when --data names
    one; a --vocab-size (or TOML vocab_size) the user gave must be that one. A resumed run's folder
    must have the checkpoint's tokenizer (checked first: another one has another vocabulary too)."""
    data = tables.get("train", {}).get("data", TrainConfig.data)
    if not isinstance(data, str) or data == "builtin" or not is_token_folder(data):
        return tables
    meta = read_folder_meta(data)
    vocab = meta["vocab_size"]
    if resumed:
        check_resume(resumed, RunConfig(), tokenizer_sha256=meta["tokenizer_sha256"], data=data, seed=False)
    if given_vocab is not None and given_vocab != vocab:
        raise ConfigError(f"--vocab-size {given_vocab} differs from the data folder's vocab_size {vocab} "
                          f"({Path(data) / 'meta.json'}): drop --vocab-size (the folder sets it)")
    return merge_tables(tables, {"model": {"vocab_size": vocab}})


def _resumed_meta(run_dir: str) -> dict:
    """meta.json of the newest complete checkpoint in `run_dir`."""
    step_dir = latest_checkpoint(run_dir)
    if step_dir is None:
        check_run_dir(run_dir, resume=True)  # raises the message that says what is missing
    return read_meta(step_dir)


def checkpoint_config(args: argparse.Namespace) -> CheckpointConfig:
    """defaults (or, with --resume, the checkpoint's saved "checkpointing" table) < flags. Without the
    saved table a resumed run would save nothing more, and a second crash would lose all since."""
    settings = dict(_resumed_meta(args.resume).get("checkpointing", {})) if args.resume else {}
    if args.checkpoint_every is not None:
        settings["every"] = convert_flag("--checkpoint-every", args.checkpoint_every, int)
    if args.max_restarts is not None:
        settings["max_restarts"] = convert_flag("--max-restarts", args.max_restarts, int)
    if args.final_checkpoint is not None:
        settings["final"] = args.final_checkpoint
    if args.async_checkpoint is not None:
        settings["async_save"] = args.async_checkpoint
    return CheckpointConfig.from_settings(settings, resume=args.resume is not None)


def parse_failure(text: str | None, run_cfg: RunConfig) -> tuple | None:
    """`--inject-failure RANK:STEP[:allreduce]` (STEP 1-based, as progress lines count) as (rank,
    0-based step), or (rank, 0-based step, "allreduce") for the failure inside the replicas' reduction."""
    if text is None:
        return None
    rank_text, _, rest = text.partition(":")
    step_text, _, point = rest.partition(":")
    try:
        rank, step = int(rank_text), int(step_text)
    except ValueError:
        raise ConfigError(f"--inject-failure {text!r} is invalid: expected RANK:STEP, e.g. 1:3") from None
    if point not in ("", "allreduce"):
        raise ConfigError(f"--inject-failure {text!r} is invalid: the point after STEP can only be 'allreduce'")
    if point and run_cfg.train.fault_tolerance != "replicas":
        raise ConfigError(f"--inject-failure {text!r} is invalid: ':allreduce' is for --fault-tolerance replicas "
                          "(the replicas' reduction through torchft); drop it to fail mid-pipeline")
    pipe, steps = run_cfg.pipeline, run_cfg.train.steps
    if not 0 <= rank < pipe.world_size:
        layout = f"--stages {pipe.stages}"
        if pipe.data_parallel > 1:
            layout += f" x --data-parallel {pipe.data_parallel}"
        if pipe.tensor_parallel > 1:
            layout += f" x --tensor-parallel {pipe.tensor_parallel}"
        raise ConfigError(f"--inject-failure {text!r} is invalid: RANK must be in 0..{pipe.world_size - 1} ({layout})")
    if not 1 <= step <= steps:
        raise ConfigError(f"--inject-failure {text!r} is invalid: STEP must be in 1..{steps} (--steps {steps})")
    return (rank, step - 1, point) if point else (rank, step - 1)


def flag_overrides(args: argparse.Namespace) -> dict:
    overrides: dict[str, dict] = {"model": model_overrides(args), "train": {}, "pipeline": {}}
    for flag, table, key, kind, _help in _FLAGS:
        raw = getattr(args, flag[2:].replace("-", "_"))
        if raw is not None:
            overrides[table][key] = convert_flag(flag, raw, kind)
    if args.cache is not None:
        overrides["pipeline"]["cache"] = args.cache == "on"
    if getattr(args, "sequence_parallel", None) is not None:
        overrides["pipeline"]["sequence_parallel"] = args.sequence_parallel
    if getattr(args, "compile", None):
        overrides["train"]["compile"] = True
    if args.layer_counts is not None:
        overrides["pipeline"]["layer_counts"] = list(layer_counts_flag(args))
    return {table: values for table, values in overrides.items() if values}


def make_run_engine(run_cfg: RunConfig, out_dir: Path, *, address: str | None = None,
                    fail_at: tuple[int, int] | None = None, corpus=None):
    """The engine `train.engines.make_engine` chooses for the run (which may write traces under
    `out_dir`), imported only when a run starts. `address` is for the ray launcher; `fail_at` =
    (global rank, 0-based step) makes that rank's worker exit; `corpus`, the loaded data, serves
    the engines that read it in this process."""
    if run_cfg.train.device == "cpu":  # refuse Triton on cpu here, before a launcher starts Ray or ranks
        from attnres_pp.train.devices import resolve_train

        resolve_train(run_cfg.train, "cpu")
    from attnres_pp.train.engines import make_engine
    from attnres_pp.train.memory_fit import check_training_fits

    check_training_fits(run_cfg, address=address)

    return make_engine(run_cfg, out_dir=out_dir, corpus=corpus, address=address, fail_at=fail_at)


def main(args: argparse.Namespace) -> int:
    """`attnres-pp train`. In a process torchrun started, rank 0 runs it and every other rank serves
    rank 0's calls (`--launcher torchrun`, `pipeline.torchrun_rank_group`)."""
    from attnres_pp.pipeline.torchrun_channel import TorchrunEnv

    torchrun = TorchrunEnv.from_environ()
    if torchrun is None:
        return _run(args)
    from attnres_pp.pipeline.torchrun_rank_group import run_torchrun_rank

    return run_torchrun_rank(torchrun, lambda: _run(args), lambda: build_run_config(args))


def _run(args: argparse.Namespace) -> int:
    # Ray folds log lines that differ only in numbers into one "[repeated Nx]" line, which would hide
    # all but one rank's lines; read at Ray's import, so set before the engine imports it.
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    try:
        run_cfg = build_run_config(args)
        checkpoints = checkpoint_config(args)
        kill_point()  # a bad rehearsal value fails here, not at the first save
        fail_at = parse_failure(args.inject_failure, run_cfg)
        # Load and check the data before starting any engine, so a bad --data fails in a second.
        corpus = load_corpus(run_cfg.train.data)
        corpus.check_fits(vocab_size=run_cfg.model.vocab_size, seq_len=run_cfg.model.seq_len)
        if args.resume and args.out and Path(args.out) != Path(args.resume):
            raise ConfigError(f"--resume {args.resume} continues that run in its own directory: drop --out")
        out_dir = Path(args.resume or args.out or Path("runs") / time.strftime("%Y%m%d-%H%M%S"))
        if args.tensorboard:
            check_out_dir(args.tensorboard, "--tensorboard")
            check_tensorboard()
        if not args.resume:  # a resumed run's directory is checked for its checkpoints below
            check_out_dir(out_dir, "--out")
        check_run_dir(out_dir, checkpoints.resume)
        if checkpoints.resume:  # before any engine starts: a finished run, or one that cannot go on
            idle = nothing_to_do(out_dir, latest_checkpoint(out_dir), run_cfg.train.steps)
            if idle is not None:
                print(idle[0])
                return 0
            check_resume(read_meta(latest_checkpoint(out_dir)), run_cfg, corpus)
        engine = make_run_engine(run_cfg, out_dir, address=args.address, fail_at=fail_at, corpus=corpus)
    except ValueError as error:  # config mistakes: one line, no traceback
        print(f"error: {error}", file=sys.stderr)
        return 2
    # The engine resolved device, dtype and kernels ("auto"); the summary records what ran.
    run_cfg = dataclasses.replace(run_cfg, train=engine.train_cfg)
    try:
        run_training(run_cfg, engine, out_dir, progress=not args.quiet, corpus=corpus, checkpoints=checkpoints,
                     tensorboard=args.tensorboard)
    except RunFailed as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except CheckpointRefused as error:  # a shard the driver's metadata check could not see into
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: stopping the workers", file=sys.stderr)
        return 130
    finally:
        engine.close()
    return 0
