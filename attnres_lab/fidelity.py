"""`attnres-lab fidelity`: the simulator predicts measured runs it has not seen.

Calibrate on ONE run (P = 2, 1f1b, V = 1, m = 4, Block AttnRes with the cache, 8 layers) and
predict held-out runs that differ in schedule, V, m, payload mode (standard / naive / cached),
layers, and link: two runs over a link emulated at 0.2 Gb/s (`--link-gbps`) show what the cache
is for. The calibration run is never among the predicted cases (out of sample).

How:
1. `attnres_lab.unit_probe` times the units of a chunk in this process (CPU time of one thread): the
   split of a chunk's work between layers, depth reads (by sources and queries), embedding, head.
2. The runs (local launcher, gloo, one thread per rank) are stepped in rotation groups. The
   calibration run is one engine kept alive through every group and stepped in every round with
   that group's runs (the order rotating each round), so load drifting on the machine falls on it
   and on the runs it predicts alike; each group's predictions use the calibration run's steps
   from that group's rounds (`attnres_lab.transfer_fit.fit_transfer`: the probe scaled to the run,
   message costs from its trace).
3. Each held-out case is then simulated (`TransferCalibration.predict_step_s`) and compared with
   its median measured pipeline window (first action start to last action end, as `bench
   bubbles`). error = predicted / measured - 1.
Adding a schedule is one `Case` line in CASES (the zero-bubble ones have a rotation group of their own).
"""

from __future__ import annotations

import dataclasses
import os
import statistics
from collections.abc import Callable
from pathlib import Path

from attnres_lab.fidelity_cases import BLOCK_SIZE, N_STAGES, SLOW_LINK_GBPS, Case
from attnres_lab.transfer_fit import fit_transfer
from attnres_lab.unit_probe import probe_units
from attnres_pp.bench.common import BENCH_MODEL, MICROBATCH_SIZE, TimedEngine, account, markdown_table
from attnres_pp.model.config import ModelConfig
from attnres_pp.schedule.schedules import build_schedule
from attnres_pp.simulator.engine import simulate
from attnres_pp.simulator.metrics import summarize
from attnres_pp.simulator.transfer import TransferCalibration

CALIBRATION = Case("1f1b", 1, 4, "cached", 8)
# Rotation groups of held-out cases (each group is stepped together with the calibration run).
# One line per case. The split-backward schedules (zb_h1, interleaved_zb, zbv, dualpipev) are priced from the
# fused calibration run with W taken as half of each backward (`TransferCalibration.weight_share`).
CASES = (
    (Case("gpipe", 1, 4, "cached", 8), Case("1f1b", 1, 8, "cached", 8), Case("1f1b", 1, 4, "standard", 8),
     Case("interleaved_1f1b", 2, 4, "cached", 8), Case("interleaved_1f1b", 2, 8, "naive", 8)),
    (Case("interleaved_1f1b", 4, 8, "cached", 8), Case("interleaved_1f1b", 2, 8, "standard", 8),
     Case("gpipe", 2, 4, "naive", 8), Case("1f1b", 1, 16, "cached", 8)),
    (Case("1f1b", 1, 4, "cached", 16), Case("interleaved_1f1b", 4, 4, "naive", 16),
     Case("gpipe", 1, 8, "standard", 16), Case("interleaved_1f1b", 2, 8, "cached", 16)),
    (Case("interleaved_1f1b", 4, 8, "cached", 8, SLOW_LINK_GBPS),
     Case("interleaved_1f1b", 4, 8, "naive", 8, SLOW_LINK_GBPS)),
    (Case("zb_h1", 1, 8, "cached", 8),
     Case("interleaved_zb", 2, 8, "cached", 8),
     Case("zbv", 2, 8, "cached", 8),
     Case("dualpipev", 2, 8, "cached", 8)),
)
QUICK_CASES = (
    (Case("gpipe", 1, 4, "cached", 8), Case("1f1b", 1, 8, "standard", 8), Case("interleaved_1f1b", 2, 4, "naive", 8),
     Case("interleaved_1f1b", 4, 4, "cached", 8)),
    (Case("1f1b", 1, 4, "cached", 16), Case("interleaved_1f1b", 2, 4, "standard", 16),
     Case("interleaved_1f1b", 4, 4, "cached", 8, SLOW_LINK_GBPS),
     Case("interleaved_1f1b", 4, 4, "naive", 8, SLOW_LINK_GBPS)),
)


