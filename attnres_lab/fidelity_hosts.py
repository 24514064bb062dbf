"""`attnres-lab fidelity --hosts`: the simulator against real links between hosts.

Two hosts of one machine (`attnres_lab.netns_cluster`: network namespaces, a Ray node in each, one
one-CPU rank per host by SPREAD), so every pipeline hop crosses a real veth link and real TCP.
Host 1's link is shaped by `tc` (token bucket at 0.1 / 0.5 / 2 Gb/s, both directions; plus a netem
delay where the kernel has sch_netem). Latency this kernel cannot add with tc is emulated in the
ranks (`--link-latency-us`: a message is held until it is due) on top of the real link.

What prices a message is measured on the link itself, never fitted to the runs it predicts: before
the runs, a probe (`attnres_lab.link_probe`: two gloo ranks, one per host) times messages of several
sizes in each direction on every link state the runs use, and fits one-way seconds = fixed +
bytes x s_per_byte per direction. `fixed` is the network stack's per-message cost (of which the
simulator already counts the sender's and the receiver's own work, measured in the calibration
run: the rest is the link's latency); `s_per_byte` the rate the payload gets (tbf meters whole
frames: ~1448 of 1514 bytes are payload); each direction is its own link, on which the messages
between one pair of ranks queue; the probe checks both assumptions (two messages back to back,
both directions at once) and reports how far they hold.

The compute side is calibrated on ONE run (`attnres_lab.transfer_fit.fit_transfer`: the unit probe scaled
to the run), and every other run is predicted; then each run in turn calibrates (rotation), so no
single run's noise sets the table. Runs: Block AttnRes cached and naive, interleaved 1f1b and GPipe
at V = 2, on the unshaped and the shaped links, with and without emulated latency; the calibration
run is 1f1b V = 1. error = predicted / measured - 1, on the pipeline window (first action start to
last action end). The rows also give the previous model (the tc rate times the frames' payload
share, behind the link fitted to the calibration run) for comparison.

The runs (`host_cases`) are made on the cluster of `host_bench`; this module prices them and writes
the tables.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path

from attnres_lab.host_bench import HostBench, _state_label
from attnres_lab.host_cases import (  # noqa: F401 (HostCase and held_out_cases: the study's cases, for tests)
    CALIBRATION,
    EMULATED_GBPS,
    EMULATED_LATENCY_US,
    LATENCIES_MS,
    ROUNDS,
    STEPS,
    TBF_PAYLOAD_FRACTION,
    HostCase,
    chunk_compute_s,
    held_out_cases,
    measured_step_s,
)
from attnres_lab.link_probe import REPEATS, fit_from_dict
from attnres_pp.bench.common import MICROBATCH_SIZE, markdown_table
from attnres_pp.comm.link import LinkModel

PRICED_LOAD = "busy"  # the link probe's round that prices the runs (`host_bench.PROBE_LOADS`)


def probed_shape(case: HostCase, links: dict, busy_s: float, load: str = PRICED_LOAD):
    """The RunShape of `case` with the probed links of its link state (the `load` round), each
    direction its own (`busy_s`: the sender's and receiver's own per-message work, which the
    simulator prices apart)."""
    summary = links[case.link_state][load]
    share = summary.get("cpu_share", {})
    send, recv = share.get("send", 0.0), share.get("recv", 0.0)
    # The shares were measured streaming 0 -> 1; the other direction is taken to cost each role the same.
    forward = fit_from_dict(summary["forward"]).link(busy_s, send, recv)
    backward = fit_from_dict(summary["backward"]).link(busy_s, send, recv)
    return dataclasses.replace(case.fidelity_case().shape(), link=case.emulated(),
                               rank_links=((0, 1, forward), (1, 0, backward)))


def previous_link(calibration, case: HostCase) -> LinkModel | None:
    """The model before link probes: the tc link behind the link fitted to the calibration run
    (latencies add; the slower per-byte cost sets the rate; the payload gets TBF_PAYLOAD_FRACTION
    of the tbf rate); emulated latency added to the latency."""
    msg = calibration.messages
    if case.gbps is None:
        if not case.emulated_latency_us:
            return None
        return LinkModel(gbps=8.0 / msg.link_s_per_byte / 1e9 if msg.link_s_per_byte else EMULATED_GBPS,
                         latency_s=msg.link_latency_s + case.emulated_latency_us * 1e-6)
    wire = 8.0 / (case.gbps * 1e9 * TBF_PAYLOAD_FRACTION)
    return LinkModel(gbps=8.0 / max(wire, msg.link_s_per_byte) / 1e9,
                     latency_s=msg.link_latency_s + case.latency_ms * 1e-3 + case.emulated_latency_us * 1e-6)


def calibrate(probe: dict, case: HostCase, steps: list[list], links: dict):
    """The transferred calibration fitted to `case`'s run, over its probed links."""
    from attnres_lab.transfer_fit import fit_messages, fit_transfer

    # The receive work is told apart from waiting for bytes with the links as probed (busy work not yet
    # known: the whole fixed cost counted as the link's, which errs towards calling a receive a wait).
    messages = fit_messages(probe, probed_shape(case, links, 0.0), steps)
    return fit_transfer(probe, probed_shape(case, links, messages.send_fixed_s + messages.recv_fixed_s), steps)


