"""`attnres-lab memory-predict`: the simulator's per-rank memory (`simulate memory`) against
what real training steps hold, on configurations the activation units were not fitted on (the units
come from single tiny chunks; these are whole pipelined steps with other schedules, V, m, D, AC,
block sizes and variants). Two counts, each a row of the table:

- `hooks`: one step of the real runtime over the loopback transport in this process, counted by
  `attnres_lab.memory_count` (saved tensors alive per rank, cache entries + deposits) and, for
  param/grad/optimizer, each rank's real modules and an AdamW after one step (fp32 and bf16; not
  for AC or fsdp, which this count does not run);
- `run inprocess`, `run local` and `run ray`: `attnres-pp train ... --steps 2` (CPU) under each
  launcher users run (the in-process ranks share a loopback mailbox; local rank processes and Ray
  actors hand hops over through shared memory, `comm.shm_transport`; Ray for `RAY_CASES`, one case
  per AC policy, fsdp, bf16 and V = 4, since each run starts a Ray instance), and its `summary.json`'s
  `memory_per_rank`; fsdp not in-process (FSDP2 needs a process group per rank). A summary
  without it (a tree whose runs do not count memory) is listed as skipped with the reason.

Fitted vs validated: the activation units are fitted on single chunks of tiny models
(`memory_units.json`'s `in_sample`, d_model <= 48); every case here is validation only, and
`fitted_overlap` checks that none of them is a fitted shape (the table says so).

param/grad/optimizer bytes must be equal; activation and cache peaks are compared as relative
errors (target: median <= 5%, max <= 10%).
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

from attnres_lab.memory_cases import BASE, CASES, QUICK, RAY_CASES  # noqa: F401 (CASES re-exported)
from attnres_pp.bench.common import markdown_table

EXACT_KEYS = ("param_bytes", "grad_bytes", "optimizer_bytes")
PEAK_KEYS = ("activation_peak_bytes", "cache_peak_bytes")
SLOT_KEY = "transport_buffer_bytes"  # the shared-memory receive slots: exact, like the held bytes

def case_flags(case: dict) -> dict:
    flags = {**BASE, **case}
    if flags["residual"] == "standard":
        flags.pop("block_size", None)
    return flags


LAUNCHERS = ("inprocess", "local")
ALL_LAUNCHERS = (*LAUNCHERS, "ray")


def launchers_of(flags: dict, launchers: tuple[str, ...] = LAUNCHERS) -> tuple[str, ...]:
    """The launchers a case runs under: FSDP2 needs a process group per rank, which in-process
    ranks (threads of one process) lack, so fsdp does not run in-process."""
    return tuple(x for x in launchers if x != "inprocess" or flags.get("dp_shard") != "fsdp")


def train_argv(flags: dict, out_dir: Path, launcher: str | None = None) -> list[str]:
    launcher = launcher or launchers_of(flags)[0]
    argv = ["train", "--steps", "2", "--launcher", launcher, "--device", "cpu", "--threads", "1", "--quiet",
            "--out", str(out_dir), "--cache", "on"]
    for key, value in {"dtype": "fp32", **flags}.items():
        argv += _flag(key, value)
    return argv


def _flag(key: str, value) -> list[str]:
    """A case's key as command-line tokens: a switch (True) is its flag alone."""
    flag = f"--{key.replace('_', '-')}"
    if isinstance(value, bool):
        return [flag] if value else []
    return [flag, str(value)]


def microbatch_sequences(flags: dict) -> int:
    return flags["batch_size"] // (flags.get("data_parallel", 1) * flags["microbatches"])


def predict_argv(flags: dict, launcher: str = "inprocess") -> list[str]:
    argv = ["simulate", "memory", "--json", "--tokens", str(microbatch_sequences(flags) * flags["seq_len"]),
            "--launcher", launcher]
    for key, value in {"dtype": "fp32", **flags}.items():
        if key != "batch_size":
            argv += _flag(key, value)
    return argv


