"""`attnres-pp bench quality`: train every residual variant with the same token budget on the
built-in corpus (single process, the shared training loop) and tabulate validation loss and parameters.

    attnres-pp bench quality                 # the default budget (TrainConfig defaults), ~5 min
    attnres-pp bench quality --quick         # a smoke run of a few steps
    attnres-pp bench quality --seeds 2       # mean over seeds 0..1

Writes quality_<date>.json and .md (`_quick` with --quick, `_partial` with --only) under --out (the
older spelling --out-dir is taken too); run directories go to runs/quality_<date>/ under the working
directory.
Runs `--jobs` trainings at once, one torch thread each. The deep, narrow benchmark with paired seeds
is `attnres-pp bench quality-depth`.
"""

from __future__ import annotations

import multiprocessing
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from attnres_pp.bench.common import results_stem as common_results_stem
from attnres_pp.model import ModelConfig
from attnres_pp.pipeline.config import PipelineConfig
from attnres_pp.train import RunConfig, TrainConfig, run_training
from attnres_pp.train.engines import make_engine

RUNS = Path("runs")  # the working directory's runs/ (a checkout's own, run from its root), beside benchmarks/
QUICK_STEPS = 40
# 16 x 32 x 64 = 32,768 validation tokens, evaluated once at the end: 4x the training default,
# because the differences between variants are a few hundredths of a nat.
EVAL_BATCHES = 16

# (name, ModelConfig overrides) in the order of the table; the model size is ModelConfig's default.
VARIANTS = (
    ("standard", dict(residual="standard")),
    ("Full AttnRes (S=1)", dict(residual="attnres", block_size=1)),
    ("Block AttnRes (S=2)", dict(residual="attnres", block_size=2)),
    ("P-LR-AttnRes (S=2, r=8)", dict(residual="lr_attnres", block_size=2, key_mode="projected", key_rank=8)),
    ("S-LR-AttnRes (S=2, r=8)", dict(residual="lr_attnres", block_size=2, key_mode="sliced", key_rank=8)),
    ("MSAR (S=2, m=4)", dict(residual="msar", block_size=2)),
)


def add_arguments(parser) -> None:
    parser.add_argument("--steps", type=int, default=TrainConfig().steps, help="steps per run (same for all)")
    parser.add_argument("--seeds", type=int, default=1, help="seeds per variant (0..N-1); the table shows the mean")
    parser.add_argument("--only", default=None, metavar="NAMES",
                        help="comma-separated variant name prefixes to run (e.g. 'P-LR'); standard always runs, "
                             "as the baseline of the 'vs standard' column")
    parser.add_argument("--jobs", type=int, default=2, help="trainings at once (one thread each)")


def check(args) -> str | None:
    if args.steps < 1 or args.seeds < 1 or args.jobs < 1:
        return "--steps, --seeds and --jobs must be >= 1"
    if args.only and len(_variants(args.only)) == 1:
        known = ", ".join(name for name, _ in VARIANTS)
        return f"--only {args.only!r} matches no variant; names start with: {known}"
    return None


def run_options(args) -> dict:
    return {"steps": QUICK_STEPS if args.quick else args.steps, "seeds": args.seeds, "only": args.only,
            "jobs": args.jobs}


def results_stem(args) -> str:
    """quality_<date>[_quick][_partial]: the tags follow the date in this benchmark's file names."""
    return common_results_stem("quality", False, ("_quick" if args.quick else "") + ("_partial" if args.only else ""))


def _variants(only: str | None) -> list[tuple[str, dict]]:
    prefixes = [part.strip() for part in only.split(",")] if only else None
    return [(name, overrides) for name, overrides in VARIANTS
            if prefixes is None or name == "standard" or any(name.startswith(p) for p in prefixes)]


