"""`attnres-lab fidelity --tp`: the simulator's tensor-parallel terms against measured runs.

Runs of T = 2 tp ranks (local launcher, gloo, one thread per rank, P = 1: the two ranks fill this
machine's two cores) with and without sequence parallelism, across schedule, V, m, payload mode and
layers, predicted out of sample:
1. the units of a chunk (`attnres_lab.unit_probe`) are scaled to ONE calibration run without tensor
   parallelism (`attnres_lab.fidelity`'s: P = 2, 1f1b, V = 1, m = 4, Block AttnRes cached, 8 layers);
2. a probe of a T = 2 group (`attnres_lab.tp_probe`, before the runs) measures each collective kind's
   ring link and one split layer's time alone, from which the host's cost per tp layer (beyond its
   share of the work and its collectives) is derived;
3. a probe in the runtime (`probe_layers_in_runs`, before the runs): short runs of a standard
   residual model at 2 and 4 layers, T = 1 and T = 2 with and without sequence parallelism, whose
   F and B per microbatch differ by two layers: the same host cost, as the runtime pays it (its
   activation meter's hooks on every saved tensor, which a DTensor layer has more of, included);
4. each run is simulated with the simulator's tp terms (`simulator.tensor_parallel`): the layer's
   work 1/T, per-token work 1/T under sequence parallelism, the layer's collectives priced on the
   probed links, and the host cost per layer from either probe. Runs without tensor parallelism
   (P = 1) are predicted too, as controls: their error is the transfer's own.
All runs are stepped in rotation with the calibration run, the order shifting each round.
error = predicted / measured - 1 of the median pipeline window. The probes and every step's events
are kept (`reanalyse` recomputes the table from the file, no runs).
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import statistics
from collections.abc import Callable
from pathlib import Path

from attnres_lab.fidelity_cases import BLOCK_SIZE
from attnres_lab.fidelity_cases import Case as CalibrationCase
from attnres_lab.tp_probe import costs_from_probe, host_costs, run_tp_probe
from attnres_lab.transfer_fit import fit_transfer
from attnres_lab.unit_probe import probe_units
from attnres_pp.bench.common import BENCH_MODEL, MICROBATCH_SIZE, TimedEngine, markdown_table, run_config
from attnres_pp.model.config import ModelConfig
from attnres_pp.schedule.timeline import account
from attnres_pp.simulator.transfer import RunShape

CALIBRATION = CalibrationCase("1f1b", 1, 4, "cached", 8)


@dataclasses.dataclass(frozen=True)
class TpCase:
    """One run at P = 1: T tp ranks, `sp` sequence parallel (meaningless at T = 1)."""

    schedule: str
    virtual: int
    microbatches: int
    mode: str  # standard | naive | cached
    layers: int
    tensor_parallel: int
    sp: bool = True

    def model(self) -> dict:
        return CalibrationCase(self.schedule, self.virtual, self.microbatches, self.mode, self.layers).model()

    def shape(self, tp_costs=None) -> RunShape:
        return RunShape(model=ModelConfig.from_dict(self.model()), schedule=self.schedule, n_stages=1,
                        n_virtual=self.virtual, n_microbatches=self.microbatches, microbatch_size=MICROBATCH_SIZE,
                        cache=self.mode == "cached", tensor_parallel=self.tensor_parallel, sequence_parallel=self.sp,
                        tp_costs=tp_costs)

    def run_config(self):
        run_cfg = run_config(self.model(), stages=1, virtual=self.virtual, schedule=self.schedule,
                             microbatches=self.microbatches, cache=self.mode == "cached")
        if self.tensor_parallel == 1:
            return run_cfg
        return dataclasses.replace(run_cfg, pipeline=dataclasses.replace(
            run_cfg.pipeline, tensor_parallel=self.tensor_parallel, sequence_parallel=self.sp))

    def label(self) -> str:
        tp = f"T={self.tensor_parallel}{' SP' if self.sp else ' no SP'}" if self.tensor_parallel > 1 else "T=1"
        return f"{self.schedule} V={self.virtual} m={self.microbatches} {self.mode} L={self.layers} {tp}"


CASES = (
    TpCase("1f1b", 1, 4, "cached", 8, 2, True),
    TpCase("1f1b", 1, 4, "cached", 8, 2, False),
    TpCase("1f1b", 1, 8, "standard", 8, 2, True),
    TpCase("gpipe", 1, 4, "cached", 16, 2, True),
    TpCase("interleaved_1f1b", 2, 4, "cached", 8, 2, True),
    TpCase("1f1b", 1, 8, "naive", 16, 2, False),
    TpCase("zb_h1", 1, 4, "cached", 8, 2, True),
    TpCase("interleaved_zb", 2, 4, "standard", 8, 2, False),
    # controls: the same shapes without tensor parallelism
    TpCase("1f1b", 1, 4, "cached", 8, 1),
    TpCase("1f1b", 1, 8, "standard", 8, 1),
    TpCase("gpipe", 1, 4, "cached", 16, 1),
)
QUICK_CASES = (CASES[0], CASES[1], CASES[2], CASES[8])


LAYER_PROBE_LAYERS = (2, 4)  # two runs a tp plan's per-layer cost is the difference of
LAYER_PROBE_PLANS = {"whole": (1, True), "sp": (2, True), "no_sp": (2, False)}  # plan: (T, SP)
# The layer probe's runs take a few ms a step, and a difference of two medians is noisier than
# either: they run three times the cases' steps.
LAYER_PROBE_STEPS_PER_STEP = 3


def layer_probe_case(plan: str, layers: int) -> TpCase:
    t, sp = LAYER_PROBE_PLANS[plan]
    return TpCase("1f1b", 1, 2, "standard", layers, t, sp)


def _stepped_in_rotation(configs: dict, rounds: int) -> dict:
    """{key: TimedEngine} of `configs`' runs, each stepped `rounds` times in rotation (every run once
    a round, the order shifted by one each round, so drift falls on all alike), then closed."""
    engines = {}
    try:
        for key, run_cfg in configs.items():
            engines[key] = TimedEngine(run_cfg)
        order = list(engines)
        for round_index in range(rounds):
            shift = round_index % len(order)
            for key in order[shift:] + order[:shift]:
                engines[key].step()
    finally:
        for engine in engines.values():
            engine.close()
    return engines


def probe_layers_in_runs(warmup: int, steps: int) -> dict:
    """Every step's events of the layer probe's runs, {plan: {layers: [events per step]}}, stepped
    in rotation (`layer_costs` reads them)."""
    engines = _stepped_in_rotation({(plan, layers): layer_probe_case(plan, layers).run_config()
                                    for plan in LAYER_PROBE_PLANS for layers in LAYER_PROBE_LAYERS}, warmup + steps)
    return {plan: {str(layers): [s.events for s in engines[plan, layers].samples[warmup:]]
                   for layers in LAYER_PROBE_LAYERS} for plan in LAYER_PROBE_PLANS}


def layer_costs(layer_runs: dict) -> dict:
    """{plan: {"fwd"|"bwd": seconds}}: one layer's F and B per microbatch in the runtime, the
    difference of the median F (B) of the runs at 4 and 2 layers over the 2 layers between them.
    A standard residual's two adds per layer ride along (about 10 us at these sizes, 1/T of them
    under sequence parallelism)."""
    low, high = (str(n) for n in LAYER_PROBE_LAYERS)
    out = {}
    for plan, runs in layer_runs.items():
        out[plan] = {}
        for direction, prefix in (("fwd", "F"), ("bwd", "B")):
            medians = {n: statistics.median(e[3] - e[2] for step in runs[n] for e in step
                                            if e[4] == "compute" and e[1].startswith(prefix)) for n in (low, high)}
            out[plan][direction] = (medians[high] - medians[low]) / (int(high) - int(low))
    return out


def run(quick: bool, out_dir: Path | None, progress: Callable[[str], None]) -> dict:
    """Probe, step every run in rotation, keep what was measured, then `analyse`."""
    cases = QUICK_CASES if quick else CASES
    warmup, steps, rounds = (2, 5, 10) if quick else (3, 8, 20)
    model = CALIBRATION.model()
    progress(f"  probing unit times ({rounds} rounds)")
    units = probe_units(ModelConfig.from_dict(model), MICROBATCH_SIZE, rounds=rounds)
    progress("  probing a T = 2 group: collectives and one split layer")
    tp_probe = run_tp_probe(model, MICROBATCH_SIZE, repeats=rounds)
    progress("  probing the runtime's cost per layer at T = 1 and T = 2 (2 and 4 layers)")
    layer_runs = probe_layers_in_runs(warmup, LAYER_PROBE_STEPS_PER_STEP * steps)
    progress(f"  {len(cases)} runs in rotation with the calibration run, {warmup} + {steps} rounds")
    engines = _stepped_in_rotation({None: CALIBRATION.run_config(), **{case: case.run_config() for case in cases}},
                                   warmup + steps)
    kept = {"units": units, "tp_probe": tp_probe, "layer_runs": layer_runs, "warmup": warmup,
            "calibration": [s.events for s in engines[None].samples[warmup:]],
            "runs": [[dataclasses.asdict(case), [s.events for s in engines[case].samples[warmup:]]] for case in cases]}
    payload = analyse(kept, progress)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / "runs.json.gz"
        path.write_bytes(gzip.compress(json.dumps(kept).encode()))
        payload["kept"] = str(path)
        progress(f"  the probes and runs are kept in {path} (`fidelity_tp.reanalyse` reads it)")
    return payload


def analyse(kept: dict, progress: Callable[[str], None] = print) -> dict:
    """The table from what `run` measured (or `reanalyse` read back)."""
    calibration_shape = CALIBRATION.shape()
    calibration = fit_transfer(kept["units"], calibration_shape, [[tuple(e) for e in s] for s in kept["calibration"]])
    tp_costs = costs_from_probe(kept["tp_probe"])  # the host cost of the split layer alone
    probe = kept["tp_probe"]
    in_runs = layer_costs(kept["layer_runs"])
    runtime_host = host_costs(in_runs, calibration_shape.tokens, calibration_shape.model.d_model,
                              calibration_shape.dtype_bytes, probe["group"], tp_costs.links)
    runtime_costs = dataclasses.replace(tp_costs, layer_host_s=runtime_host)
    rows = []
    for case_dict, samples in kept["runs"]:
        case = TpCase(**case_dict)
        events = [[tuple(e) for e in s] for s in samples]
        measured = statistics.median(account(e, 1)["step_s"] for e in events)
        compute = statistics.median(account(e, 1)["compute_s_per_rank"] for e in events)
        terms = calibration.predict_step_s(case.shape())  # work shared, collectives and host left out
        wire = calibration.predict_step_s(case.shape(dataclasses.replace(
            tp_costs, layer_host_s={p: {"fwd": 0.0, "bwd": 0.0} for p in ("sp", "no_sp")})))
        alone = calibration.predict_step_s(case.shape(tp_costs))
        full = calibration.predict_step_s(case.shape(runtime_costs))
        rows.append({**dataclasses.asdict(case), "label": case.label(), "measured_step_s": measured,
                     "measured_compute_s": compute / case.tensor_parallel if case.tensor_parallel > 1 else compute,
                     "work_only_s": terms, "work_only_error": terms / measured - 1.0,
                     "collectives_s": wire, "collectives_error": wire / measured - 1.0,
                     "layer_alone_s": alone, "layer_alone_error": alone / measured - 1.0,
                     "predicted_step_s": full, "error": full / measured - 1.0})
        progress(f"  {case.label()}: measured {measured * 1e3:.1f} ms; work shared {terms * 1e3:.1f} "
                 f"({terms / measured - 1:+.1%}), + collectives {wire * 1e3:.1f} ({wire / measured - 1:+.1%}), "
                 f"+ host (layer alone) {alone * 1e3:.1f} ({alone / measured - 1:+.1%}), + host (in the runtime) "
                 f"{full * 1e3:.1f} ms ({full / measured - 1:+.1%})")
    held_out = [r for r in rows if r["tensor_parallel"] > 1]
    controls = [r for r in rows if r["tensor_parallel"] == 1]

    def spread(key: str, of: list[dict]) -> dict:
        errors = [abs(r[key]) for r in of]
        return {"median_abs": statistics.median(errors), "max_abs": max(errors)} if errors else {}

    return {"calibrated_on": CALIBRATION.to_dict(), "cases": rows, "tp_probe": kept["tp_probe"],
            "summary": {"tp_runs": len(held_out), "work_only": spread("work_only_error", held_out),
                        "collectives": spread("collectives_error", held_out),
                        "layer_alone": spread("layer_alone_error", held_out), "full": spread("error", held_out),
                        "controls": spread("error", controls)},
            "layer_in_runs_s": in_runs, "layer_host_in_runs_s": runtime_host,
            "calibration": calibration.to_dict(), "warmup_steps": kept["warmup"],
            "steps": len(kept["calibration"]),
            "model": {**BENCH_MODEL, "block_size": BLOCK_SIZE, "microbatch_size": MICROBATCH_SIZE},
            "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
            "step_convention": "pipeline window: first action start to last action end, median over steps"}


def reanalyse(kept: Path, progress: Callable[[str], None] = print) -> dict:
    """`analyse` again on a kept file (`runs.json.gz` beside the results, or its committed copy).
    Plain JSON: nothing in the file is run."""
    kept = Path(kept)
    values = json.loads(gzip.decompress(kept.read_bytes()) if kept.suffix == ".gz" else kept.read_text())
    return analyse(values, progress)


def to_markdown(payload: dict) -> str:
    rows, summary, probe = payload["cases"], payload["summary"], payload["tp_probe"]
    table = markdown_table(
        ["run", "measured step (ms)", "work shared only (ms)", "error", "+ collectives (ms)", "error",
         "+ host, layer alone (ms)", "error", "+ host, in the runtime (ms)", "error"],
        [[r["label"], f"{1e3 * r['measured_step_s']:.1f}", f"{1e3 * r['work_only_s']:.1f}",
          f"{r['work_only_error']:+.1%}", f"{1e3 * r['collectives_s']:.1f}", f"{r['collectives_error']:+.1%}",
          f"{1e3 * r['layer_alone_s']:.1f}", f"{r['layer_alone_error']:+.1%}",
          f"{1e3 * r['predicted_step_s']:.1f}", f"{r['error']:+.1%}"] for r in rows])
    links = markdown_table(
        ["collective", "latency per ring step (us)", "rate (Gb/s)", "largest residual"],
        [[kind, f"{1e6 * v['latency_s']:.0f}", f"{v['bytes_per_s'] * 8 / 1e9:.2f}", f"{v['max_rel_residual']:.0%}"]
         for kind, v in probe["links"].items()])
    alone, alone_host = probe["layer_s"], probe["layer_host_s"]
    runs, runs_host = payload["layer_in_runs_s"], payload["layer_host_in_runs_s"]

    def ms(pair: dict) -> str:
        return f"{1e3 * pair['fwd']:.2f} / {1e3 * pair['bwd']:.2f}"

    names = {"whole": "whole (T = 1)", "sp": f"T = {probe['group']}, SP", "no_sp": f"T = {probe['group']}, no SP"}
    layers = markdown_table(
        ["layer", "alone, fwd / bwd (ms)", "host cost, alone (ms)", "in the runtime, fwd / bwd (ms)",
         "host cost, in the runtime (ms)"],
        [[names[plan], ms(alone[plan]), ms(alone_host[plan]) if plan in alone_host else "",
          ms(runs[plan]), ms(runs_host[plan]) if plan in runs_host else ""] for plan in names])
    cal = payload["calibrated_on"]

    def figures(key: str) -> str:
        s = summary[key]
        return f"{s['median_abs']:.1%} median, {s['max_abs']:.1%} max" if s else "none"

    return "\n".join([
        "## Simulator fidelity under tensor parallelism", "",
        f"Calibrated on ONE run without tensor parallelism: P = {cal['P']}, {cal['schedule']}, V = {cal['V']}, "
        f"m = {cal['m']}, Block AttnRes {cal['mode']}, {cal['layers']} layers (model {payload['model']}). Every run "
        "below is held out. Four models, each adding a term: the layer's work divided as the simulator's tp "
        "terms divide it (work shared only); + the layer's collectives priced on the probed links; + the host's "
        "cost per tp layer from the probe of one split layer alone, or instead from the probe in the runtime "
        "(runs of 2 and 4 layers, standard residual, m = 2: none of them a run below). The T = 1 rows are "
        f"controls (no tp term applies). Median of {payload['steps']} steps after {payload['warmup_steps']} "
        "warm-up steps, runs stepped in rotation. error = predicted / measured - 1.", "",
        table, "",
        f"Over the {summary['tp_runs']} tensor-parallel runs: work shared only {figures('work_only')}; + "
        f"collectives {figures('collectives')}; + host (layer alone) {figures('layer_alone')}; + host (in the "
        f"runtime) {figures('full')}. Controls (T = 1): {figures('controls')}.", "",
        "The probe of a T = 2 group (before the runs): each collective kind's ring link, fitted over "
        "16 KiB - 4 MiB buffers,", "", links, "",
        "and one layer of the calibration's width and microbatch, alone and in the runtime:", "", layers, "",
        f"Load average at end {payload['load_average_at_end']} (2 cores).",
    ])
