"""`attnres-pp bench bubbles`: the real pipeline's bubble per schedule, next to the closed form and
the calibrated simulator, and the simulator's step-time validation.

For each schedule (gpipe, 1f1b, interleaved 1F1B with V = 2 and 4, and the split-backward ones:
zb_h1, interleaved_zb with V = 2, zbv, dualpipev where m >= 2P) and m, the local launcher runs
P ranks of one thread each. The schedules of one (P, m) are started together and stepped in
rotation, so load from elsewhere on the machine falls on all of them alike; warm-up steps are
dropped and every figure is a median over steps.
Per run:
    measured   bubble = 1 - compute / (ranks x pipeline window), split into idle (waiting for a
               peer) and the runtime's own overhead: receive work, send work and dispatch (gaps
               between actions), see `common.account`
    analytic   (P-1)/(k V m + P-1), the same convention (fraction of the step); k = 3 for the
               split-backward schedules (ZB-H1: (P-1)/(3m + P-1)), 1 otherwise
    simulated  the event simulator on costs calibrated from this run's own trace
               (`simulator.calibrate`: median F/B per chunk, median clean transfer per hop)
    simulated_with_dispatch  the same links; F/B per chunk and the runtime's overhead per compute
               action (dispatch gaps, send and receive work, added to every F and B) taken from each
               measured step in turn, one simulation per step, then the median: the simulator itself
               knows only F, B and links
Step-time validation compares the measured pipeline window with the simulated makespan.
Writes per schedule a timeline PNG of the median step, its Perfetto trace and the simulated one.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path

from attnres_pp.bench.common import (
    BENCH_MODEL,
    MICROBATCH_SIZE,
    StepSample,
    TimedEngine,
    account,
    analytic_bubble,
    markdown_table,
    median_accounting,
    median_sample,
    relative_link,
    run_config,
)
from attnres_pp.schedule.ir import Action, ActionKind
from attnres_pp.schedule.schedules import build_schedule
from attnres_pp.schedule.trace import write_chrome_trace
from attnres_pp.simulator.calibrate import calibrate_from, with_overhead
from attnres_pp.simulator.costs import CostModel, unit_costs
from attnres_pp.simulator.engine import simulate
from attnres_pp.simulator.metrics import summarize
from attnres_pp.simulator.plot import plot_timeline

# The project's model: Block AttnRes (blocks of 2 layers) with the cross-stage cache.
MODEL = {**BENCH_MODEL, "residual": "attnres", "block_size": 4}
SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("zb_h1", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 4),
             ("interleaved_zb", 2), ("zbv", 2), ("dualpipev", 2))


@dataclasses.dataclass(frozen=True)
class BubblesPlan:
    stages: tuple[int, ...]
    microbatches: tuple[int, ...]
    warmup_steps: int
    steps: int

    @classmethod
    def make(cls, quick: bool) -> BubblesPlan:
        # P = 4 only where four ranks get a core each.
        stages = (2,) if quick or (os.cpu_count() or 1) < 4 else (2, 4)
        if quick:
            return cls(stages=stages, microbatches=(4, 8), warmup_steps=2, steps=8)
        return cls(stages=stages, microbatches=(4, 8, 16), warmup_steps=3, steps=12)


def _label(name: str, n_stages: int, n_virtual: int, n_microbatches: int) -> str:
    return f"{name}_P{n_stages}_V{n_virtual}_m{n_microbatches}"


def calibrated_costs(run_cfg, samples) -> CostModel:
    """The simulator's own calibration (`calibrate_from`) over every measured step's events."""
    with tempfile.TemporaryDirectory(prefix="attnres-pp-bench-") as run_dir:
        events = sorted((e for s in samples for e in s.events), key=lambda e: e[2])
        write_chrome_trace(events, Path(run_dir) / "trace.json")
        (Path(run_dir) / "summary.json").write_text(json.dumps({"config": run_cfg.to_dict()}))
        return calibrate_from(run_dir, runtime_overhead=False).costs


def step_costs(costs: CostModel, sample: StepSample, n_ranks: int) -> CostModel:
    """`costs` (links kept) with one measured step's own compute and runtime overhead: per chunk
    the mean F and B (or I and W) of that step, plus that step's runtime overhead per compute
    action (dispatch gaps, send and receive work) on every F and B (I and W each)."""
    means: dict[ActionKind, dict[int, list[float]]] = {kind: {} for kind in (ActionKind.F, ActionKind.B,
                                                                             ActionKind.I, ActionKind.W)}
    for _rank, name, start, end, category in sample.events:
        if category == "compute":
            action = Action.parse(name)
            means[action.kind].setdefault(action.chunk_index, []).append(end - start)
    chunks = range(costs.n_chunks)
    mean = {kind: [statistics.mean(by_chunk[c]) if c in by_chunk else 0.0 for c in chunks]
            for kind, by_chunk in means.items()}
    split = bool(means[ActionKind.I])
    backward = [i + w for i, w in zip(mean[ActionKind.I], mean[ActionKind.W], strict=True)] if split \
        else mean[ActionKind.B]
    step = dataclasses.replace(costs, forward_s=tuple(mean[ActionKind.F]), backward_s=tuple(backward),
                               weight_s=tuple(mean[ActionKind.W]) if split else None,
                               label=costs.label + ", the step's own F/B")
    return with_overhead(step, account(sample.events, n_ranks)["overhead_s_per_compute"], split=split)


def simulate_each_step(schedule, costs: CostModel, samples: list[StepSample], n_ranks: int) -> list:
    """The simulator run once per measured step on that step's costs (`step_costs`): a step's time
    is a sum of its actions' times, so each step is predicted from its own; medians are taken after."""
    return [simulate(schedule, step_costs(costs, sample, n_ranks)) for sample in samples]


