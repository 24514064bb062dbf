"""`attnres-pp bench fidelity --hosts`: the simulator against real links between hosts.

Two hosts of one machine (`scripts/netns_cluster.py`: network namespaces, a Ray node in each, one
one-CPU rank per host by SPREAD), so every pipeline hop crosses a real veth link and real TCP. ONE
run on the unshaped link calibrates the simulator (`simulator.transfer.fit_transfer`: the unit probe
scaled to the run, message costs from its timeline); held-out runs on the link of host 1 shaped by
`tc` (token bucket at 0.1 / 0.5 / 2 Gb/s, both directions; plus a netem delay where the kernel has
sch_netem) are then predicted, Block AttnRes cached and naive, interleaved 1f1b and GPipe, V = 2.
error = predicted / measured - 1, on the pipeline window (first action start to last action end).

The shaped link is modelled as the tc link behind the calibrated unshaped one: per message latency
= calibrated link latency + added delay; per byte the slower of 8 / payload rate and the calibrated
seconds per byte, since TCP streams a message's bytes through the copies and the token bucket at
once. The payload rate is the tbf rate times TBF_PAYLOAD_FRACTION: tbf meters whole Ethernet frames,
of which TCP payload is 1448 of 1514 bytes (measured over a shaped veth with
`scripts/shaped_link_probe.py`: 0.955-0.958 of the rate at 0.1 Gb/s, 0.954 at 0.5 Gb/s on an idle
link; the rows also give the prediction at the full tbf rate, `tbf_rate_error`) (the
rows also give the prediction with the two per-byte costs added; on the veth link the calibrated
per-byte cost is ~0.07 ns, so the two agree to 0.1%). Where TCP departs from that model: tbf
lets a full bucket (16 KiB at low rates, ~0.2 ms of traffic at high ones) through at line rate, so
a message after an idle gap is faster by up to burst / rate; slow start after idle costs a few
round trips, negligible without added delay (RTT ~0.1 ms here); pacing splits 64 KiB segments
into MTU-size packets, CPU work the model does not see.

Each run is a driver process in host 0's namespace (`netns_cluster.py exec`), which writes its
steps' timelines to a file; this process shapes the link between runs and fits and predicts.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from attnres_pp.bench.common import MICROBATCH_SIZE, account, markdown_table
from attnres_pp.bench.fidelity_cases import N_STAGES, Case
from attnres_pp.comm.link import LinkModel

# TCP payload per Ethernet frame that tc tbf meters: MTU 1500 less IPv4 (20) and TCP with timestamps
# (32) is 1448 bytes of the 1514 the frame takes with its Ethernet header (14).
TBF_PAYLOAD_FRACTION = 1448 / 1514
HARNESS = Path(__file__).resolve().parents[2] / "scripts" / "netns_cluster.py"
GBPS = (0.1, 0.5, 2.0)
LATENCIES_MS = (0.0, 1.0)  # the second only where the kernel has sch_netem
# V = 2: a block summary crosses a hop again on its way to later chunks, which the cache avoids
# (with V = 1 and P = 2 there is one hop and cached equals naive).
SCHEDULES = (("interleaved_1f1b", 2), ("gpipe", 2))
CASE_TIMEOUT_S = 300


@dataclasses.dataclass(frozen=True)
class HostCase:
    schedule: str
    virtual: int
    mode: str  # cached | naive
    gbps: float | None = None  # None: the unshaped link
    latency_ms: float = 0.0
    microbatches: int = 4
    layers: int = 8

    def fidelity_case(self) -> Case:
        return Case(self.schedule, self.virtual, self.microbatches, self.mode, self.layers)

    def label(self) -> str:
        link = "unshaped" if self.gbps is None else f"{self.gbps:g} Gb/s + {self.latency_ms:g} ms"
        return f"{self.schedule} V={self.virtual} {self.mode} over {link}"


CALIBRATION = HostCase("1f1b", 1, "cached")


def held_out_cases(latencies_ms: tuple[float, ...], quick: bool) -> list[HostCase]:
    schedules = SCHEDULES[:1] if quick else SCHEDULES
    return [HostCase(s, v, mode, gbps, lat) for s, v in schedules for lat in latencies_ms for gbps in GBPS
            for mode in ("cached", "naive")]


def measure_case(case: HostCase, steps: int) -> list[list]:
    """Inside host 0's namespace (RAY_ADDRESS set): run `case` over the cluster, return each step's
    events (after one warm-up step)."""
    from attnres_pp.bench.common import TimedEngine

    run_cfg = case.fidelity_case().run_config()
    run_cfg = dataclasses.replace(run_cfg, pipeline=dataclasses.replace(run_cfg.pipeline, launcher="ray",
                                                                        placement="SPREAD"))
    engine = TimedEngine(run_cfg)
    try:
        for _ in range(steps + 1):
            engine.step()
        nodes = engine.engine.static_extras.get("node_addresses")
    finally:
        engine.close()
    if nodes is None or len(set(nodes)) != N_STAGES:
        raise RuntimeError(f"the ranks did not land on {N_STAGES} hosts: {nodes}")
    return [s.events for s in engine.samples[1:]]


class HostBench:
    """A 2-host cluster for the benchmark (and tests): shape, run a case in host 0, take it down."""

    def __init__(self, prefix: str = "fh", net: str = "10.213.250.0/24") -> None:
        if not HARNESS.exists():
            raise ValueError(f"--hosts needs {HARNESS} (a checkout of the repository), which is missing")
        self.state_dir = tempfile.mkdtemp(prefix="attnres-fh-", dir="/tmp")  # short: Ray's socket paths
        os.rmdir(self.state_dir)  # `up` makes it, and refuses a cluster that is already there
        self.info = json.loads(self._harness("up", "--hosts", "2", "--cpus-per-host", "1", "--prefix", prefix,
                                             "--net", net, timeout=300).stdout)

    def _harness(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        done = subprocess.run([sys.executable, str(HARNESS), "--state-dir", self.state_dir, *args],
                              capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"netns_cluster.py {' '.join(args)}: {done.stderr.strip()}")
        return done

    @property
    def latency_shaping(self) -> bool:
        return bool(self.info.get("latency_shaping"))

    def run(self, case: HostCase, steps: int) -> list[list]:
        if case.gbps is None:
            self._harness("unshape", "1")
        else:
            self._harness("shape", "1", "--gbps", str(case.gbps), "--latency-ms", str(case.latency_ms))
        with tempfile.NamedTemporaryFile(suffix=".json", dir="/tmp") as result:
            code = ("import json, sys; from attnres_pp.bench.fidelity_hosts import HostCase, measure_case; "
                    "case = HostCase(**json.loads(sys.argv[1])); "
                    "json.dump(measure_case(case, int(sys.argv[2])), open(sys.argv[3], 'w'))")
            done = subprocess.run([sys.executable, str(HARNESS), "--state-dir", self.state_dir, "exec", "0", "--",
                                   sys.executable, "-c", code, json.dumps(dataclasses.asdict(case)), str(steps),
                                   result.name], capture_output=True, text=True, timeout=CASE_TIMEOUT_S,
                                  env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                      filter(None, [str(HARNESS.parents[1]), os.environ.get("PYTHONPATH")]))})
            if done.returncode != 0:
                raise RuntimeError(f"{case.label()} failed:\n{(done.stdout + done.stderr)[-3000:]}")
            return [[tuple(e) for e in step] for step in json.loads(Path(result.name).read_text())]

    def down(self) -> None:
        self._harness("down", timeout=120)


def shaped_link(calibration, case: HostCase, series: bool = False, frames: bool = True) -> LinkModel | None:
    """The tc link after the calibrated unshaped one (module docstring): latencies add; per byte the
    slower of the two sets the rate (`series`: the two per-byte costs add instead); `frames`: the
    payload gets TBF_PAYLOAD_FRACTION of the tbf rate (else all of it)."""
    if case.gbps is None:
        return None
    msg = calibration.messages
    wire = 8.0 / (case.gbps * 1e9 * (TBF_PAYLOAD_FRACTION if frames else 1.0))
    s_per_byte = wire + msg.link_s_per_byte if series else max(wire, msg.link_s_per_byte)
    return LinkModel(gbps=8.0 / s_per_byte / 1e9, latency_s=msg.link_latency_s + case.latency_ms * 1e-3)


def predict(calibration, case: HostCase, series: bool = False, frames: bool = True) -> float:
    shape = dataclasses.replace(case.fidelity_case().shape(), link=shaped_link(calibration, case, series, frames))
    return calibration.predict_step_s(shape)


def measured_step_s(steps: list[list]) -> float:
    return statistics.median(account(events, N_STAGES)["step_s"] for events in steps)


def evaluate(bench: HostBench, cases: list[HostCase], steps: int, probe: dict,
             progress: Callable[[str], None]) -> dict:
    """Calibrate on CALIBRATION (unshaped), then measure and predict `cases`: the rows and the fit."""
    from attnres_pp.simulator.transfer import fit_transfer

    progress(f"  calibration run: {CALIBRATION.label()}")
    calibration_steps = bench.run(CALIBRATION, steps)
    calibration = fit_transfer(probe, CALIBRATION.fidelity_case().shape(), calibration_steps)
    rows = []
    for case in cases:
        measured, predicted = measured_step_s(bench.run(case, steps)), predict(calibration, case)
        series = predict(calibration, case, series=True)
        tbf_rate = predict(calibration, case, frames=False)
        rows.append({**dataclasses.asdict(case), "measured_step_s": measured, "predicted_step_s": predicted,
                     "error": predicted / measured - 1.0, "predicted_series_step_s": series,
                     "series_error": series / measured - 1.0, "predicted_tbf_rate_step_s": tbf_rate,
                     "tbf_rate_error": tbf_rate / measured - 1.0})
        progress(f"  {case.label()}: measured {measured * 1e3:.1f} ms, predicted {predicted * 1e3:.1f} ms "
                 f"({rows[-1]['error']:+.1%}; per-byte costs added: {rows[-1]['series_error']:+.1%})")
    return {"rows": rows, "calibration": calibration.to_dict(),
            "calibration_measured_step_s": measured_step_s(calibration_steps),
            "calibration_in_sample_step_s": calibration.predict_step_s(CALIBRATION.fidelity_case().shape())}


def run(quick: bool, out_dir: Path | None, progress: Callable[[str], None]) -> dict:
    del out_dir  # tables only: no pictures
    from attnres_pp.bench.unit_probe import probe_units
    from attnres_pp.model.config import ModelConfig

    load_start = [round(x, 2) for x in os.getloadavg()]
    probe = probe_units(ModelConfig.from_dict(CALIBRATION.fidelity_case().model()), MICROBATCH_SIZE,
                        rounds=10 if quick else 20)
    bench = HostBench()
    try:
        latencies = LATENCIES_MS if bench.latency_shaping else LATENCIES_MS[:1]
        if not bench.latency_shaping:
            progress("  this kernel has no sch_netem: links are shaped in bandwidth only, no added delay")
        result = evaluate(bench, held_out_cases(latencies, quick), 4 if quick else 8, probe, progress)
    finally:
        bench.down()
    errors = [abs(r["error"]) for r in result["rows"]]
    series = [abs(r["series_error"]) for r in result["rows"]]
    tbf_rate = [abs(r["tbf_rate_error"]) for r in result["rows"]]
    return {"hosts": True, "calibrated_on": dataclasses.asdict(CALIBRATION), "cases": result["rows"],
            "median_abs_error": statistics.median(errors), "max_abs_error": max(errors),
            "series_median_abs_error": statistics.median(series), "series_max_abs_error": max(series),
            "tbf_rate_median_abs_error": statistics.median(tbf_rate), "tbf_rate_max_abs_error": max(tbf_rate),
            "calibration": result["calibration"], "latency_shaping": bench.latency_shaping,
            "in_sample": {"measured_step_s": result["calibration_measured_step_s"],
                          "predicted_step_s": result["calibration_in_sample_step_s"]},
            "load_average_at_start": load_start, "load_average_at_end": [round(x, 2) for x in os.getloadavg()]}


def to_markdown(payload: dict) -> str:
    rows = payload["cases"]
    table = markdown_table(
        ["schedule", "V", "mode", "link", "measured step (ms)", "predicted (ms)", "error",
         "per-byte costs added (ms)", "error"],
        [[r["schedule"], r["virtual"], r["mode"], f"{r['gbps']:g} Gb/s + {r['latency_ms']:g} ms",
          f"{1e3 * r['measured_step_s']:.1f}", f"{1e3 * r['predicted_step_s']:.1f}", f"{r['error']:+.1%}",
          f"{1e3 * r['predicted_series_step_s']:.1f}", f"{r['series_error']:+.1%}"] for r in rows])
    in_sample = payload["in_sample"]
    return "\n".join([
        "## Simulator fidelity on real links between hosts", "",
        "Two hosts in network namespaces of one machine, one rank each, every hop over a real veth link and "
        "TCP; host 1's link shaped by tc. Calibrated on ONE run on the unshaped link (1f1b, V = 1, m = 4, "
        "Block AttnRes cached, 8 layers); every row is held out. error = predicted / measured - 1.", "",
        table, "",
        f"Median |error| {payload['median_abs_error']:.1%}, max |error| {payload['max_abs_error']:.1%} over "
        f"{len(rows)} held-out runs (per-byte costs added instead: median {payload['series_median_abs_error']:.1%}, "
        f"max {payload['series_max_abs_error']:.1%}; the payload at the full tbf rate, without the frames' "
        f"headers: median {payload['tbf_rate_median_abs_error']:.1%}, max {payload['tbf_rate_max_abs_error']:.1%})."
        f" In-sample, for reference: the calibration run "
        f"{1e3 * in_sample['measured_step_s']:.1f} ms measured, {1e3 * in_sample['predicted_step_s']:.1f} ms "
        f"predicted. Latency shaping (sch_netem): {'yes' if payload['latency_shaping'] else 'not in this kernel'}.",
        "", f"Load average at start {payload['load_average_at_start']}, at end {payload['load_average_at_end']} "
            "(2 cores shared with other work: timings are noisy).",
    ])