def train_one(job: tuple[str, dict, int, int, str]) -> dict:
    """One training run in a worker process; returns the row's numbers."""
    name, model_overrides, steps, seed, run_dir = job
    run_cfg = RunConfig(
        model=ModelConfig(**model_overrides),
        train=TrainConfig(steps=steps, seed=seed, warmup_steps=min(TrainConfig().warmup_steps, steps // 10),
                          eval_every=0, eval_batches=EVAL_BATCHES),
        pipeline=PipelineConfig(launcher="local"),
    )
    engine = make_engine(run_cfg, run_dir)
    try:
        summary = run_training(run_cfg, engine, run_dir, progress=False)
    finally:
        engine.close()
    print(f"  {name} seed {seed}: val {summary['val_loss']:.4f} in {summary['train_time_s']:.0f} s", file=sys.stderr,
          flush=True)
    return {"variant": name, "seed": seed, "val_loss": summary["val_loss"], "params": summary["params"],
            "train_time_s": summary["train_time_s"], "final_train_loss": summary["losses"][-1],
            "tokens_seen": summary["tokens_seen"], "model": run_cfg.model.to_dict(), "run_dir": run_dir}


def run(quick: bool, out_dir: Path, progress: Callable[[str], None], *, steps: int = TrainConfig().steps,
        seeds: int = 1, only: str | None = None, jobs: int = 2) -> dict:
    """Train every variant (of `only`) for `steps` at `seeds` seeds, `jobs` at a time; run directories
    go to the checkout's runs/STEM/ (`out_dir`'s name is the results stem)."""
    del quick  # its budget arrives as `steps`
    variants = _variants(only)
    runs_root = RUNS / out_dir.name
    jobs_list = [(name, overrides, steps, seed, str(runs_root / f"{index}_seed{seed}"))
                 for index, (name, overrides) in enumerate(variants) for seed in range(seeds)]
    jobs_list.sort(key=lambda job: job[1]["residual"] != "msar")  # the slowest first packs the workers best
    progress(f"{len(jobs_list)} runs of {steps} steps, {jobs} at a time")
    start = time.perf_counter()
    with multiprocessing.get_context("spawn").Pool(jobs, maxtasksperchild=1) as pool:
        runs = pool.map(train_one, jobs_list, chunksize=1)
    rows = [_row(name, [run for run in runs if run["variant"] == name]) for name, _ in variants]
    baseline = rows[0]["val_loss"]
    for row in rows:
        row["delta_vs_standard"] = row["val_loss"] - baseline
    train_cfg = TrainConfig(steps=steps)
    return {
        "date": time.strftime("%Y-%m-%d"),
        "wall_time_s": time.perf_counter() - start,
        "budget": {"steps": steps, "batch_size": train_cfg.batch_size, "seq_len": ModelConfig().seq_len,
                   "tokens_per_run": runs[0]["tokens_seen"], "seeds": seeds, "data": train_cfg.data,
                   "val_tokens": EVAL_BATCHES * train_cfg.batch_size * ModelConfig().seq_len},
        "environment": {"python": platform.python_version(), "torch": torch.__version__,
                        "machine": platform.machine(), "jobs": jobs, "threads_per_run": train_cfg.threads},
        "rows": rows,
        "runs": runs,
    }


def _row(name: str, runs: list[dict]) -> dict:
    losses = [run["val_loss"] for run in runs]
    return {"variant": name, "val_loss": statistics.mean(losses),
            "val_loss_spread": max(losses) - min(losses), "params": runs[0]["params"],
            "train_time_s": statistics.mean(run["train_time_s"] for run in runs)}


def to_markdown(result: dict) -> str:
    budget = result["budget"]
    lines = [
        f"# Quality: validation loss at an equal token budget ({result['date']})",
        "",
        f"{budget['tokens_per_run']:,} training tokens per run ({budget['steps']} steps x {budget['batch_size']} "
        f"x {budget['seq_len']}), built-in corpus, mean over {budget['seeds']} seed(s) (± half the range); "
        f"validation loss in nats per byte on {budget['val_tokens']:,} held-out bytes (drawn by seed). "
        f"{result['environment']['jobs']} runs at a time, 1 thread each; times include any load from "
        "other processes on the machine.",
        "",
        "| variant | val loss | vs standard | params | train time (s) |",
        "|---|---:|---:|---:|---:|",
    ]
    for row in result["rows"]:
        spread = f" ± {row['val_loss_spread'] / 2:.4f}" if budget["seeds"] > 1 else ""
        lines.append(f"| {row['variant']} | {row['val_loss']:.4f}{spread} | {row['delta_vs_standard']:+.4f} | "
                     f"{row['params']:,} | {row['train_time_s']:.0f} |")
    return "\n".join(lines)
