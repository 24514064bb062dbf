"""`attnres-pp bench quality-depth`: quality at depth, where PreNorm dilution exists to be fixed.

A deep, narrow model (12 layers = 24 sublayers, d 48), trained with the same token budget per variant
and seed (single process, the shared training loop, one thread per run), then scored on ONE fixed
held-out set: the first `--eval-bytes` bytes (default 131,072) of the built-in corpus's validation
split, cut into consecutive windows, the same for every seed and variant. Seeds are paired: seed s
initialises and feeds every variant alike, so each variant's delta to the standard residual is taken
per seed, and the table gives the mean paired delta and how many seeds it beats standard on.

Variants: standard; Block AttnRes (N = 8 blocks, `blocks`, docs/spec.md section 1.2); S-LR-AttnRes (N = 8, r = 8);
Full AttnRes (S = 1, `--no-full` drops it); controls: AttnRes with one block over all sublayers (b_0
plus one running partial: should track standard) and MSAR with one block (its token mixing without
depth routing). The Block run of seed 0 is diagnosed as `attnres-pp analyze` does (model.routing):
its per-site routing table, a heatmap and its dilution curve against standard's.

    attnres-pp bench quality-depth                                        # about 30 min on 2 quiet cores
    attnres-pp bench quality-depth --steps 2 --eval-bytes 4096 --seeds 1  # smoke run
    attnres-pp bench quality-depth --moe-experts 8 --moe-top-k 2 --moe-shared-experts 1 \
        --moe-router sigmoid --moe-bias-gamma 0.001 --moe-router-lr-scale 0.03  # balance kept (docs/training.md)

With `--moe-experts E` (and the other `--moe-*` model flags) every variant's MLPs are MoE sublayers
(docs/spec.md section 12) and only standard and Block AttnRes run: the same experts under either
residual. Each run's balance is read from its metrics.jsonl (`moe_load_max_over_mean`, the worst
layer's max / mean tokens per expert of a step) after the first quarter of the run
(`quality_moe.balance_warmup`), and from the trained model's token-choices per expert over the whole
held-out set, counted while its loss is read (`quality_moe.ExpertChoices`); the results are named
quality_moe_<date>.

Writes quality_depth_<date>.{json,md} and quality_depth_<date>_{heatmap,dilution}.png (and, with
experts, quality_moe_<date>_experts.png: the Block run's expert loads beside its routing) under --out
(the older spelling --out-dir is taken too); run directories go to runs/STEM/ under the working directory
(runs/STEM_2/, ... when a run of the same day has it).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from attnres_pp.bench.common import results_stem as common_results_stem
from attnres_pp.bench.quality_moe import (
    MOE_FLAGS,
    ExpertChoices,
    balance_of_run,
    balance_warmup,
    held_out_balance,
    moe_markdown,
    moe_overrides,
)
from attnres_pp.model import ModelConfig
from attnres_pp.pipeline.config import PipelineConfig
from attnres_pp.train import RunConfig, TrainConfig, run_training
from attnres_pp.train.engines import make_engine

RUNS = Path("runs")  # the working directory's runs/ (a checkout's own, run from its root), beside benchmarks/
DEPTH_MODEL = dict(n_layers=12, d_model=48, n_heads=4, seq_len=64)
HELD_OUT_BATCH = 64  # windows per held-out forward (the per-batch balance reads one of these)
BLOCK_RUN = "Block AttnRes (N=8)"
VARIANTS = (
    ("standard", dict(residual="standard")),
    (BLOCK_RUN, dict(residual="attnres", blocks=8)),
    ("S-LR-AttnRes (N=8, r=8)", dict(residual="lr_attnres", key_mode="sliced", key_rank=8, blocks=8)),
    ("Full AttnRes (S=1)", dict(residual="attnres", block_size=1)),
    ("control: AttnRes, one block", dict(residual="attnres", blocks=1)),
    ("control: MSAR, one block", dict(residual="msar", blocks=1)),
)


def add_arguments(parser) -> None:
    parser.add_argument("--steps", type=int, default=400, help="steps per run (default 400)")
    parser.add_argument("--batch-size", type=int, default=32, help="sequences per step (default 32)")
    parser.add_argument("--seeds", type=int, default=3, help="paired seeds 0..N-1 (default 3)")
    parser.add_argument("--eval-bytes", type=int, default=131072, help="fixed held-out bytes (default 131072)")
    parser.add_argument("--no-full", action="store_true", help="leave Full AttnRes out (the slowest variant)")
    parser.add_argument("--jobs", type=int, default=2, help="trainings at once (one thread each)")
    for flag, field, _kind, help_text in MOE_FLAGS:
        parser.add_argument(flag, metavar=field.upper(),
                            help=f"{help_text}; with --moe-experts E > 0 only standard and Block AttnRes run")


def check(args) -> str | None:
    if min(args.steps, args.batch_size, args.seeds, args.jobs) < 1 or args.eval_bytes < DEPTH_MODEL["seq_len"]:
        return ("--steps, --batch-size, --seeds and --jobs must be >= 1, "
                f"--eval-bytes >= {DEPTH_MODEL['seq_len']}")
    try:
        moe_overrides(args, DEPTH_MODEL)
    except ValueError as error:
        return str(error)
    return None


def run_options(args) -> dict:
    return {"steps": args.steps, "batch_size": args.batch_size, "seeds": args.seeds, "eval_bytes": args.eval_bytes,
            "full": not args.no_full, "jobs": args.jobs, "moe": moe_overrides(args, DEPTH_MODEL)}


def results_stem(args) -> str:
    """quality_depth_<date>, or quality_moe_<date> with MoE sublayers."""
    return common_results_stem("quality_moe" if moe_overrides(args, DEPTH_MODEL) else "quality_depth", False)


def held_out_windows(eval_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The fixed held-out set: consecutive seq_len windows over the first `eval_bytes` validation bytes."""
    from attnres_pp.data import load_corpus

    seq_len = DEPTH_MODEL["seq_len"]
    tokens = torch.from_numpy(load_corpus("builtin").val_tokens_N[: eval_bytes + 1].astype("int64"))
    n = (len(tokens) - 1) // seq_len
    return tokens[: n * seq_len].view(n, seq_len), tokens[1: n * seq_len + 1].view(n, seq_len)