def predict(flags: dict, launcher: str = "inprocess") -> dict:
    """`simulate memory --json`'s report for the case under `launcher`, computed in this process."""
    import argparse

    from attnres_pp.simulator import cli as simulate_cli
    from attnres_pp.simulator.cli.memory import build
    from attnres_pp.simulator.memory import predict_memory

    # The `simulate` parser alone: the same flags, the same defaults.
    parser = argparse.ArgumentParser(prog="attnres-pp")
    simulate_cli.register(parser.add_subparsers(dest="command", required=True))
    argv = predict_argv(flags, launcher)
    cfg, setup = build(parser.parse_args(argv))
    ranks = predict_memory(cfg, setup)
    return {"memory_per_rank": [r.terms for r in ranks], "peak_action_per_rank": [r.peak_action for r in ranks],
            "model": cfg}


def hook_count(flags: dict, cfg) -> list[dict]:
    """Per global rank, counted in this process: state bytes of the real modules and AdamW, and the
    activation and cache peaks of one loopback step (`attnres_lab.memory_count`)."""
    import torch

    from attnres_lab.memory_count import count_step
    from attnres_pp.comm.partition import make_partition
    from attnres_pp.pipeline.chunk import build_rank_model, rank_parameters
    from attnres_pp.schedule.schedules import schedule_placement
    from attnres_pp.train.config import TrainConfig
    from attnres_pp.train.optim import build_optimizer

    torch.set_num_threads(1)
    n_stages, n_virtual = flags["stages"], flags.get("virtual", 1)
    peaks = count_step(cfg, schedule_name=flags["schedule"], n_stages=n_stages, n_virtual=n_virtual,
                       n_microbatches=flags["microbatches"], n_sequences=microbatch_sequences(flags),
                       dtype=flags.get("dtype", "fp32"),
                       activation_checkpoint=flags.get("activation_checkpoint", "none"))
    partition = make_partition(cfg.n_layers, n_stages, n_virtual, placement=schedule_placement(flags["schedule"]))
    ranks = []
    for pp_rank in range(n_stages):
        model, chunks = build_rank_model(cfg, partition, pp_rank, seed=0)
        named = rank_parameters(chunks, model)
        optimizer = build_optimizer(named.items(), TrainConfig())
        for p in named.values():
            p.grad = torch.zeros_like(p)
        optimizer.step()
        param = sum(p.numel() * p.element_size() for p in named.values())
        # An MoE layer's selection bias is a parameter without gradient (nor AdamW state).
        grad = sum(p.numel() * p.element_size() for p in named.values() if p.requires_grad)
        # docs/spec.md section 8's optimizer_bytes: AdamW's two moments (its 0-d `step` tensors are not counted)
        state = sum(t.numel() * t.element_size() for s in optimizer.state.values() for key, t in s.items()
                    if key in ("exp_avg", "exp_avg_sq"))
        ranks.append({"param_bytes": param, "grad_bytes": grad, "optimizer_bytes": state,
                      "activation_peak_bytes": peaks[pp_rank]["activation_peak_bytes"],
                      "cache_peak_bytes": peaks[pp_rank]["cache_peak_bytes"]})
    return ranks * flags.get("data_parallel", 1)


def _cli(argv: list[str], timeout_s: float) -> str:
    # The children import the attnres_pp this process imported (a checkout's or an installed one).
    import attnres_pp

    source = str(Path(attnres_pp.__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [source, os.environ.get("PYTHONPATH")]))}
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
        # The transport's slots are compared where the run counts them (a tree without the key: not).
        exact = (*EXACT_KEYS, *([SLOT_KEY] if SLOT_KEY in m else []))
        mismatches += [f"rank {rank} {key}: predicted {p[key]} counted {m[key]}" for key in exact
                       if p.get(key, 0) != m[key]]
        for key in PEAK_KEYS:
            errors[key].append(0.0 if p[key] == m[key] else abs(p[key] - m[key]) / max(m[key], 1))
    return {"mismatches": mismatches, "errors": errors}