def run_in_rotation(run_cfgs: list, warmup: int, steps: int) -> list[TimedEngine]:
    """Start one engine per config, then step them in turn (a round = one step each), so that a
    burst of load on the machine falls on every config alike and the medians drop it."""
    engines: list[TimedEngine] = []
    try:
        for run_cfg in run_cfgs:
            engines.append(TimedEngine(run_cfg))
        for _ in range(warmup + steps):
            for engine in engines:
                engine.step()
    finally:
        for engine in engines:
            engine.close()
    return engines


def analyse(engine: TimedEngine, warmup: int, out_dir: Path | None, progress: Callable[[str], None]) -> dict:
    """One schedule's row: measured, analytic and simulated bubble and step time."""
    run_cfg = engine.run_cfg
    pipe = run_cfg.pipeline
    name, n_stages, n_virtual, n_microbatches = pipe.schedule, pipe.stages, pipe.virtual, run_cfg.train.microbatches
    samples = engine.samples[warmup:]
    measured = median_accounting(samples, n_stages)
    schedule = build_schedule(name, n_stages, n_virtual, n_microbatches)
    costs = calibrated_costs(run_cfg, samples)
    sim = simulate(schedule, costs)
    per_step = simulate_each_step(schedule, costs, samples, n_stages)
    sim_dispatch = per_step[samples.index(median_sample(samples, n_stages))]
    sim_report = summarize(sim)
    sim_dispatch_report = {"bubble_fraction": statistics.median(summarize(r)["bubble_fraction"] for r in per_step),
                           "makespan": statistics.median(r.makespan for r in per_step)}
    unit = summarize(simulate(schedule, unit_costs(n_stages, n_virtual)))
    analytic = analytic_bubble(name, n_stages, n_virtual, n_microbatches)
    step_s = measured["step_s"]
    row = {
        "name": name, "P": n_stages, "V": n_virtual, "m": n_microbatches,
        "measured": measured["bubble"],
        "simulated": sim_report["bubble_fraction"],
        "simulated_with_dispatch": sim_dispatch_report["bubble_fraction"],
        "simulated_unit_costs": unit["bubble_fraction"],
        "analytic": analytic["fraction"],
        "analytic_ratio": analytic["ratio"],
        "measured_idle": measured["idle"],
        "measured_recv": measured["recv"],
        "measured_send": measured["send"],
        "measured_dispatch": measured["dispatch"],
        "dispatch_us_per_action": measured["dispatch_us_per_action"],
        "measured_step_s": step_s,
        "simulated_step_s": sim_report["makespan"],
        "step_time_error": sim_report["makespan"] / step_s - 1.0,
        "simulated_with_dispatch_step_s": sim_dispatch_report["makespan"],
        "step_time_error_with_dispatch": sim_dispatch_report["makespan"] / step_s - 1.0,
        "wall_step_s": statistics.median(s.wall_s for s in samples),
        "compute_s_per_rank": measured["compute_s_per_rank"],
        "steps_measured": len(samples),
        "engine_startup_s": engine.startup_s,
        "ran_in_rotation_with": "the other schedules of the same P and m",
    }
    if out_dir is not None:
        label = _label(name, n_stages, n_virtual, n_microbatches)
        median_events = sorted(median_sample(samples, n_stages).events, key=lambda e: e[2])
        row["trace"] = str(write_chrome_trace(median_events, out_dir / f"trace_{label}.json"))
        row["simulated_trace"] = str(write_chrome_trace(sim_dispatch.events(), out_dir / f"trace_{label}_sim.json"))
        title = (f"measured {name} P={n_stages} V={n_virtual} m={n_microbatches}: bubble {row['measured']:.3f} "
                 f"(idle {row['measured_idle']:.3f}, runtime {row['measured'] - row['measured_idle']:.3f}); "
                 f"analytic {row['analytic']:.3f}, simulated {row['simulated']:.3f}")
        row["timeline_png"] = str(plot_timeline(median_events, out_dir / f"timeline_{label}.png",
                                                n_stages=n_stages, title=title))
    progress(f"  {_label(name, n_stages, n_virtual, n_microbatches)}: bubble measured {row['measured']:.3f} "
             f"(idle {row['measured_idle']:.3f} + recv {row['measured_recv']:.3f} + send "
             f"{row['measured_send']:.3f} + dispatch {row['measured_dispatch']:.3f}), "
             f"simulated {row['simulated']:.3f}, analytic {row['analytic']:.3f}; "
             f"step {step_s * 1e3:.0f} ms, simulated {row['simulated_step_s'] * 1e3:.0f} ms "
             f"({row['step_time_error']:+.1%}), with dispatch {row['step_time_error_with_dispatch']:+.1%}")
    return row


