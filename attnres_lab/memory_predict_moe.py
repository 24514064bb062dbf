"""`attnres-lab memory-predict --moe`: `simulate memory` against real runs of mixtures of experts
with expert parallelism (docs/spec.md section 12), out of sample like every `memory_predict` case
(the activation units are fitted on dense tiny chunks; no MoE term is fitted at all).

Each case is an 8-layer d = 64 model whose first layer is dense and whose 7 others are MoE layers,
D = 2 replicas, cache on, run for 2 steps under `--launcher inprocess` (thread ranks, each EP group
meeting in real all-to-alls; `local` too for `LOCAL_CASES`) and compared rank by rank with
`memory_per_rank`. EP = 2 cases sit beside the same case at EP = 1.

The prediction assumes balanced routing: each EP rank's experts receive M = N K rows a microbatch.
A real router is not balanced, so each EP > 1 row also gives, per rank, its experts' share of the
step's token-choices (`moe_expert_loads` of summary.json, the last step, summed over the EP group)
times EP: the rows the rank received over M. The `K = E` cases route every token to every expert,
so every rank receives exactly M rows: their errors are the model's alone.
"""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable
from pathlib import Path

from attnres_lab.memory_predict import (
    ALL_LAUNCHERS,
    EXACT_KEYS,
    case_flags,
    fitted_count,
    fitted_overlap,
    measure_case,
    predict,
)
from attnres_pp.bench.common import markdown_table

MOE = {"moe_experts": 8, "moe_top_k": 2, "moe_shared_experts": 1, "moe_d_ff": 64, "moe_dense_layers": 1,
       "residual": "attnres", "block_size": 2, "seq_len": 64, "data_parallel": 2}
P1 = {**MOE, "schedule": "1f1b", "stages": 1, "microbatches": 2, "batch_size": 8}
P2 = {**MOE, "schedule": "1f1b", "stages": 2, "microbatches": 4, "batch_size": 16}
BALANCED = {"moe_experts": 4, "moe_top_k": 4}  # every token to every expert: M rows on each EP rank
CASES = (
    ("MoE EP=1 D=2 P=1", {**P1, "expert_parallel": 1}),
    ("MoE EP=2 D=2 P=1", {**P1, "expert_parallel": 2}),
    ("MoE EP=1 D=2 P=2", {**P2, "expert_parallel": 1}),
    ("MoE EP=2 D=2 P=2", {**P2, "expert_parallel": 2}),
    ("MoE EP=1 D=2 P=2 AC full", {**P2, "expert_parallel": 1, "activation_checkpoint": "full"}),
    ("MoE EP=2 D=2 P=2 AC full", {**P2, "expert_parallel": 2, "activation_checkpoint": "full"}),
    # The split backward: the routed experts' grouped products wait in the W store on their rows.
    ("MoE EP=2 D=2 P=2 zb_h1", {**P2, "expert_parallel": 2, "schedule": "zb_h1"}),
    ("MoE EP=1 D=2 P=2 K=E balanced", {**P2, **BALANCED, "expert_parallel": 1}),
    ("MoE EP=2 D=2 P=2 K=E balanced", {**P2, **BALANCED, "expert_parallel": 2}),
    ("MoE EP=2 D=2 P=2 K=E balanced AC full", {**P2, **BALANCED, "expert_parallel": 2,
                                                "activation_checkpoint": "full"}),
    ("MoE EP=2 D=2 P=2 K=E balanced zb_h1", {**P2, **BALANCED, "expert_parallel": 2, "schedule": "zb_h1"}),
)
QUICK = (CASES[1],)
LOCAL_CASES = ("MoE EP=2 D=2 P=2", "MoE EP=2 D=2 P=2 AC full")