def predict(calibration, case: HostCase, links: dict, load: str = PRICED_LOAD) -> float:
    msg = calibration.messages
    return calibration.predict_step_s(probed_shape(case, links, msg.send_fixed_s + msg.recv_fixed_s, load))


def predict_previous(calibration, case: HostCase) -> float:
    return calibration.predict_step_s(dataclasses.replace(case.fidelity_case().shape(),
                                                          link=previous_link(calibration, case)))


def evaluate(bench: HostBench, cases: list[HostCase], steps: int, probe: dict,
             progress: Callable[[str], None], rotate: bool = True, probe_repeats: int = REPEATS,
             rounds: int = 1, keep_dir: Path | None = None) -> dict:
    """Probe the links, measure CALIBRATION and `cases` in `rounds` rounds, then predict each round's
    runs from that round's calibration run: the rows (medians over rounds) and, with `rotate`, every
    run calibrating in turn."""
    runs = [CALIBRATION, *cases]
    states = list(dict.fromkeys(case.link_state for case in runs))
    links = bench.probe_links(states, progress, repeats=probe_repeats)
    measured = bench.measure(runs, steps, progress, rounds)
    if keep_dir is not None:  # for `reanalyse`: another model tried on the same measurements
        kept = keep_dir / f"attnres-fidelity-hosts-runs-{os.getpid()}.json"
        kept.write_text(json.dumps({"probe": probe, "links": [[list(state), v] for state, v in links.items()],
                                    "runs": [[dataclasses.asdict(c), measured[c]] for c in runs]}))
        progress(f"  the probes and runs are kept in {kept} (`fidelity_hosts.reanalyse` reads them)")
    result = analyse(probe, links, measured, cases, rotate, progress)
    for case, row in zip(cases, result["rows"], strict=True):
        progress(f"  {case.label()}: measured "
                 f"{row['measured_step_s'] * 1e3:.1f} ms, predicted {row['predicted_step_s'] * 1e3:.1f} ms "
                 f"({row['error']:+.1%}; idle probe {row['idle_probe_error']:+.1%}, previous model "
                 f"{row['previous_model_error']:+.1%})")
    return result