def run(quick: bool, out_dir: Path | None, progress: Callable[[str], None]) -> dict:
    plan = BubblesPlan.make(quick)
    rows = []
    # One rotation group per (P, m): the schedules at the same size share the machine's drift.
    for n_stages in plan.stages:
        for n_microbatches in plan.microbatches:
            run_cfgs = [run_config(MODEL, stages=n_stages, virtual=n_virtual, schedule=name,
                                   microbatches=n_microbatches)
                        for name, n_virtual in SCHEDULES
                        if n_stages * n_virtual <= BENCH_MODEL["n_layers"] and n_microbatches >= n_stages
                        and (name != "dualpipev" or n_microbatches >= 2 * n_stages)]
            progress(f"  P={n_stages} m={n_microbatches}: {len(run_cfgs)} schedules in rotation")
            engines = run_in_rotation(run_cfgs, plan.warmup_steps, plan.steps)
            # Only the largest m gets timelines and traces (the smaller ones look alike).
            keep = out_dir if n_microbatches == max(plan.microbatches) else None
            rows += [analyse(engine, plan.warmup_steps, keep, progress) for engine in engines]
    return {
        "schedules": rows,
        "model": {**MODEL, "microbatch_size": MICROBATCH_SIZE, "cache": True},
        "warmup_steps": plan.warmup_steps, "steps": plan.steps,
        "bubble_convention": "fraction = idle / (ranks x step window); analytic (P-1)/(k V m + P-1), k = 3 for "
                             "zb_h1, interleaved_zb, zbv and dualpipev (zbv: m >= 2P - 1; dualpipev runs m >= 2P), "
                             "else 1",
        "step_time_error_convention": "simulated makespan / measured pipeline window - 1",
    }


