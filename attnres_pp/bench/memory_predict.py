"""`attnres-pp bench memory --predict`: the simulator's per-rank memory (`simulate memory`) against
the `memory_per_rank` a real training run counts in its `summary.json` (SPEC section 8), on
configurations the activation units were not fitted on (the units come from single tiny chunks;
these are whole pipelined runs with other schedules, V, m, D, AC, block sizes and variants).

Each run is `attnres-pp train ... --steps 2` (in-process launcher: loopback transport, one thread,
fp32 on the CPU). param/grad/optimizer bytes must be equal; activation and cache peaks are compared
as relative errors (target: median <= 5%, max <= 10%). A summary without `memory_per_rank` (a tree
that does not count memory yet) is reported as such and nothing is compared.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from attnres_pp.bench.common import markdown_table

EXACT_KEYS = ("param_bytes", "grad_bytes", "optimizer_bytes")
PEAK_KEYS = ("activation_peak_bytes", "cache_peak_bytes")
BASE = {"layers": 8, "d_model": 64, "heads": 4, "seq_len": 32, "vocab_size": 256, "batch_size": 4}
# (name, flags): each differs from the others in schedule, V, m, D, AC, block size or variant.
CASES = (
    ("1f1b attnres S=4", {"schedule": "1f1b", "stages": 2, "microbatches": 4, "residual": "attnres", "block_size": 4}),
    ("interleaved V=2 S=2", {"schedule": "interleaved_1f1b", "stages": 2, "virtual": 2, "microbatches": 4,
                             "residual": "attnres", "block_size": 2}),
    ("zb_h1 standard", {"schedule": "zb_h1", "stages": 2, "microbatches": 4, "residual": "standard"}),
    ("interleaved_zb full AttnRes", {"schedule": "interleaved_zb", "stages": 2, "virtual": 2, "microbatches": 4,
                                     "residual": "attnres", "block_size": 1}),
    ("zbv lr_attnres", {"schedule": "zbv", "stages": 2, "virtual": 2, "microbatches": 4, "residual": "lr_attnres",
                        "block_size": 4}),
    ("1f1b msar m=2", {"schedule": "1f1b", "stages": 2, "microbatches": 2, "residual": "msar", "block_size": 4}),
    ("D=2 fsdp interleaved", {"schedule": "interleaved_1f1b", "stages": 2, "virtual": 2, "microbatches": 2,
                              "data_parallel": 2, "dp_shard": "fsdp", "residual": "attnres", "block_size": 4}),
    ("AC full 1f1b", {"schedule": "1f1b", "stages": 2, "microbatches": 4, "residual": "attnres", "block_size": 4,
                      "activation_checkpoint": "full"}),
    ("AC selective zb_h1", {"schedule": "zb_h1", "stages": 2, "microbatches": 4, "residual": "attnres",
                            "block_size": 2, "activation_checkpoint": "selective"}),
)
QUICK = CASES[:3]


def case_flags(case: dict) -> dict:
    flags = {**BASE, **case}
    if flags["residual"] == "standard":
        flags.pop("block_size", None)
    return flags


def train_argv(flags: dict, out_dir: Path) -> list[str]:
    argv = ["train", "--steps", "2", "--launcher", "inprocess", "--device", "cpu", "--dtype", "fp32",
            "--threads", "1", "--quiet", "--out", str(out_dir), "--cache", "on"]
    for key, value in flags.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    return argv


def predict_argv(flags: dict) -> list[str]:
    tokens = flags["batch_size"] // (flags.get("data_parallel", 1) * flags["microbatches"]) * flags["seq_len"]
    argv = ["simulate", "memory", "--json", "--tokens", str(tokens), "--dtype", "fp32"]
    for key, value in flags.items():
        if key != "batch_size":
            argv += [f"--{key.replace('_', '-')}", str(value)]
    if "block_size" not in flags:
        argv += ["--block-size", "1"]
    return argv


def _cli(argv: list[str], timeout_s: float) -> str:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run([sys.executable, "-m", "attnres_pp.cli", *argv], capture_output=True, text=True,
                          timeout=timeout_s, env=env)
    if done.returncode:
        raise RuntimeError(f"attnres-pp {' '.join(argv[:2])} failed: {done.stderr.strip().splitlines()[-1:]}")
    return done.stdout


def compare(predicted: list[dict], measured: list[dict]) -> dict:
    """Per rank: which exact terms differ, and the relative errors of the two peaks."""
    if len(predicted) != len(measured):
        raise ValueError(f"{len(predicted)} predicted ranks but {len(measured)} counted")
    mismatches, errors = [], {key: [] for key in PEAK_KEYS}
    for rank, (p, m) in enumerate(zip(predicted, measured, strict=True)):
        mismatches += [f"rank {rank} {key}: predicted {p[key]} counted {m[key]}" for key in EXACT_KEYS
                       if p[key] != m[key]]
        for key in PEAK_KEYS:
            errors[key].append(0.0 if p[key] == m[key] else abs(p[key] - m[key]) / max(m[key], 1))
    return {"mismatches": mismatches, "errors": errors}


def measure_case(name: str, case: dict, progress: Callable[[str], None]) -> dict:
    flags = case_flags(case)
    prediction = json.loads(_cli(predict_argv(flags), 120))
    with tempfile.TemporaryDirectory() as tmp:
        _cli(train_argv(flags, Path(tmp) / "run"), 900)
        summary = json.loads((Path(tmp) / "run" / "summary.json").read_text())
    row = {"name": name, "flags": flags, "predicted": prediction["memory_per_rank"],
           "peak_action_per_rank": prediction["peak_action_per_rank"]}
    if "memory_per_rank" not in summary:
        row["skipped"] = "summary.json has no memory_per_rank (this tree does not count memory)"
        progress(f"{name}: {row['skipped']}")
        return row
    row["measured"] = [{k: r[k] for k in (*EXACT_KEYS, *PEAK_KEYS)} for r in summary["memory_per_rank"]]
    row.update(compare(row["predicted"], row["measured"]))
    progress(f"{name}: max activation error {max(row['errors']['activation_peak_bytes']):.1%}, "
             f"cache {max(row['errors']['cache_peak_bytes']):.1%}, {len(row['mismatches'])} exact mismatches")
    return row


def run(quick: bool, out_dir: Path, progress: Callable[[str], None]) -> dict:
    del out_dir  # no pictures or traces
    rows = []
    for name, case in QUICK if quick else CASES:
        try:
            rows.append(measure_case(name, case, progress))
        except RuntimeError as error:  # a flag this tree lacks (AC, fsdp) or a failed run: say so, go on
            rows.append({"name": name, "flags": case_flags(case), "skipped": str(error)})
            progress(f"{name}: {error}")
    compared = [r for r in rows if "errors" in r]
    summary = {}
    for key in PEAK_KEYS:
        values = [e for r in compared for e in r["errors"][key]]
        if values:
            summary[key] = {"median": statistics.median(values), "max": max(values)}
    return {"rows": rows, "summary": summary, "exact_mismatches": sum(len(r["mismatches"]) for r in compared),
            "compared": len(compared)}


def to_markdown(payload: dict) -> str:
    def pct(values: list[float]) -> str:
        return f"{statistics.median(values):.1%} / {max(values):.1%}"

    table = []
    for r in payload["rows"]:
        if "errors" not in r:
            table.append([r["name"], "-", "-", "-", r["skipped"]])
            continue
        table.append([r["name"], "equal" if not r["mismatches"] else f"{len(r['mismatches'])} differ",
                      pct(r["errors"]["activation_peak_bytes"]), pct(r["errors"]["cache_peak_bytes"]),
                      ", ".join(r["peak_action_per_rank"])])
    lines = ["## Predicted vs counted memory per rank (out of sample)", "",
             "Simulator (`attnres-pp simulate memory`) against `summary.json`'s `memory_per_rank` of 2-step runs "
             f"(in-process launcher, fp32, CPU), model {BASE}. Errors: median / max over ranks.", "",
             markdown_table(["case", "param/grad/optimizer", "activation peak", "cache peak",
                             "predicted peak's action per rank"], table)]
    for key, stats in payload["summary"].items():
        lines.append(f"\n{key}: median {stats['median']:.2%}, max {stats['max']:.2%} over every rank compared "
                     "(targets 5% and 10%).")
    return "\n".join(lines)