def analyse(probe: dict, links: dict, measured: dict[HostCase, list[list]], cases: list[HostCase], rotate: bool,
            progress: Callable[[str], None]) -> dict:
    """The predictions of `evaluate` from its probes and runs (`measured`: {case: [steps per round]}).
    Each round's runs are predicted from that round's calibration run; a row's figures are medians
    over rounds (its error the median of the rounds' errors)."""
    from attnres_lab.transfer_fit import fit_transfer

    runs = [CALIBRATION, *cases]
    n_rounds = len(measured[CALIBRATION])
    calibrations = [calibrate(probe, CALIBRATION, measured[CALIBRATION][r], links) for r in range(n_rounds)]
    previous = [fit_transfer(probe, CALIBRATION.fidelity_case().shape(), measured[CALIBRATION][r])
                for r in range(n_rounds)]
    rows = []
    for case in cases:
        observed = [measured_step_s(measured[case][r]) for r in range(n_rounds)]
        figures = {"predicted": [predict(calibrations[r], case, links) for r in range(n_rounds)],
                   "idle_probe": [predict(calibrations[r], case, links, "idle") for r in range(n_rounds)],
                   "previous_model": [predict_previous(previous[r], case) for r in range(n_rounds)]}
        row = {**dataclasses.asdict(case), "measured_step_s": statistics.median(observed),
               "measured_step_s_per_round": observed,
               # one microbatch through every chunk, forward and backward: where the compute transfer misses
               "measured_compute_s": statistics.median(chunk_compute_s(measured[case][r]) for r in range(n_rounds)),
               "predicted_compute_s": statistics.median(
                   sum(c.forward_s) + sum(c.backward_s) for c in (
                       calibrations[r].costs(probed_shape(case, links, 0.0)) for r in range(n_rounds)))}
        for name, values in figures.items():
            row[f"{name}_step_s"] = statistics.median(values)
            row[f"{name}_error" if name != "predicted" else "error"] = statistics.median(
                v / o - 1.0 for v, o in zip(values, observed, strict=True))
        rows.append(row)
    rotation = []
    for calibrating in runs if rotate else []:
        errors: dict[HostCase, list[float]] = {case: [] for case in runs if case != calibrating}
        for r in range(n_rounds):
            try:
                fitted = calibrate(probe, calibrating, measured[calibrating][r], links)
            except ValueError as error:  # e.g. a run whose link alone outlasts its measured step
                progress(f"  cannot calibrate on {calibrating.label()} (round {r + 1}): {error}")
                continue
            for case in errors:
                errors[case].append(predict(fitted, case, links) / measured_step_s(measured[case][r]) - 1.0)
        per_case = [statistics.median(values) for values in errors.values() if values]
        if per_case:
            rotation.append({"calibrated_on": dataclasses.asdict(calibrating), "label": calibrating.label(),
                             "median_abs_error": statistics.median(abs(e) for e in per_case),
                             "max_abs_error": max(abs(e) for e in per_case), "errors": per_case})
    in_sample = [predict(calibrations[r], CALIBRATION, links) for r in range(n_rounds)]
    return {"rows": rows, "rotation": rotation, "calibration": calibrations[0].to_dict(),
            "links": {_state_label(state): summary for state, summary in links.items()},
            "calibration_measured_step_s": statistics.median(measured_step_s(m) for m in measured[CALIBRATION]),
            "calibration_in_sample_step_s": statistics.median(in_sample), "rounds": n_rounds}


def run(quick: bool, out_dir: Path | None, progress: Callable[[str], None]) -> dict:
    del out_dir  # tables only: no pictures
    from attnres_lab.action_probe import probe_action_cost
    from attnres_lab.unit_probe import probe_units
    from attnres_pp.model.config import ModelConfig

    load_start = [round(x, 2) for x in os.getloadavg()]
    probe = probe_units(ModelConfig.from_dict(CALIBRATION.fidelity_case().model()), MICROBATCH_SIZE,
                        rounds=10 if quick else 20)
    probe["action"] = probe_action_cost(CALIBRATION.fidelity_case().model(), probe, rounds=1 if quick else 3)
    progress(f"  the runtime's cost per action beyond its units (in-process, V = 1 against V = 4): forward "
             f"{probe['action']['fwd_s'] * 1e3:.2f} ms, backward {probe['action']['bwd_s'] * 1e3:.2f} ms")
    bench = HostBench()
    try:
        latencies = LATENCIES_MS if bench.latency_shaping else LATENCIES_MS[:1]
        if not bench.latency_shaping:
            progress("  this kernel has no sch_netem: links are shaped in bandwidth only; latency is emulated in "
                     "the ranks")
        result = evaluate(bench, held_out_cases(latencies, quick), STEPS[quick], probe, progress,
                          rounds=ROUNDS[quick], keep_dir=Path(tempfile.gettempdir()))
    finally:
        bench.down()
    return {**summarise(result, bench.latency_shaping, STEPS[quick], load_start), "action_probe": probe["action"]}