def to_markdown(payload: dict) -> str:
    rows = payload["schedules"]
    f3 = "{:.3f}".format
    bubbles = markdown_table(
        ["schedule", "P", "V", "m", "measured", "= idle", "+ recv", "+ send", "+ dispatch", "dispatch us/action",
         "simulated", "sim + dispatch (vs idle)", "analytic"],
        [[r["name"], r["P"], r["V"], r["m"], f3(r["measured"]), f3(r["measured_idle"]), f3(r["measured_recv"]),
          f3(r["measured_send"]), f3(r["measured_dispatch"]), f"{r['dispatch_us_per_action']:.1f}",
          f3(r["simulated"]), f3(r["simulated_with_dispatch"]), f3(r["analytic"])] for r in rows])
    validation = markdown_table(
        ["schedule", "P", "V", "m", "measured step (ms)", "simulated (ms)", "error", "sim + dispatch (ms)",
         "error", "idle measured", "bubble sim + dispatch"],
        [[r["name"], r["P"], r["V"], r["m"], f"{1e3 * r['measured_step_s']:.1f}", f"{1e3 * r['simulated_step_s']:.1f}",
          f"{r['step_time_error']:+.1%}", f"{1e3 * r['simulated_with_dispatch_step_s']:.1f}",
          f"{r['step_time_error_with_dispatch']:+.1%}", f3(r["measured_idle"]), f3(r["simulated_with_dispatch"])]
         for r in rows])
    errors = [abs(r["step_time_error"]) for r in rows]
    errors_dispatch = [abs(r["step_time_error_with_dispatch"]) for r in rows]
    within = sum(e <= 0.05 for e in errors_dispatch)
    images = [f"![{Path(r['timeline_png']).stem}]({relative_link(r['timeline_png'])})" for r in rows
              if "timeline_png" in r]
    return "\n".join([
        "## Pipeline bubbles (measured vs simulated vs analytic)", "",
        f"Model: {payload['model']}; Block AttnRes with the cache; median of {payload['steps']} steps after "
        f"{payload['warmup_steps']} warm-up steps. Bubble fraction = 1 - compute / (ranks x step window); it "
        "splits into idle (waiting for a peer, before the first and after the last action), recv (the work "
        "inside receives: posting, unpacking), send (packing and posting sends) and dispatch (gaps between "
        "actions). recv + send + dispatch is the runtime's overhead, idle the schedule's bubble. "
        "Analytic: (P-1)/(k V m + P-1), k = 3 for the split-backward schedules zb_h1 (ZB-H1's "
        "(P-1)/(3m+P-1)), interleaved_zb, zbv (for m >= 2P - 1) and dualpipev (m >= 2P), 1 otherwise.", "",
        bubbles, "",
        "## Simulator validation (step time)", "",
        "Measured: the pipeline window of a step (first action start to last action end on any rank). "
        "Simulated: the event simulator's makespan on costs calibrated from the same run "
        "(`simulator.calibrate`: median F/B per chunk, median clean transfer per hop); 'sim + dispatch' "
        "simulates every measured step on its own F/B per chunk plus its runtime overhead per compute "
        "action (dispatch gaps, send and receive work) on every F and B, and takes the median.", "",
        validation, "",
        f"Median |error|: calibrated {statistics.median(errors):.1%} (max {max(errors):.1%}); "
        f"with dispatch {statistics.median(errors_dispatch):.1%} (max {max(errors_dispatch):.1%}; "
        f"{within} of {len(rows)} within 5%). The simulator with dispatch counts the runtime's overhead as "
        "busy time, so its bubble compares with the measured idle.", "",
        *images,
    ])