@torch.no_grad()
def held_out_loss(model, inputs_NT: torch.Tensor, targets_NT: torch.Tensor, probe=None) -> float:
    """Mean loss per byte over the fixed set (equal windows per batch but the last: weighted by tokens)."""
    from attnres_pp.model.routing import attach_probe

    model.eval()
    total, count = 0.0, 0
    for inputs, targets in zip(inputs_NT.split(HELD_OUT_BATCH), targets_NT.split(HELD_OUT_BATCH), strict=True):
        if probe is None:
            loss = float(model(inputs, targets))
        else:
            with attach_probe(model, probe):
                loss = float(model(inputs, targets))
        total, count = total + loss * inputs.numel(), count + inputs.numel()
    return total / count


def train_one(job: tuple) -> dict:
    """One training run and its fixed held-out score (and routing diagnostics when asked)."""
    name, overrides, steps, batch_size, seed, eval_bytes, diagnose, run_dir = job
    torch.set_num_threads(1)
    warmup_steps = min(30, steps // 10)
    run_cfg = RunConfig(
        model=ModelConfig(**{**DEPTH_MODEL, **overrides}),
        train=TrainConfig(steps=steps, batch_size=batch_size, seed=seed, warmup_steps=warmup_steps,
                          eval_every=0, eval_batches=1),
        pipeline=PipelineConfig(launcher="local"),
    )
    engine = make_engine(run_cfg, run_dir)
    try:
        summary = run_training(run_cfg, engine, run_dir, progress=False)
        probe = None
        if diagnose:
            from attnres_pp.model.routing import RoutingProbe

            probe = RoutingProbe(run_cfg.model)
        choices = ExpertChoices(engine.model) if run_cfg.model.moe else None
        with choices or contextlib.nullcontext():
            loss = held_out_loss(engine.model, *held_out_windows(eval_bytes), probe)
    finally:
        engine.close()
    print(f"  {name} seed {seed}: held-out {loss:.4f} in {summary['train_time_s']:.0f} s", file=sys.stderr,
          flush=True)
    return {"variant": name, "seed": seed, "held_out_loss": loss, "params": summary["params"],
            "train_time_s": summary["train_time_s"], "final_train_loss": summary["losses"][-1],
            "tokens_seen": summary["tokens_seen"], "model": run_cfg.model.to_dict(), "run_dir": run_dir,
            "sites": probe.summary() if probe is not None else None,
            "balance": ({**balance_of_run(run_dir, balance_warmup(steps), warmup_steps, summary),
                         **held_out_balance(choices)} if choices is not None else None)}


def fresh_runs_root(root: Path) -> Path:
    """`root`, or `root_2`, `root_3`, ... when it exists, made here (claimed before any run starts):
    two runs of the benchmark on one day (a smoke run beside the full one) must not write into each
    other's run directories."""
    candidate, index = root, 1
    while True:
        try:
            candidate.mkdir(parents=True)
            return candidate
        except FileExistsError:
            index += 1
            candidate = root.with_name(f"{root.name}_{index}")


def paired_rows(variants: list[str], runs: list[dict], seeds: int) -> list[dict]:
    """Per variant: mean held-out loss, per-seed deltas to standard (same seed), their mean, and the
    number of seeds on which the variant's loss is below standard's."""
    loss = {(r["variant"], r["seed"]): r["held_out_loss"] for r in runs}
    rows = []
    for name in variants:
        deltas = [loss[name, s] - loss["standard", s] for s in range(seeds)]
        mine = [r for r in runs if r["variant"] == name]
        rows.append({"variant": name, "held_out_loss": statistics.mean(loss[name, s] for s in range(seeds)),
                     "deltas": deltas, "mean_delta": statistics.mean(deltas),
                     "better_on": sum(d < 0 for d in deltas), "params": mine[0]["params"],
                     "train_time_s": statistics.mean(r["train_time_s"] for r in mine)})
    return rows


def run(quick: bool, out_dir: Path, progress: Callable[[str], None], *, steps: int = 400, batch_size: int = 32,
        seeds: int = 3, eval_bytes: int = 131072, full: bool = True, jobs: int = 2, moe: dict | None = None) -> dict:
    """Train and score every variant at every seed; the two PNGs go beside the result files, named
    after them (`out_dir` is the folder STEM/ beside them: its parent and name). `moe`: the MoE
    fields of every variant's ModelConfig (then standard and Block AttnRes only)."""
    del quick  # no short version: the smoke run is a small --steps and --eval-bytes
    tag = out_dir.name
    variants = [(n, o) for n, o in VARIANTS if full or not n.startswith("Full")]
    if moe:
        variants = [(n, {**o, **moe}) for n, o in variants if n in ("standard", BLOCK_RUN)]
    runs_root = fresh_runs_root(RUNS / tag)
    jobs_list = [(name, overrides, steps, batch_size, seed, eval_bytes,
                  name in (BLOCK_RUN, "standard") and seed == 0, str(runs_root / f"{index}_seed{seed}"))
                 for index, (name, overrides) in enumerate(variants) for seed in range(seeds)]
    jobs_list.sort(key=lambda job: (job[1].get("block_size") != 1, job[1]["residual"] != "msar"))  # slowest first
    progress(f"{len(jobs_list)} runs of {steps} steps, {jobs} at a time")
    start, load_start = time.perf_counter(), os.getloadavg()
    with multiprocessing.get_context("spawn").Pool(jobs, maxtasksperchild=1) as pool:
        runs = pool.map(train_one, jobs_list, chunksize=1)
    rows = paired_rows([n for n, _ in variants], runs, seeds)
    block_sites = next(r["sites"] for r in runs if r["variant"] == BLOCK_RUN and r["seed"] == 0)
    standard_sites = next(r["sites"] for r in runs if r["variant"] == "standard" and r["seed"] == 0)
    from attnres_pp.analysis import figures

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    shape = "12 layers, d 48" + (f", MoE E={moe['moe_experts']}" if moe else "")
    pngs = [figures.heatmap_png(block_sites, 1, out_dir.parent / f"{tag}_heatmap.png",
                                f"{BLOCK_RUN}, {shape}, seed 0: mean depth-attention weights"),
            figures.dilution_png(block_sites, standard_sites, out_dir.parent / f"{tag}_dilution.png",
                                 f"{BLOCK_RUN} vs standard (dashed), seed 0")]
    if moe:  # the Block run's expert loads beside its depth routing, as `attnres-pp analyze` draws them
        from attnres_pp.analysis.experts import expert_loads, experts_png

        block_dir = next(r["run_dir"] for r in runs if r["variant"] == BLOCK_RUN and r["seed"] == 0)
        pngs.append(experts_png(expert_loads(block_dir), block_sites, out_dir.parent / f"{tag}_experts.png",
                                f"{BLOCK_RUN}, {shape}, seed 0: expert loads beside the depth routing"))
    return {
        "date": time.strftime("%Y-%m-%d"),
        "wall_time_s": time.perf_counter() - start,
        "budget": {"steps": steps, "batch_size": batch_size, "seq_len": DEPTH_MODEL["seq_len"],
                   "tokens_per_run": runs[0]["tokens_seen"], "seeds": seeds,
                   "held_out_bytes": held_out_windows(eval_bytes)[0].numel(),
                   "held_out_batch_windows": HELD_OUT_BATCH},
        "model": DEPTH_MODEL,
        "moe": runs[0]["model"] if moe else None,
        "balance": [{"variant": r["variant"], "seed": r["seed"], **r["balance"]} for r in runs] if moe else None,
        "environment": {"python": platform.python_version(), "torch": torch.__version__, "jobs": jobs,
                        "threads_per_run": 1, "load_average_start_end": [load_start[0], os.getloadavg()[0]]},
        "rows": rows, "block_run_sites": block_sites, "standard_sites": standard_sites,
        "pngs": [str(p) for p in pngs], "runs": [{k: v for k, v in r.items() if k != "sites"} for r in runs],
    }


def _load(environment: dict) -> str:
    load = environment.get("load_average_start_end")
    return "" if load is None else f", load average {load[0]:.1f} at the start and {load[1]:.1f} at the end"


def to_markdown(result: dict) -> str:
    budget, seeds = result["budget"], result["budget"]["seeds"]
    lines = [
        f"# Quality at depth{' with experts' if result.get('moe') else ''}: held-out loss at an equal token "
        f"budget ({result['date']})", "",
        f"12 layers (24 sublayers), d 48, seq 64; {budget['tokens_per_run']:,} training tokens per run "
        f"({budget['steps']} steps x {budget['batch_size']} x {budget['seq_len']}), built-in corpus; loss in nats "
        f"per byte on one fixed held-out set of {budget['held_out_bytes']:,} bytes (the same for every seed). "
        f"{seeds} paired seeds: delta = variant - standard at the same seed; 'better' counts the seeds where "
        f"the variant's loss is lower. {result['environment']['jobs']} runs at a time, 1 thread each; "
        f"wall time {result['wall_time_s'] / 60:.1f} min{_load(result['environment'])}.", "",
        "| variant | held-out loss | mean paired delta | per-seed deltas | better on | params | train time (s) |",
        "|---|---:|---:|---|---:|---:|---:|",
    ]
    for row in result["rows"]:
        deltas = ", ".join(f"{d:+.4f}" for d in row["deltas"])
        lines.append(f"| {row['variant']} | {row['held_out_loss']:.4f} | {row['mean_delta']:+.4f} | {deltas} | "
                     f"{row['better_on']}/{seeds} | {row['params']:,} | {row['train_time_s']:.0f} |")
    lines += moe_markdown(result)
    lines += ["", f"Routing of the {BLOCK_RUN} run, seed 0, on the held-out set (as `attnres-pp analyze`):", "",
              "| site | sources | entropy | effective sources | top-1 mass | embedding weight | input RMS |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for site in result["block_run_sites"]:
        lines.append(f"| {site['site']} ({site['kind']}) | {len(site['sources'])} | {site['entropy']:.3f} | "
                     f"{site['effective_sources']:.2f} | {site['top1_mass']:.3f} | {site['embedding_weight']:.3f} | "
                     f"{site['input_rms']:.3f} |")
    return "\n".join(lines)