def summarise(result: dict, latency_shaping: bool, steps: int, load_start: list[float]) -> dict:
    """The benchmark's JSON payload from `evaluate` (or `reanalyse`)."""
    errors = [abs(r["error"]) for r in result["rows"]]
    previous = [abs(r["previous_model_error"]) for r in result["rows"]]
    idle = [abs(r["idle_probe_error"]) for r in result["rows"]]
    every_pair = [abs(e) for entry in result["rotation"] for e in entry["errors"]]
    return {"hosts": True, "calibrated_on": dataclasses.asdict(CALIBRATION), "cases": result["rows"],
            "median_abs_error": statistics.median(errors), "max_abs_error": max(errors),
            "idle_probe_median_abs_error": statistics.median(idle), "idle_probe_max_abs_error": max(idle),
            "previous_model_median_abs_error": statistics.median(previous),
            "previous_model_max_abs_error": max(previous),
            "rotation": result["rotation"],
            "rotation_median_abs_error": statistics.median(every_pair) if every_pair else None,
            "rotation_max_abs_error": max(every_pair) if every_pair else None,
            "links": result["links"], "calibration": result["calibration"],
            "latency_shaping": latency_shaping, "rounds": result["rounds"], "steps_per_round": steps,
            "in_sample": {"measured_step_s": result["calibration_measured_step_s"],
                          "predicted_step_s": result["calibration_in_sample_step_s"]},
            "load_average_at_start": load_start, "load_average_at_end": [round(x, 2) for x in os.getloadavg()]}


def reanalyse(kept: Path, progress: Callable[[str], None] = print) -> dict:
    """`analyse` again on the probes and runs a benchmark kept (the file its output names, or the
    gzipped copy beside a committed table): a new model tried on the same measurements, no cluster
    and no root needed. Plain JSON: nothing in the file is run."""
    kept = Path(kept)
    values = json.loads(gzip.decompress(kept.read_bytes()) if kept.suffix == ".gz" else kept.read_text())
    links = {(state[0], state[1]): summary for state, summary in values["links"]}
    measured = {HostCase(**case): [[[tuple(e) for e in step] for step in steps] for steps in rounds]
                for case, rounds in values["runs"]}
    cases = [case for case in measured if case != CALIBRATION]
    return analyse(values["probe"], links, measured, cases, True, progress)