def rows_over_m(flags: dict, loads: dict[str, list[float]] | None) -> list[dict | None]:
    """Per global rank (dp x P + pp): its experts' share of the last step's token-choices times EP
    (1.0 = the M rows the prediction assumes), the mean and the largest over its stage's MoE
    layers; None at EP = 1."""
    ep, stages, replicas = flags.get("expert_parallel", 1), flags["stages"], flags["data_parallel"]
    if ep == 1 or not loads:
        return [None] * (stages * replicas)
    per_stage = flags["layers"] // stages
    shares = []
    for dp in range(replicas):
        for pp in range(stages):
            layers = [load for layer, load in loads.items() if int(layer) // per_stage == pp]
            first = (dp % ep) * (len(layers[0]) // ep)
            mine = [ep * sum(load[first:first + len(load) // ep]) / sum(load) for load in layers]
            shares.append({"mean": statistics.fmean(mine), "max": max(mine)})
    return shares


def predict_at_rows(flags: dict, launcher: str, shares: list[dict | None]) -> list[int] | None:
    """What-if: each rank's activation peak predicted with its experts receiving its counted share of
    rows (`simulator.moe`'s `rows_factor`: the mean over its layers; under full checkpointing, whose
    backward recomputes one layer at a time, the largest), not the balanced M. A diagnosis of the
    balanced prediction's error, not a prediction: the shares are read off the run."""
    from unittest import mock

    from attnres_pp.simulator import memory_activation, moe

    if any(s is None for s in shares):
        return None
    key = "max" if flags.get("activation_checkpoint", "none") == "full" else "mean"
    peaks = []
    for rank, share in enumerate(shares):
        # A share below 1 is no --moe-load-factor (the knob prices the most-loaded rank): the terms are
        # patched to take it whatever factor the walk passes.
        patched = {name: functools.partial(_at_rows, getattr(moe, name), share[key])
                   for name in ("moe_saved_bytes", "moe_store_correction", "moe_weight_store_bytes")}
        with mock.patch.multiple(memory_activation, **patched):
            peaks.append(predict(flags, launcher)["memory_per_rank"][rank]["activation_peak_bytes"])
    return peaks


def _at_rows(term: Callable, share: float, /, *args, **kwargs):
    return term(*args, **{**kwargs, "rows_factor": share})


def load_factor(flags: dict, shares: list[dict | None]) -> float | None:
    """`simulate memory --moe-load-factor` as a user reads it off a run: the most-loaded EP rank's
    rows over the balanced M, the largest over the ranks of each rank's share (the mean over its MoE
    layers; under full checkpointing, whose backward recomputes one layer at a time, the largest)."""
    if any(s is None for s in shares):
        return None
    key = "max" if flags.get("activation_checkpoint", "none") == "full" else "mean"
    return max(1.0, max(s[key] for s in shares))


def predict_at_factor(flags: dict, launcher: str, factor: float | None) -> list[int] | None:
    """Each rank's activation peak from `simulate memory --moe-load-factor factor` (one F for the run:
    every rank priced as the most-loaded one)."""
    if factor is None:
        return None
    report = predict({**flags, "moe_load_factor": round(factor, 4)}, launcher)
    return [r["activation_peak_bytes"] for r in report["memory_per_rank"]]


def most_loaded_errors(row: dict) -> list[float] | None:
    """Signed errors of `predicted_at_factor` against the largest counted peak among each stage's D
    replicas (what F prices: the most-loaded rank), one per stage."""
    at_factor = row.get("predicted_at_factor")
    if not at_factor:
        return None
    stages = row["flags"]["stages"]
    errors = []
    for pp in range(stages):
        ranks = range(pp, len(at_factor), stages)
        measured = max(row["measured"][r]["activation_peak_bytes"] for r in ranks)
        errors.append((at_factor[pp] - measured) / measured)
    return errors


def run(quick: bool, out_dir: Path, progress: Callable[[str], None]) -> dict:
    del out_dir
    cases = QUICK if quick else CASES
    overlap = fitted_overlap(cases)
    if overlap:
        raise ValueError(f"cases {overlap} are fitted shapes (memory_units.json in_sample): they cannot validate")
    rows = []
    for name, case in cases:
        launchers = ALL_LAUNCHERS[:2] if name in LOCAL_CASES and not quick else ("inprocess",)
        for row in measure_case(name, case, progress, launchers=launchers):
            row["rows_over_m"] = rows_over_m(row["flags"], row.get("expert_loads"))
            if "errors" in row:
                launcher = row["counted_by"].split()[-1]
                row["predicted_at_rows"] = predict_at_rows(row["flags"], launcher, row["rows_over_m"])
                row["load_factor"] = load_factor(row["flags"], row["rows_over_m"])
                row["predicted_at_factor"] = predict_at_factor(row["flags"], launcher, row["load_factor"])
            rows.append(row)
    compared = [r for r in rows if "errors" in r]
    return {"rows": rows, "summary": summarize(compared),
            "exact_mismatches": sum(len(r["mismatches"]) for r in compared), "fitted_cases": fitted_count(),
            "fitted_overlap": overlap}


def group_of(row: dict) -> str:
    flags = row["flags"]
    if flags.get("expert_parallel", 1) == 1:
        return "EP 1"
    return "EP 2 K=E (balanced)" if flags["moe_top_k"] == flags["moe_experts"] else "EP 2 K<E (router's own)"


def summarize(compared: list[dict]) -> dict:
    """Median and max activation-peak error per group: EP 1, EP 2 K=E (balanced), the two together
    (the rows the 5% / 10% bound is held to), EP 2 K<E (the router's own routing), the latter at
    its counted rows (`predict_at_rows`) and at `--moe-load-factor` F against each stage's most-loaded
    rank (`predict_at_factor`)."""
    groups = {}
    for row in compared:
        group, errors = group_of(row), row["errors"]["activation_peak_bytes"]
        groups.setdefault(group, []).extend(errors)
        if "K<E" not in group:
            groups.setdefault("EP 1 and EP 2 K=E (held to the bound)", []).extend(errors)
        else:
            if (at_rows := at_rows_errors(row)) is not None:
                groups.setdefault(f"{group} at counted rows", []).extend(abs(e) for e in at_rows)
            if (at_factor := most_loaded_errors(row)) is not None:
                groups.setdefault(f"{group} at --moe-load-factor F, most-loaded rank per stage", []).extend(
                    abs(e) for e in at_factor)
    return {key: {"median": statistics.median(v), "max": max(v), "ranks": len(v)} for key, v in groups.items()}


def signed_errors(row: dict) -> list[float]:
    return [(p["activation_peak_bytes"] - m["activation_peak_bytes"]) / m["activation_peak_bytes"]
            for p, m in zip(row["predicted"], row["measured"], strict=True)]


def at_rows_errors(row: dict) -> list[float] | None:
    """Signed errors of `predicted_at_rows` (None where there is none)."""
    at_rows = row.get("predicted_at_rows")
    if not at_rows:
        return None
    return [(p - m["activation_peak_bytes"]) / m["activation_peak_bytes"] for p, m in zip(at_rows, row["measured"],
                                                                                          strict=True)]


def to_markdown(payload: dict) -> str:
    table = []
    for r in payload["rows"]:
        if "errors" not in r:
            table.append([r["name"], r["counted_by"], "-", "-", "-", "-", "-", "-", "-", r["skipped"]])
            continue
        exact = "equal" if not r["mismatches"] else f"{len(r['mismatches'])} differ"
        shares = ", ".join("-" if s is None else f"{s['mean']:.2f} / {s['max']:.2f}" for s in r["rows_over_m"])
        at_rows = at_rows_errors(r)
        table.append([r["name"], r["counted_by"], exact, ", ".join(f"{e:+.2%}" for e in signed_errors(r)),
                      "exact" if max(r["errors"]["cache_peak_bytes"]) == 0 else
                      f"{max(r['errors']['cache_peak_bytes']):.2%}", shares,
                      "-" if at_rows is None else ", ".join(f"{e:+.2%}" for e in at_rows),
                      "-" if r.get("load_factor") is None else f"{r['load_factor']:.2f}",
                      "-" if (at_f := most_loaded_errors(r)) is None else ", ".join(f"{e:+.2%}" for e in at_f),
                      ", ".join(r["peak_action_per_rank"])])
    groups = [[key, str(s["ranks"]), f"{s['median']:.2%}", f"{s['max']:.2%}"] for key, s in payload["summary"].items()]
    return "\n".join([
        "## Predicted vs counted memory per rank: mixtures of experts under expert parallelism", "",
        "`attnres-pp simulate memory` against a 2-step training run's `memory_per_rank`, rank by rank "
        f"(global rank dp x P + pp). Model: {_model_line()}. {', '.join(EXACT_KEYS)}: compared for equality. "
        "Activation peak: signed error of the (balanced-routing) prediction per rank. rows / M: the rank's "
        "experts' share of the last step's token-choices times EP, mean / largest over its MoE layers (1 = "
        "the balanced routing the prediction assumes). At counted rows: a diagnosis, not a prediction: the "
        "same walk with each rank's experts receiving its counted share (the mean; under AC full the "
        "largest). F: `simulate memory --moe-load-factor` read off the run, the largest rows / M over the "
        "ranks (the mean over layers; AC full: the largest); at F: that prediction (one F, every rank priced "
        "as the most-loaded one) against the largest counted peak among each stage's replicas, one per stage. "
        "Out of sample: no MoE term is fitted; the dense units are fitted on "
        f"{payload.get('fitted_cases', '?')} tiny chunks (d <= 48), none among these shapes "
        f"(overlap: {payload.get('fitted_overlap') or 'none'}).", "",
        markdown_table(["case", "counted by", "param/grad/optimizer", "activation peak", "cache peak", "rows / M",
                        "at counted rows", "F", "at F (per stage)", "predicted peak's action"], table), "",
        "Activation peak error (absolute) by group:", "",
        markdown_table(["group", "ranks", "median", "max"], groups)])


def _model_line() -> str:
    from attnres_lab.memory_cases import BASE

    flags = case_flags(CASES[0][1])
    return (f"{flags['layers']} layers, d = {flags['d_model']}, {BASE['heads']} heads, seq {flags['seq_len']}, "
            f"vocabulary {flags['vocab_size']}, Block AttnRes (block size {flags['block_size']}), E 8, K 2, S 1, "
            f"F 64, 1 dense layer first (K = E cases: E 4, K 4), D 2, fp32")