def measure_case(name: str, case: dict, progress: Callable[[str], None], *, runs: bool = True,
                 launchers: tuple[str, ...] = LAUNCHERS) -> list[dict]:
    """The case's rows: `hooks` (where this process can count it) and `run <launcher>` (a training
    run's summary) for each of `launchers` the case can run under."""
    flags = case_flags(case)
    prediction = predict(flags)
    base = {"name": name, "flags": flags, "predicted": prediction["memory_per_rank"],
            "peak_action_per_rank": prediction["peak_action_per_rank"]}
    rows = []
    # The loopback count runs whole-model ranks in turns: no EP group meets in its all-to-alls.
    if flags.get("dp_shard", "replicate") == "replicate" and flags.get("expert_parallel", 1) == 1:
        rows.append(_compared(base | {"counted_by": "hooks"}, hook_count(flags, prediction["model"]), progress))
    for launcher in launchers_of(flags, launchers) if runs else ():
        mine = predict(flags, launcher)
        row = base | {"counted_by": f"run {launcher}", "predicted": mine["memory_per_rank"],
                      "peak_action_per_rank": mine["peak_action_per_rank"]}
        try:
            with tempfile.TemporaryDirectory() as tmp:
                _cli(train_argv(flags, Path(tmp) / "run", launcher), 900)
                summary = json.loads((Path(tmp) / "run" / "summary.json").read_text())
        except RuntimeError as error:  # a flag this tree lacks (AC, fsdp) or a failed run: say so, go on
            summary = {"error": str(error)}
        if "memory_per_rank" in summary:
            if "moe_expert_loads" in summary:  # the last step's token-choices per expert, by layer
                row["expert_loads"] = summary["moe_expert_loads"]
            rows.append(_compared(row, summary["memory_per_rank"], progress))
        else:
            row["skipped"] = summary.get("error", "summary.json has no memory_per_rank (this tree does not count "
                                                  "memory)")
            progress(f"{name} ({row['counted_by']}): {row['skipped']}")
            rows.append(row)
    return rows


def _compared(row: dict, measured: list[dict], progress: Callable[[str], None]) -> dict:
    row["measured"] = [{k: r[k] for k in (*EXACT_KEYS, *PEAK_KEYS, SLOT_KEY) if k in r} for r in measured]
    row.update(compare(row["predicted"], row["measured"]))
    progress(f"{row['name']} ({row['counted_by']}): max activation error "
             f"{max(row['errors']['activation_peak_bytes']):.2%}, cache {max(row['errors']['cache_peak_bytes']):.2%}, "
             f"{len(row['mismatches'])} exact mismatches")
    return row


def group_of(flags: dict) -> str:
    """The part of the model a case checks: its AC policy, or fsdp (whatever its policy)."""
    if flags.get("dp_shard") == "fsdp":
        return "fsdp"
    return f"AC {flags.get('activation_checkpoint', 'none')}"


def summarize(rows: list[dict]) -> tuple[dict, dict]:
    """(median and max error per counted_by/key, and the same per counted_by/group for the activation peak)."""
    compared = [r for r in rows if "errors" in r]
    summary, by_group = {}, {}
    for counted_by in ("hooks", *(f"run {launcher}" for launcher in ALL_LAUNCHERS)):
        mine = [r for r in compared if r["counted_by"] == counted_by]
        for key in PEAK_KEYS:
            values = [e for r in mine for e in r["errors"][key]]
            if values:
                summary[f"{counted_by}/{key}"] = {"median": statistics.median(values), "max": max(values)}
        for group in ("AC none", "AC full", "AC selective", "fsdp"):
            values = [e for r in mine if group_of(r["flags"]) == group for e in r["errors"]["activation_peak_bytes"]]
            if values:
                by_group[f"{counted_by}/{group}"] = {"median": statistics.median(values), "max": max(values),
                                                     "ranks": len(values)}
    return summary, by_group


def fitted_overlap(cases=CASES) -> list[str]:
    """The cases whose model is among the fitted ones (`memory_units.json`'s `in_sample`, by
    d_model, layers and tokens per sequence): none may be, so every row here is validation."""
    import re

    units = _fitted_units()
    fitted = set()
    for entry in units["in_sample"]:
        found = {k: int(v) for k, v in re.findall(r"\b(L|d|T)=(\d+)", entry)}
        fitted.add((found.get("L"), found.get("d"), found.get("T")))
    return [name for name, case in cases
            if ((flags := case_flags(case))["layers"], flags["d_model"], flags["seq_len"]) in fitted]