def to_markdown(payload: dict) -> str:
    rows = payload["cases"]

    def link(r: dict) -> str:
        text = "unshaped" if r["gbps"] is None else f"{r['gbps']:g} Gb/s"
        text += f" + {r['latency_ms']:g} ms" if r["latency_ms"] else ""
        return text + (f" + {r['emulated_latency_us']:g} us emulated" if r["emulated_latency_us"] else "")

    table = markdown_table(
        ["schedule", "V", "mode", "link", "measured step (ms)", "predicted (ms)", "error", "idle probe (ms)",
         "error", "previous model (ms)", "error", "compute per microbatch, measured / predicted (ms)"],
        [[r["schedule"], r["virtual"], r["mode"], link(r), f"{1e3 * r['measured_step_s']:.1f}",
          f"{1e3 * r['predicted_step_s']:.1f}", f"{r['error']:+.1%}", f"{1e3 * r['idle_probe_step_s']:.1f}",
          f"{r['idle_probe_error']:+.1%}", f"{1e3 * r['previous_model_step_s']:.1f}",
          f"{r['previous_model_error']:+.1%}",
          f"{1e3 * r['measured_compute_s']:.1f} / {1e3 * r['predicted_compute_s']:.1f}"] for r in rows])
    probes = markdown_table(
        ["link", "ranks", "0->1 fixed (us)", "0->1 Gb/s", "1->0 fixed (us)", "1->0 Gb/s", "back to back / model",
         "both ways / one way", "core share lost streaming: sender / receiver"],
        [[name, load, f"{1e6 * s['forward']['fixed_s']:.0f}", f"{s['forward']['gbps']:.3g}",
          f"{1e6 * s['backward']['fixed_s']:.0f}", f"{s['backward']['gbps']:.3g}",
          f"{s['back_to_back_over_model']:.2f}", f"{s['both_ways_over_one_way']:.2f}",
          f"{s['cpu_share']['send']:.2f} / {s['cpu_share']['recv']:.2f}" if "cpu_share" in s else "-"]
         for name, loads in payload["links"].items() for load, s in loads.items()])
    rotation = markdown_table(
        ["calibrated on", "median |error| of the others", "max |error|"],
        [[entry["label"], f"{entry['median_abs_error']:.1%}", f"{entry['max_abs_error']:.1%}"]
         for entry in payload["rotation"]])
    in_sample = payload["in_sample"]
    lines = [
        "## Simulator fidelity on real links between hosts", "",
        "Two hosts in network namespaces of one machine, one rank each, every hop over a real veth link and "
        "TCP; host 1's link shaped by tc, latency emulated in the ranks where tc cannot add it. Each link state "
        "is priced from a probe of that link (below), measured before the runs. Compute calibrated on ONE run "
        "(1f1b, V = 1, m = 4, Block AttnRes cached, 8 layers, unshaped); every row is held out. "
        f"{payload['rounds']} round(s), each running every case once (the order shifted each round) and "
        f"predicted from its own calibration run; a run is the median of {payload['steps_per_round']} steps "
        "after one warm-up; a row gives medians over rounds, its error the median of the rounds' "
        "predicted / measured - 1.", "",
        table, "",
        f"Median |error| {payload['median_abs_error']:.1%}, max |error| {payload['max_abs_error']:.1%} over "
        f"{len(rows)} held-out runs (priced from the idle probe instead: median "
        f"{payload['idle_probe_median_abs_error']:.1%}, max {payload['idle_probe_max_abs_error']:.1%}; the "
        "previous model, tc rate x payload share behind the calibration run's fitted link: median "
        f"{payload['previous_model_median_abs_error']:.1%}, max "
        f"{payload['previous_model_max_abs_error']:.1%}). In-sample, for reference: the calibration run "
        f"{1e3 * in_sample['measured_step_s']:.1f} ms measured, {1e3 * in_sample['predicted_step_s']:.1f} ms "
        f"predicted. Latency shaping (sch_netem): {'yes' if payload['latency_shaping'] else 'not in this kernel'}."
        + (f" The runtime's cost per action beyond its units, probed in-process before the runs "
           f"(`attnres_lab/action_probe.py`): forward {1e3 * payload['action_probe']['fwd_s']:.2f} ms, backward "
           f"{1e3 * payload['action_probe']['bwd_s']:.2f} ms." if payload.get("action_probe") else ""),
        "", "### The link probes", "",
        "One-way seconds = fixed + bytes / rate per direction (gloo over TCP, the fastest of the repeats), with "
        "the ranks idle and with each computing in a thread meanwhile (busy: what prices the runs); back to "
        "back: two messages in a row against the model's queueing on one link (1 = as modelled); both "
        "ways: both ranks sending at once against one direction alone (1 = full duplex).", "", probes]
    if payload["rotation"]:
        lines += ["", "### Every run calibrating in turn", "",
                  f"Over every (calibrating run, predicted run) pair: median |error| "
                  f"{payload['rotation_median_abs_error']:.1%}, max {payload['rotation_max_abs_error']:.1%}.", "",
                  rotation]
    lines += ["", f"Load average at start {payload['load_average_at_start']}, at end "
                  f"{payload['load_average_at_end']} (2 cores shared with other work: timings are noisy)."]
    return "\n".join(lines)