@dataclasses.dataclass(frozen=True)
class FidelityPlan:
    groups: tuple[tuple[Case, ...], ...]
    warmup_steps: int
    steps: int
    probe_rounds: int

    @classmethod
    def make(cls, quick: bool) -> FidelityPlan:
        if quick:
            return cls(groups=QUICK_CASES, warmup_steps=2, steps=5, probe_rounds=10)
        return cls(groups=CASES, warmup_steps=3, steps=10, probe_rounds=20)


def _row(case: Case, engine: TimedEngine, calibration: TransferCalibration, warmup: int, group: int) -> dict:
    """The contract's case keys, then where the time went: compute per rank and bubble, measured
    (medians over steps) and simulated, so an error can be traced to compute or to waiting."""
    shape = case.shape()
    result = simulate(build_schedule(shape.schedule, N_STAGES, shape.n_virtual, shape.n_microbatches),
                      calibration.costs(shape))
    measured = [account(s.events, N_STAGES) for s in engine.samples[warmup:]]
    measured_step, predicted_step = statistics.median(a["step_s"] for a in measured), result.makespan
    return {**case.to_dict(), "measured_step_s": measured_step, "predicted_step_s": predicted_step,
            "error": predicted_step / measured_step - 1.0, "link_gbps": case.link_gbps, "group": group,
            "measured_compute_s_per_rank": statistics.median(a["compute_s_per_rank"] for a in measured),
            "predicted_compute_s_per_rank": sum(result.compute_s) / N_STAGES,
            "measured_bubble": statistics.median(a["bubble"] for a in measured),
            "predicted_bubble": summarize(result)["bubble_fraction"]}


def _calibrate(probe: dict, samples) -> TransferCalibration:
    return fit_transfer(probe, CALIBRATION.shape(), [s.events for s in samples])



def run(quick: bool, out_dir: Path | None, progress: Callable[[str], None]) -> dict:
    """The emulated-link fidelity table."""
    del out_dir  # tables only: no pictures
    plan = FidelityPlan.make(quick)
    progress(f"  probing unit times ({plan.probe_rounds} rounds)")
    probe = probe_units(ModelConfig.from_dict(CALIBRATION.model()), MICROBATCH_SIZE, rounds=plan.probe_rounds)
    calibration_engine = TimedEngine(CALIBRATION.run_config())
    rows, group_calibrations = [], []
    try:
        for group_index, group in enumerate(plan.groups):
            progress(f"  group {group_index}: {len(group)} runs in rotation with the calibration run, "
                     f"{plan.warmup_steps} + {plan.steps} rounds")
            engines = []
            try:
                for case in group:
                    engines.append(TimedEngine(case.run_config()))
                first = len(calibration_engine.samples) + plan.warmup_steps
                everyone = [calibration_engine, *engines]
                for round_index in range(plan.warmup_steps + plan.steps):
                    shift = round_index % len(everyone)
                    for engine in everyone[shift:] + everyone[:shift]:
                        engine.step()
            finally:
                for engine in engines:
                    engine.close()
            calibration = _calibrate(probe, calibration_engine.samples[first:])
            group_calibrations.append({"group": group_index, **calibration.to_dict()})
            for case, engine in zip(group, engines, strict=True):
                rows.append(_row(case, engine, calibration, plan.warmup_steps, group_index))
                row = rows[-1]
                progress(f"  {case.label()}: measured {row['measured_step_s'] * 1e3:.1f} ms, predicted "
                         f"{row['predicted_step_s'] * 1e3:.1f} ms ({row['error']:+.1%}); compute/rank "
                         f"{row['measured_compute_s_per_rank'] * 1e3:.0f} / "
                         f"{row['predicted_compute_s_per_rank'] * 1e3:.0f} ms, bubble "
                         f"{row['measured_bubble']:.3f} / {row['predicted_bubble']:.3f}")
    finally:
        calibration_engine.close()
    warm = calibration_engine.samples[plan.warmup_steps:]
    overall = _calibrate(probe, warm)
    calibration_measured = statistics.median(account(s.events, N_STAGES)["step_s"] for s in warm)
    errors = [abs(r["error"]) for r in rows]
    return {
        "calibrated_on": CALIBRATION.to_dict(),
        "cases": rows,
        "median_abs_error": statistics.median(errors),
        "max_abs_error": max(errors),
        "in_sample": {"note": "the calibration run predicted from itself (in-sample; not a case)",
                      "measured_step_s": calibration_measured,
                      "predicted_step_s": overall.predict_step_s(CALIBRATION.shape()),
                      "error": overall.predict_step_s(CALIBRATION.shape()) / calibration_measured - 1.0},
        "calibration": overall.to_dict(),
        "group_calibrations": group_calibrations,
        "probe": probe,
        "model": {**BENCH_MODEL, "block_size": BLOCK_SIZE, "microbatch_size": MICROBATCH_SIZE, "P": N_STAGES},
        "warmup_steps": plan.warmup_steps, "steps": plan.steps,
        "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
        "step_convention": "pipeline window: first action start to last action end, median over steps",
    }