def fitted_count() -> int:
    return len(_fitted_units()["in_sample"])


def _fitted_units() -> dict:
    """The activation units the simulator ships (`simulator.memory.UNITS_PATH`)."""
    from attnres_pp.simulator.memory import UNITS_PATH

    return json.loads(UNITS_PATH.read_text())


def run(quick: bool, out_dir: Path, progress: Callable[[str], None]) -> dict:
    del out_dir  # no pictures or traces
    overlap = fitted_overlap()
    if overlap:
        raise ValueError(f"cases {overlap} are fitted shapes (memory_units.json in_sample): they cannot validate")
    rows = [row for name, case in (QUICK if quick else CASES)
            for row in measure_case(name, case, progress,
                                    launchers=ALL_LAUNCHERS if name in RAY_CASES and not quick else LAUNCHERS)]
    compared = [r for r in rows if "errors" in r]
    summary, by_group = summarize(rows)
    return {"rows": rows, "summary": summary, "activation_by_group": by_group,
            "exact_mismatches": sum(len(r["mismatches"]) for r in compared), "compared": len(compared),
            "fitted_cases": fitted_count(), "fitted_overlap": overlap}


def to_markdown(payload: dict) -> str:
    def pct(values: list[float]) -> str:
        return f"{statistics.median(values):.2%} / {max(values):.2%}"

    table = []
    for r in payload["rows"]:
        if "errors" not in r:
            table.append([r["name"], "validated", r["counted_by"], "-", "-", "-", r["skipped"]])
            continue
        exact = "equal" if not r["mismatches"] else f"{len(r['mismatches'])} differ"
        table.append([r["name"], "validated", r["counted_by"], exact,
                      pct(r["errors"]["activation_peak_bytes"]), pct(r["errors"]["cache_peak_bytes"]),
                      ", ".join(r["peak_action_per_rank"])])
    lines = ["## Predicted vs counted memory per rank (out of sample)", "",
             "`attnres-pp simulate memory` against one real step per case, counted by saved-tensor hooks in "
             "this process (`hooks`: loopback runtime, every rank) or by a training run's `memory_per_rank` "
             "(`run inprocess` / `run local` / `run ray`: 2 steps under that launcher, fp32 unless the case says "
             "bf16; fsdp not in-process; Ray for the cases `RAY_CASES` names). "
             f"Model {BASE} (dtype fp32 unless the case says bf16; the default layer recipe, rotary positions, "
             "SwiGLU and multi-head attention, unless the case names another). "
             "Errors: median / max over ranks. Out of sample: the activation units "
             "(`attnres_pp/simulator/memory_units.json`) are fitted by `attnres-lab fit-memory-units` "
             "on single chunks of tiny models (d_model <= 48, seq_len <= 24, vocab <= 80, <= 6 layers; every fitted "
             f"case is listed in the JSON's `in_sample`: {payload.get('fitted_cases', '?')} fitted cases). "
             "Every row below is **validated** (out of sample), none **fitted**: the fitted and validated sets "
             f"do not overlap (fitted shapes among these cases: {payload.get('fitted_overlap') or 'none'}).", "",
             markdown_table(["case", "set", "counted by", "param/grad/optimizer", "activation peak", "cache peak",
                             "predicted peak's action per rank"], table)]
    for key, stats in payload["summary"].items():
        lines.append(f"\n{key}: median {stats['median']:.2%}, max {stats['max']:.2%} over every rank compared "
                     "(targets 5% and 10%).")
    groups = [[key.split("/")[0], key.split("/")[1], str(stats["ranks"]), f"{stats['median']:.2%}",
               f"{stats['max']:.2%}"] for key, stats in payload.get("activation_by_group", {}).items()]
    if groups:
        lines += ["", "Activation peak by what the case checks (fsdp: every fsdp case, whatever its AC):", "",
                  markdown_table(["counted by", "group", "ranks", "median", "max"], groups)]
    return "\n".join(lines)
