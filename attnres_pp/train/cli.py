"""`attnres-pp train`: build a RunConfig from defaults < `--config FILE` (TOML) < flags, pick the
engine (`train.engines.make_engine`: this process, or a pipeline on the launcher's ranks) and run
the shared training loop, with checkpoints, resume and recovery from lost workers
(`attnres_pp.train.checkpoint`, `.recovery`).
With `--resume DIR` the defaults are the checkpoint's own settings: its config and its checkpoint
cadence and restart limit. One-off flags (`--inject-failure`, `--address`, `--quiet`, `--tensorboard`) are
never saved."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import signal
import sys
import threading
import time
from pathlib import Path

from attnres_pp.cli_flags import convert_flag
from attnres_pp.data import load_corpus
from attnres_pp.data.token_folder import is_token_folder, read_folder_meta
from attnres_pp.launch.flags import add_run_flags, run_values
from attnres_pp.model.config import ModelConfig
from attnres_pp.model_flags import add_layer_counts_flag, add_model_flags, layer_counts_flag, model_overrides
from attnres_pp.out_paths import check_out_dir
from attnres_pp.train.checkpoint import (
    CheckpointConfig,
    check_run_dir,
    latest_checkpoint,
    read_meta,
)
from attnres_pp.train.config import RunConfig, TrainConfig, merge_tables, read_toml
from attnres_pp.train.faults import check_rank_rehearsals, kill_point, parse_failure
from attnres_pp.train.loop import run_training
from attnres_pp.train.metadata_pickle import CheckpointRefused
from attnres_pp.train.recovery import RunFailed, RunStopped, start_engine
from attnres_pp.train.resume import check_resume, nothing_to_do
from attnres_pp.train.tensorboard import check_tensorboard


class ConfigError(ValueError):
    """A flag value that cannot be parsed into a config field."""


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "train", help="train a model (single process or pipelined)",
        description="Train an Attention-Residual transformer. Flags override --config, which overrides defaults.",
    )
    parser.add_argument("--config", metavar="FILE", help="TOML file with [model], [train], [pipeline] tables")
    add_model_flags(parser)
    add_run_flags(parser)
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
    parser.add_argument("--init-from", metavar="DIR",
                        help="start a new standard-residual run from the weights of a Hugging Face Llama, Qwen3, "
                             "Mixtral or Qwen3-MoE folder (e.g. from attnres-pp export) instead of the seeded ones; "
                             "the model flags must match its shapes (one process: --launcher local, one chunk)")
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


def _initial_weights(args: argparse.Namespace, run_cfg: RunConfig) -> dict | None:
    """The `--init-from` folder's weights under our names, checked against the run's model; None
    without the flag. ValueError for a folder that does not fit the run."""
    if not getattr(args, "init_from", None):
        return None
    from attnres_pp.launch.resolve import engine_of
    from attnres_pp.train.init_from import read_init_folder

    if engine_of(run_cfg.pipeline, run_cfg.train.fault_tolerance) != "single":
        raise ConfigError("--init-from runs in one process: use --launcher local with one stage and chunk "
                          "(no --stages, --virtual, --data-parallel, --tensor-parallel or --fault-tolerance)")
    return read_init_folder(args.init_from, run_cfg.model)


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


def flag_overrides(args: argparse.Namespace) -> dict:
    given = run_values(args)
    overrides: dict[str, dict] = {"model": model_overrides(args), "train": given.get("train", {}),
                                  "pipeline": given.get("pipeline", {})}
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
                    fail_at: tuple[int, int] | None = None, corpus=None, rehearse: bool = True):
    """The engine `train.engines.make_engine` chooses for the run (which may write traces under
    `out_dir`), imported only when a run starts. `address` is for the ray launcher; `fail_at` =
    (global rank, 0-based step) makes that rank's worker exit; `corpus`, the loaded data, serves
    the engines that read it in this process; `rehearse`: the ranks' first start (the env
    rehearsal hooks of `train.faults` may act)."""
    from attnres_pp.train.engines import check_run, make_engine
    from attnres_pp.train.memory_fit import check_training_fits

    check_run(run_cfg, address=address, fail_at=fail_at)  # before the memory check, which may join Ray
    check_training_fits(run_cfg, address=address)

    return make_engine(run_cfg, out_dir=out_dir, corpus=corpus, address=address, fail_at=fail_at,
                       rehearse=rehearse)


def start_run_engine(args: argparse.Namespace, run_cfg: RunConfig, out_dir: Path, checkpoints: CheckpointConfig,
                     *, fail_at, corpus) -> tuple[object, int]:
    """(`make_run_engine`'s engine, the restarts its start took): start-up is part of the run, so a
    rank lost while the ranks start makes them start again within --max-restarts, counted with a
    resumed run's earlier restarts (`recovery.start_engine`; torchrun's processes only torchrun
    restarts)."""
    restarts_done = int(read_meta(latest_checkpoint(out_dir)).get("restarts", 0)) if checkpoints.resume else 0
    return start_engine(lambda first: make_run_engine(run_cfg, out_dir, address=args.address, fail_at=fail_at,
                                                      corpus=corpus, rehearse=first),
                        max_restarts=checkpoints.max_restarts, restarts_done=restarts_done,
                        can_restart=run_cfg.pipeline.launcher != "torchrun", say=_silent if args.quiet else print)


def main(args: argparse.Namespace) -> int:
    """`attnres-pp train`. In a process torchrun started, rank 0 runs it and every other rank serves
    rank 0's calls (`--launcher torchrun`, `launch.torchrun_rank_group`)."""
    from attnres_pp.launch.torchrun_channel import TorchrunEnv

    torchrun = TorchrunEnv.from_environ()
    if torchrun is None:  # (torchrun's agent signals its ranks itself: its rank group handles SIGTERM)
        with _sigterm_stops_the_run():
            return _run(args)
    from attnres_pp.launch.torchrun_rank_group import run_torchrun_rank

    return run_torchrun_rank(torchrun, lambda: _run(args), lambda: build_run_config(args))