def to_markdown(payload: dict) -> str:
    rows = payload["cases"]
    table = markdown_table(
        ["schedule", "V", "m", "mode", "layers", "link", "measured step (ms)", "predicted (ms)", "error",
         "compute/rank meas. / pred. (ms)", "bubble meas. / pred."],
        [[r["schedule"], r["V"], r["m"], r["mode"], r["layers"],
          f"{r['link_gbps']:g} Gb/s" if r["link_gbps"] is not None else "loopback",
          f"{1e3 * r['measured_step_s']:.1f}", f"{1e3 * r['predicted_step_s']:.1f}", f"{r['error']:+.1%}",
          f"{1e3 * r['measured_compute_s_per_rank']:.0f} / {1e3 * r['predicted_compute_s_per_rank']:.0f}",
          f"{r['measured_bubble']:.3f} / {r['predicted_bubble']:.3f}"] for r in rows])
    cal, in_sample = payload["calibrated_on"], payload["in_sample"]
    link_rows = {r["mode"]: r for r in rows if r["link_gbps"] is not None}
    lines = [
        "## Simulator fidelity: predicting runs it has not seen", "",
        f"Calibrated on ONE run: P = {cal['P']}, {cal['schedule']}, V = {cal['V']}, m = {cal['m']}, "
        f"Block AttnRes {cal['mode']}, {cal['layers']} layers (model {payload['model']}). Every case below is "
        "held out (out of sample); the simulator sees only the calibration run, its per-unit probe and "
        f"the case's configuration. Median of {payload['steps']} steps after {payload['warmup_steps']} "
        "warm-up steps, runs stepped in rotation with the calibration run. error = predicted / measured - 1.", "",
        table, "",
        f"Median |error| {payload['median_abs_error']:.1%}, max |error| {payload['max_abs_error']:.1%} over "
        f"{len(rows)} held-out runs (targets: 5% and 10%). In-sample, for reference only: the calibration run "
        f"predicted from itself {1e3 * in_sample['predicted_step_s']:.1f} ms vs "
        f"{1e3 * in_sample['measured_step_s']:.1f} ms measured ({in_sample['error']:+.1%}).",
    ]
    if {"cached", "naive"} <= set(link_rows):
        cached, naive = link_rows["cached"], link_rows["naive"]
        lines += ["", f"Over the emulated {cached['link_gbps']:g} Gb/s link, Block AttnRes with the cache takes "
                      f"{1e3 * cached['measured_step_s']:.0f} ms a step and without it "
                      f"{1e3 * naive['measured_step_s']:.0f} ms "
                      f"(x{naive['measured_step_s'] / cached['measured_step_s']:.2f}; "
                      f"predicted x{naive['predicted_step_s'] / cached['predicted_step_s']:.2f})."]
    start = payload["machine"]["load_average_at_start"] if "machine" in payload else "?"
    lines += ["", f"Load average at start {start}, at end {payload['load_average_at_end']} (2 cores: above ~2 "
                  "the runs share their cores with other work)."]
    return "\n".join(lines)
