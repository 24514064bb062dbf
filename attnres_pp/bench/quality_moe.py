"""What `attnres-pp bench quality-depth --moe-experts E ...` adds to the quality benchmark: the MoE
model flags (the `--moe-*` entries of `model_flags.MODEL_FLAGS`, one name and meaning with `train`),
each run's expert balance read back from its metrics.jsonl, and the balance table.

Balance is the step metric `moe_load_max_over_mean` (the worst MoE layer's max / mean tokens per
expert in that step), taken over the steps after the balance warm-up (the first quarter of the run:
the router collapses onto a few experts in the first steps at this learning rate and the aux-free
bias, moving `gamma` a step, takes tens of steps to undo it): its largest and median value, and the
number of those steps at or above `BALANCE_BOUND`; the largest value after the learning-rate
warm-up alone is kept beside it.

That per-step figure reads a 2,048-token batch, whose own sampling noise puts the worst of 12 layers
near 1.44 at its 95th percentile even with the router held fixed. The held-out reading is the router's
balance as the aux-loss-free balancing paper measures it (MaxVio_global): the trained model's
token-choices per expert of every MoE layer over the whole fixed held-out set (`ExpertChoices`, counted
while the held-out loss is read), its worst layer's max / mean against `BALANCE_BOUND`, and per
held-out batch (64 windows) the worst layer's max / mean.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from attnres_pp.cli_flags import convert_flag
from attnres_pp.model import ModelConfig
from attnres_pp.model.moe import moe_sublayers
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


class ExpertChoices:
    """While entered: each forward of `model` adds a row `[layers, E]` (float64) to `batches_BLE`, the
    token-choices per expert that every MoE sublayer's routed experts received in that forward.

    Counted at the routed experts' input (the choices the forward used), not by `MoE.load_E`: the
    engine's counters take training forwards only, and the held-out loss is read under eval and
    no_grad."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.moes = moe_sublayers(model)
        self.layers = [name.split(".")[1] for name in self.moes]  # `layers.<i>.mlp` -> "i"
        self.batches_BLE: list[torch.Tensor] = []
        self._handles = []

    def _start(self, _module, _args) -> None:
        experts = max(m.cfg.moe_experts for m in self.moes.values())
        self.batches_BLE.append(torch.zeros(len(self.moes), experts, dtype=torch.float64))

    def _counter(self, index: int):
        def count(_module, args) -> None:
            expert_NK = args[1]
            self.batches_BLE[-1][index] += torch.bincount(
                expert_NK.flatten().cpu(), minlength=self.batches_BLE[-1].shape[1]).to(torch.float64)
        return count

    def __enter__(self) -> ExpertChoices:
        self._handles = [self.model.register_forward_pre_hook(self._start)]
        self._handles += [moe.experts.register_forward_pre_hook(self._counter(index))
                          for index, moe in enumerate(self.moes.values())]
        return self

    def __exit__(self, *_exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _max_over_mean_L(loads_LE: torch.Tensor) -> torch.Tensor:
    return loads_LE.max(-1).values / loads_LE.mean(-1).clamp_min(1e-12)


def held_out_balance(choices: ExpertChoices) -> dict:
    """The held-out balance of one trained model: tokens per expert of every MoE layer over the whole
    set, each layer's max / mean of them (the worst layer's, and their mean over layers), and per
    held-out batch the worst layer's max / mean (its median and largest value over the batches)."""
    if not choices.batches_BLE:
        raise ValueError("no held-out forward was counted: enter ExpertChoices around held_out_loss")
    loads_BLE = torch.stack(choices.batches_BLE)
    total_LE = loads_BLE.sum(0)
    global_L = _max_over_mean_L(total_LE)
    batch_worst_B = _max_over_mean_L(loads_BLE).max(-1).values.tolist()
    return {"held_out_batches": len(batch_worst_B),
            "held_out_loads": {layer: total_LE[i].tolist() for i, layer in enumerate(choices.layers)},
            "held_out_max_over_mean": {layer: float(global_L[i]) for i, layer in enumerate(choices.layers)},
            "held_out_worst": float(global_L.max()), "held_out_layer_mean": float(global_L.mean()),
            "held_out_batch_worst_median": statistics.median(batch_worst_B),
            "held_out_batch_worst_max": max(batch_worst_B)}


def kept_held_out(row: dict) -> str:
    """'yes' when the worst layer's max / mean over the whole held-out set is under the bound."""
    return "yes" if row["held_out_worst"] < BALANCE_BOUND else "no"


def kept(row: dict) -> str:
    """'yes' when the worst layer's 95th percentile after warm-up is under the bound."""
    return "yes" if row["max_over_mean_p95"] < BALANCE_BOUND else "no"


def _seq_aux(cfg: dict) -> str:
    """The balance options beside the rule, where they are on."""
    coef, scale = cfg.get("moe_seq_aux_coef", 0.0), cfg.get("moe_router_lr_scale", 1.0)
    return ((f", the sequence-wise balance loss at {coef:g}" if coef else "")
            + (f", the routers trained at {scale:g} x the learning rate" if scale != 1.0 else ""))


def _tokens(result: dict, key: str) -> str:
    """'W x T = N' tokens: budget[key] windows of the run's sequence length ('its' where not recorded)."""
    windows, seq_len = result.get("budget", {}).get(key), result.get("budget", {}).get("seq_len")
    return "its" if windows is None or seq_len is None else f"{windows} x {seq_len} = {windows * seq_len:,}"


def _held_out_size(result: dict) -> str:
    held_out_bytes = result.get("budget", {}).get("held_out_bytes")
    return "its" if held_out_bytes is None else f"{held_out_bytes:,} bytes"


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
             "Balance, held out: the trained model's token-choices per expert of every MoE layer over the "
             f"whole held-out set ({_held_out_size(result)}, the set the loss is read on), each layer's max over "
             "experts / mean; 'worst layer' is the largest of the layers', 'mean over layers' their mean; 'per "
             f"batch': the worst layer's max / mean in each held-out batch of "
             f"{_tokens(result, 'held_out_batch_windows')} tokens, its "
             f"median and largest value over the batches. 'Kept, held out': the worst layer under {BALANCE_BOUND} "
             "over the whole set (the router's balance as the aux-loss-free balancing paper's MaxVio_global "
             "reads it).", "",
             "Balance, per step: each MoE layer's max over experts / mean of the token-choices it received "
             f"in that step (`moe_load_max_over_mean/<layer>` of metrics.jsonl, one batch of "
             f"{_tokens(result, 'batch_size')} tokens), "
             "over the steps after the balance warm-up (the first quarter of the run). 'Worst layer': the "
             "largest of the layers' values in a step (`moe_load_max_over_mean`); 'mean over layers': their "
             "mean in a step; each summarised by its median, 95th percentile (linear interpolation) and "
             f"largest value over those steps. 'Kept, per step': the worst layer's 95th percentile is under "
             f"{BALANCE_BOUND}. The last column is the worst layer's largest value after the learning-rate "
             "warm-up alone (the early collapse and its recovery included).", "",
             "| variant | seed | held out: worst layer | mean over layers | per batch: median | max | kept, held "
             "out | per step: steps after warm-up | worst layer: median | p95 | max | steps >= "
             f"{BALANCE_BOUND} | mean over layers: median | p95 | kept, per step | max after lr warm-up |",
             "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for row in sorted(result["balance"], key=lambda r: (r["variant"] != "standard", r["variant"], r["seed"])):
        lines.append(f"| {row['variant']} | {row['seed']} | {row['held_out_worst']:.3f} | "
                     f"{row['held_out_layer_mean']:.3f} | {row['held_out_batch_worst_median']:.3f} | "
                     f"{row['held_out_batch_worst_max']:.3f} | {kept_held_out(row)} | "
                     f"{row['steps_after_warmup']} | "
                     f"{row['max_over_mean_median']:.3f} | {row['max_over_mean_p95']:.3f} | "
                     f"{row['max_over_mean_max']:.3f} | {row['steps_at_or_over_bound']} | "
                     f"{row['layer_mean_median']:.3f} | {row['layer_mean_p95']:.3f} | {kept(row)} | "
                     f"{row['max_over_mean_max_after_lr_warmup']:.3f} |")
    return lines