def _run(args: argparse.Namespace) -> int:
    # Ray folds log lines that differ only in numbers into one "[repeated Nx]" line, which would hide
    # all but one rank's lines; read at Ray's import, so set before the engine imports it.
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    try:
        if getattr(args, "init_from", None) and args.resume:
            raise ConfigError("--init-from starts a new run and --resume continues one: give one of them")
        run_cfg = build_run_config(args)
        checkpoints = checkpoint_config(args)
        kill_point()  # a bad rehearsal value fails here, not at the first save
        fail_at = parse_failure(args.inject_failure, run_cfg)
        check_rank_rehearsals(run_cfg)
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
        initial = _initial_weights(args, run_cfg)
        engine, startup_restarts = start_run_engine(args, run_cfg, out_dir, checkpoints, fail_at=fail_at,
                                                    corpus=corpus)
    except ValueError as error:  # config mistakes: one line, no traceback
        print(f"error: {error}", file=sys.stderr)
        return 2
    except RunFailed as error:  # a rank lost at start-up, and no restart left
        print(f"error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as stop:  # while the ranks start: the rank group has stopped the ones it started
        return _stopped(stop)
    if initial is not None:  # before step 0: the run starts from the folder's weights
        from attnres_pp.train.init_from import load_initial

        load_initial(engine.model, initial)
    # The engine resolved device, dtype and kernels ("auto"); the summary records what ran.
    run_cfg = dataclasses.replace(run_cfg, train=engine.train_cfg)
    try:
        run_training(run_cfg, engine, out_dir, progress=not args.quiet, corpus=corpus, checkpoints=checkpoints,
                     tensorboard=args.tensorboard, startup_restarts=startup_restarts)
    except RunFailed as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except (CheckpointRefused, RunStopped) as error:  # a shard the driver could not see into; a full disk
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as stop:
        return _stopped(stop)
    finally:
        engine.close()
    return 0


def _silent(*args, **kwargs) -> None:
    """`--quiet`'s `say`: progress and notices unsaid."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, what `kill`, systemd, Slurm and `docker stop` send: the run stops as on Ctrl-C (every
    handler that cleans up after a KeyboardInterrupt runs), with exit code 143 (128 + SIGTERM)."""


@contextlib.contextmanager
def _sigterm_stops_the_run():
    """SIGTERM raises Terminated in the main thread while the run is under way (the previous handler
    is back afterwards). A second SIGTERM during the stop is ignored: the stop is already under way,
    and an exception raised inside the cleanup would cut it short."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise Terminated

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _stopped(stop: KeyboardInterrupt) -> int:
    """The one line and exit code of a run stopped by Ctrl-C (130) or SIGTERM (143); the caller's
    cleanup (`engine.close`, the rank group's) stops the ranks and removes their rendezvous folder."""
    terminated = isinstance(stop, Terminated)
    print(f"{'terminated (SIGTERM)' if terminated else 'interrupted'}: stopping the workers", file=sys.stderr)
    return 143 if terminated else 130
