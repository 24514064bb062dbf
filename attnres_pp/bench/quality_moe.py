"""What `attnres-pp bench quality-depth --moe-experts E ...` adds to the quality benchmark: the MoE
model flags (the `--moe-*` entries of `model_flags.MODEL_FLAGS`, one name and meaning with `train`),
each run's expert balance read back from its metrics.jsonl, and the balance table.

Balance is the step metric `moe_load_max_over_mean` (the worst MoE layer's max / mean tokens per
expert in that step), taken over the steps after the balance warm-up (the first quarter of the run:
the router collapses onto a few experts in the first steps at this learning rate and the aux-free
bias, moving `gamma` a step, takes tens of steps to undo it): its largest and median value, and the
number of those steps at or above `BALANCE_BOUND`; the largest value after the learning-rate
warm-up alone is kept beside it.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from attnres_pp.cli_flags import convert_flag
from attnres_pp.model import ModelConfig
from attnres_pp.model_flags import MODEL_FLAGS

MOE_FLAGS = tuple(entry for entry in MODEL_FLAGS if entry[0].startswith("--moe-"))
BALANCE_BOUND = 1.5  # issue 50's quality run: max / mean load under this after warm-up


def balance_warmup(steps: int) -> int:
    """The steps left out of the balance figures: the first quarter of the run."""
    return steps // 4


def moe_overrides(args: argparse.Namespace, base: dict) -> dict:
    """{ModelConfig field: value} of the `--moe-*` flags given ({} without --moe-experts or with 0);
    ValueError naming the flag to fix, checked on `base`'s model as the runs will build it."""
    overrides = {field: convert_flag(flag, raw, kind) for flag, field, kind, _help in MOE_FLAGS
                 if (raw := getattr(args, flag[2:].replace("-", "_"), None)) is not None}
    if not overrides:
        return {}
    if not overrides.get("moe_experts"):
        given = " ".join(flag for flag, field, *_ in MOE_FLAGS if field in overrides)
        raise ValueError(f"{given} needs --moe-experts E >= 1 (the routed experts per layer): give it, or drop "
                         "the --moe-* flags for the dense benchmark")
    if overrides.get("moe_d_ff") == 0:
        raise ValueError("--moe-d-ff 0 is invalid: each expert needs a hidden width >= 1; leave the flag out for "
                         "the default (d_ff / 4 rounded up to 64)")
    ModelConfig.from_dict({**base, **overrides})  # ValueError naming the field and its flag
    return overrides


def percentile(values: list[float], q: float) -> float:
    """The q-quantile of `values` by linear interpolation between order statistics (numpy's default)."""
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def balance_of_run(run_dir: str | Path, warmup_steps: int, lr_warmup_steps: int, summary: dict) -> dict:
    """The run's balance after `warmup_steps` (steps counted from 0) from RUN/metrics.jsonl, the
    largest max / mean after `lr_warmup_steps`, and the last step's tokens per expert of every MoE
    layer (summary.json's `moe_expert_loads`)."""
    records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
               if line.strip()]
    after_lr = [r["moe_load_max_over_mean"] for r in records
                if r["step"] >= lr_warmup_steps and "moe_load_max_over_mean" in r]
    after = [r for r in records if r["step"] >= warmup_steps and "moe_load_max_over_mean" in r]
    if not after:
        raise ValueError(f"{run_dir}/metrics.jsonl has no moe_load_max_over_mean after step {warmup_steps}")
    worst = [r["moe_load_max_over_mean"] for r in after]
    layers = sorted({key.split("/", 1)[1] for r in after for key in r if key.startswith("moe_load_max_over_mean/")},
                    key=int)
    layer_mean = [statistics.mean(r[f"moe_load_max_over_mean/{layer}"] for layer in layers) for r in after]
    return {"warmup_steps": warmup_steps, "steps_after_warmup": len(after), "lr_warmup_steps": lr_warmup_steps,
            "max_over_mean_max_after_lr_warmup": max(after_lr),
            "max_over_mean_max": max(worst), "max_over_mean_median": statistics.median(worst),
            "max_over_mean_p95": percentile(worst, 0.95),
            "layer_mean_median": statistics.median(layer_mean), "layer_mean_p95": percentile(layer_mean, 0.95),
            "steps_at_or_over_bound": sum(v >= BALANCE_BOUND for v in worst),
            "per_layer_max": {layer: max(r[f"moe_load_max_over_mean/{layer}"] for r in after) for layer in layers},
            "last_step_loads": summary.get("moe_expert_loads", {})}


def kept(row: dict) -> str:
    """'yes' when the worst layer's 95th percentile after warm-up is under the bound."""
    return "yes" if row["max_over_mean_p95"] < BALANCE_BOUND else "no"


def _seq_aux(cfg: dict) -> str:
    """The balance options beside the rule, where they are on."""
    coef, scale = cfg.get("moe_seq_aux_coef", 0.0), cfg.get("moe_router_lr_scale", 1.0)
    return ((f", the sequence-wise balance loss at {coef:g}" if coef else "")
            + (f", the routers trained at {scale:g} x the learning rate" if scale != 1.0 else ""))


def moe_markdown(result: dict) -> list[str]:
    """The MoE lines of the quality table: the experts' configuration and each run's balance."""
    cfg = result.get("moe")
    if not cfg:
        return []
    lines = ["", f"Every MLP is an MoE sublayer (from layer {cfg['moe_dense_layers']} on): E = {cfg['moe_experts']} "
                 f"routed experts, top K = {cfg['moe_top_k']}, S = {cfg['moe_shared_experts']} shared, expert width "
                 f"{ModelConfig.from_dict(cfg).expert_dim}, {cfg['moe_router']} router, {cfg['moe_balance']} "
                 f"balancing (gamma {cfg['moe_bias_gamma']:g}){_seq_aux(cfg)}; the same experts under both "
                 "residuals.", "",
             "Balance, per step: each MoE layer's max over experts / mean of the token-choices it received "
             "in that step (`moe_load_max_over_mean/<layer>` of metrics.jsonl), over the steps after the "
             "balance warm-up (the first quarter of the run). 'Worst layer': the largest of the layers' "
             "values in a step (`moe_load_max_over_mean`); 'mean over layers': their mean in a step; each "
             f"summarised by its median, 95th percentile (linear interpolation) and largest value over those "
             f"steps. 'Kept': the worst layer's 95th percentile is under {BALANCE_BOUND}. The last column "
             "is the worst layer's largest value after the learning-rate warm-up alone (the early collapse "
             "and its recovery included).", "",
             "| variant | seed | steps after warm-up | worst layer: median | p95 | max | steps >= "
             f"{BALANCE_BOUND} | mean over layers: median | p95 | kept | max after lr warm-up |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for row in sorted(result["balance"], key=lambda r: (r["variant"] != "standard", r["variant"], r["seed"])):
        lines.append(f"| {row['variant']} | {row['seed']} | {row['steps_after_warmup']} | "
                     f"{row['max_over_mean_median']:.3f} | {row['max_over_mean_p95']:.3f} | "
                     f"{row['max_over_mean_max']:.3f} | {row['steps_at_or_over_bound']} | "
                     f"{row['layer_mean_median']:.3f} | {row['layer_mean_p95']:.3f} | {kept(row)} | "
                     f"{row['max_over_mean_max_after_lr_warmup']:.3f} |")
    return lines
