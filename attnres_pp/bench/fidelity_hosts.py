"""`attnres-pp bench fidelity --hosts`: the simulator against real links between hosts.

Two hosts of one machine (`scripts/netns_cluster.py`: network namespaces, a Ray node in each, one
one-CPU rank per host by SPREAD), so every pipeline hop crosses a real veth link and real TCP.
Host 1's link is shaped by `tc` (token bucket at 0.1 / 0.5 / 2 Gb/s, both directions; plus a netem
delay where the kernel has sch_netem). Latency this kernel cannot add with tc is emulated in the
ranks (`--link-latency-us`: a message is held until it is due) on top of the real link.

What prices a message is measured on the link itself, never fitted to the runs it predicts: before
the runs, a probe (`bench.link_probe`: two gloo ranks, one per host) times messages of several
sizes in each direction on every link state the runs use, and fits one-way seconds = fixed +
bytes x s_per_byte per direction. `fixed` is the network stack's per-message cost (of which the
simulator already counts the sender's and the receiver's own work, measured in the calibration
run: the rest is the link's latency); `s_per_byte` the rate the payload gets (tbf meters whole
frames: ~1448 of 1514 bytes are payload); each direction is its own link, on which the messages
between one pair of ranks queue; the probe checks both assumptions (two messages back to back,
both directions at once) and reports how far they hold.

The compute side is calibrated on ONE run (`simulator.transfer.fit_transfer`: the unit probe scaled
to the run), and every other run is predicted; then each run in turn calibrates (rotation), so no
single run's noise sets the table. Runs: Block AttnRes cached and naive, interleaved 1f1b and GPipe
at V = 2, on the unshaped and the shaped links, with and without emulated latency; the calibration
run is 1f1b V = 1. error = predicted / measured - 1, on the pipeline window (first action start to
last action end). The rows also give the previous model (the tc rate times the frames' payload
share, behind the link fitted to the calibration run) for comparison.

The runs are made by ONE driver process in host 0's namespace (`netns_cluster.py exec`), told one
case at a time over stdin while this process shapes the link between them.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import secrets
import select
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from attnres_pp.bench.common import MICROBATCH_SIZE, account, markdown_table
from attnres_pp.bench.fidelity_cases import N_STAGES, Case
from attnres_pp.bench.link_probe import DONE as PROBE_DONE
from attnres_pp.bench.link_probe import GAP_S, REPEATS, SIZES_KIB, fit_from_dict, summarize
from attnres_pp.comm.link import LinkModel
from attnres_pp.schedule.timeline import median_action_s

# TCP payload per Ethernet frame that tc tbf meters: MTU 1500 less IPv4 (20) and TCP with timestamps
# (32) is 1448 bytes of the 1514 the frame takes with its Ethernet header (14). The previous model's.
TBF_PAYLOAD_FRACTION = 1448 / 1514
HARNESS = Path(__file__).resolve().parents[2] / "scripts" / "netns_cluster.py"
GBPS = (0.1, 0.5, 2.0)
LATENCIES_MS = (0.0, 1.0)  # the second only where the kernel has sch_netem
# V = 2: a block summary crosses a hop again on its way to later chunks, which the cache avoids
# (with V = 1 and P = 2 there is one hop and cached equals naive).
SCHEDULES = (("interleaved_1f1b", 2), ("gpipe", 2))
EMULATED_LATENCY_US = 1000.0  # added in the ranks: this kernel's tc has no netem
EMULATED_GBPS = 100.0  # the emulated link's own rate: far above the real link's, which sets the pace
CASE_TIMEOUT_S = 300
# The probe rounds per link state: idle ranks, and ranks computing meanwhile as a pipeline's do. The
# busy round prices the runs; the idle one is reported beside it.
PROBE_LOADS = ("idle", "busy")
PRICED_LOAD = "busy"
STEPS = {False: 12, True: 4}  # steps measured per case and round (after one warm-up step): {quick: steps}
ROUNDS = {False: 3, True: 1}
DRIVER_DONE = "@@host-case-done"


@dataclasses.dataclass(frozen=True)
class HostCase:
    schedule: str
    virtual: int
    mode: str  # cached | naive
    gbps: float | None = None  # None: the unshaped link
    latency_ms: float = 0.0  # tc netem delay (where the kernel has it)
    microbatches: int = 4
    layers: int = 8
    emulated_latency_us: float = 0.0  # --link-latency-us in the ranks

    def fidelity_case(self) -> Case:
        return Case(self.schedule, self.virtual, self.microbatches, self.mode, self.layers)

    @property
    def link_state(self) -> tuple[float | None, float]:
        """What the link is shaped to for this case (a probe per state)."""
        return (self.gbps, self.latency_ms)

    def emulated(self) -> LinkModel | None:
        if not self.emulated_latency_us:
            return None
        return LinkModel(gbps=EMULATED_GBPS, latency_s=self.emulated_latency_us * 1e-6)

    def run_config(self):
        run_cfg = self.fidelity_case().run_config()
        pipeline = dataclasses.replace(run_cfg.pipeline, launcher="ray", placement="SPREAD")
        if self.emulated_latency_us:
            pipeline = dataclasses.replace(pipeline, link_gbps=EMULATED_GBPS, link_latency_us=self.emulated_latency_us)
        return dataclasses.replace(run_cfg, pipeline=pipeline)

    def label(self) -> str:
        link = "unshaped" if self.gbps is None else f"{self.gbps:g} Gb/s + {self.latency_ms:g} ms"
        emulated = f" + {self.emulated_latency_us:g} us in the ranks" if self.emulated_latency_us else ""
        return f"{self.schedule} V={self.virtual} {self.mode} over {link}{emulated}"


CALIBRATION = HostCase("1f1b", 1, "cached")


def held_out_cases(latencies_ms: tuple[float, ...], quick: bool) -> list[HostCase]:
    """Every run but the calibration one: unshaped V = 2 (the schedule transfer alone), the shaped
    links, and emulated latency on the unshaped and a shaped link."""
    schedules = SCHEDULES[:1] if quick else SCHEDULES
    modes = ("cached", "naive")
    cases = [HostCase(s, v, mode) for s, v in schedules for mode in modes]
    cases += [HostCase(s, v, mode, gbps, lat) for s, v in schedules for lat in latencies_ms for gbps in GBPS
              for mode in modes]
    emulated_links = (None,) if quick else (None, 0.5)
    cases += [HostCase(s, v, mode, gbps, emulated_latency_us=EMULATED_LATENCY_US) for s, v in schedules[:1]
              for gbps in emulated_links for mode in modes]
    return cases


def measure_case(case: HostCase, steps: int) -> list[list]:
    """Inside host 0's namespace (RAY_ADDRESS set): run `case` over the cluster, return each step's
    events (after one warm-up step)."""
    from attnres_pp.bench.common import TimedEngine

    engine = TimedEngine(case.run_config())
    try:
        for _ in range(steps + 1):
            engine.step()
        nodes = engine.engine.static_extras.get("node_addresses")
    finally:
        engine.close()
    if nodes is None or len(set(nodes)) != N_STAGES:
        raise RuntimeError(f"the ranks did not land on {N_STAGES} hosts: {nodes}")
    return [s.events for s in engine.samples[1:]]


def driver_main() -> int:
    """The benchmark's driver, inside host 0's namespace: one JSON line per case on stdin
    ({"case", "steps", "out"}), that case's step events written to `out`, DRIVER_DONE printed;
    an empty line (or the end of stdin) ends it. One process for every case: one start-up."""
    for line in sys.stdin:
        if not line.strip():
            break
        request = json.loads(line)
        events = measure_case(HostCase(**request["case"]), int(request["steps"]))
        Path(request["out"]).write_text(json.dumps(events))
        print(DRIVER_DONE, flush=True)
    return 0


class _LineChild:
    """A child process told one line at a time over stdin, which answers by printing `done`; every
    wait is bounded, and an error carries the end of the child's output."""

    def __init__(self, argv: list[str], done: str, env: dict, name: str) -> None:
        self.done, self.name = done, name
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     env=env)
        self.tail = b""

    def ask(self, line: str, timeout_s: float) -> None:
        self.proc.stdin.write((line + "\n").encode())
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout_s
        done = self.done.encode()
        window = b""  # this answer's output, as much of it as can still hold the marker
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.kill()
                raise RuntimeError(f"{self.name} gave no answer within {timeout_s:.0f} s:\n{self._tail()}")
            ready, _, _ = select.select([self.proc.stdout], [], [], min(left, 1.0))
            if not ready:
                continue
            chunk = os.read(self.proc.stdout.fileno(), 65536)
            if not chunk:
                self.proc.wait(timeout=10)
                raise RuntimeError(f"{self.name} ended (exit {self.proc.returncode}):\n{self._tail()}")
            window = window[-len(done):] + chunk
            self.tail = (self.tail + chunk)[-6000:]
            if done in window:
                return

    def close(self, timeout_s: float = 60) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(b"\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=timeout_s)
            except (OSError, subprocess.TimeoutExpired):
                self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def _tail(self) -> str:
        return self.tail.decode(errors="replace")[-3000:]


class HostBench:
    """A 2-host cluster for the benchmark (and tests): shape, probe the link, run cases in host 0,
    take it down."""

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

    def _exec(self, host: int, *command: str) -> list[str]:
        return [sys.executable, str(HARNESS), "--state-dir", self.state_dir, "exec", str(host), "--", *command]

    @staticmethod
    def _env() -> dict:
        path = os.pathsep.join(filter(None, [str(HARNESS.parents[1]), os.environ.get("PYTHONPATH")]))
        return {**os.environ, "PYTHONPATH": path, "GLOO_SOCKET_IFNAME": "eth0"}

    @property
    def latency_shaping(self) -> bool:
        return bool(self.info.get("latency_shaping"))

    def shape(self, state: tuple[float | None, float]) -> None:
        gbps, latency_ms = state
        if gbps is None and not latency_ms:
            self._harness("unshape", "1")
        else:
            self._harness("shape", "1", "--gbps", str(gbps if gbps is not None else 100.0),
                          "--latency-ms", str(latency_ms))

    def probe_links(self, states: list[tuple[float | None, float]], progress: Callable[[str], None],
                    sizes_kib: tuple[int, ...] = SIZES_KIB, repeats: int = REPEATS) -> dict:
        """The link probe (`bench.link_probe`) on each link state, idle and busy: {state: {load:
        summary}}. One pair of probe ranks for every round; this process shapes the link between."""
        address = self.info["hosts"][0]["ip"]
        port = 45000 + secrets.randbelow(5000)
        rank_argv = [sys.executable, "-m", "attnres_pp.bench.link_probe", "--address", address, "--port", str(port)]
        with tempfile.TemporaryDirectory(dir="/tmp") as folder:
            log = Path(folder) / "rank1.log"
            with log.open("wb") as rank1_log:
                rank1 = subprocess.Popen(self._exec(1, *rank_argv, "--rank", "1"), stdin=subprocess.DEVNULL,
                                         stdout=rank1_log, stderr=subprocess.STDOUT, env=self._env())
            rank0 = _LineChild(self._exec(0, *rank_argv, "--rank", "0"), PROBE_DONE, self._env(), "the link probe")
            results: dict = {}
            try:
                for index, (state, load) in enumerate((state, load) for state in states for load in PROBE_LOADS):
                    self.shape(state)
                    out = f"{folder}/round{index}"
                    request = {"sizes": [k * 1024 for k in sizes_kib], "repeats": repeats, "gap_s": GAP_S,
                               "busy": load == "busy", "out": out}
                    try:
                        rank0.ask(json.dumps(request), timeout_s=CASE_TIMEOUT_S)
                    except RuntimeError as error:
                        raise RuntimeError(f"{error}\nrank 1: {log.read_text(errors='replace')[-2000:]}") from None
                    summary = summarize(*(json.loads(Path(f"{out}.{r}.json").read_text()) for r in (0, 1)))
                    results.setdefault(state, {})[load] = summary
                    fwd, bwd = summary["forward"], summary["backward"]
                    progress(f"  link probe {_state_label(state)}, {load}: 0->1 {fwd['fixed_s'] * 1e6:.0f} us + "
                             f"{fwd['gbps']:.3g} Gb/s, 1->0 {bwd['fixed_s'] * 1e6:.0f} us + {bwd['gbps']:.3g} Gb/s; "
                             f"back to back x{summary['back_to_back_over_model']:.2f}, both ways "
                             f"x{summary['both_ways_over_one_way']:.2f} of the model"
                             + (f"; streaming costs the sender {summary['cpu_share']['send']:.0%} of a core, the "
                                f"receiver {summary['cpu_share']['recv']:.0%}" if "cpu_share" in summary else ""))
            finally:
                rank0.close()
                try:
                    rank1.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    rank1.kill()
                    rank1.wait(timeout=10)
        return results

    def measure(self, cases: list[HostCase], steps: int, progress: Callable[[str], None],
                rounds: int = 1) -> dict[HostCase, list[list]]:
        """Each case's step events in each round ({case: [round 0's steps, ...]}), the link shaped for
        it, all run by one driver in host 0. Every round runs every case once, the order shifted by
        one each round, so that the machine's drift reaches every case alike and each round's runs
        can be compared among themselves."""
        code = "import sys; from attnres_pp.bench.fidelity_hosts import driver_main; sys.exit(driver_main())"
        driver = _LineChild(self._exec(0, sys.executable, "-c", code), DRIVER_DONE, self._env(), "the benchmark driver")
        measured: dict[HostCase, list[list]] = {case: [] for case in cases}
        try:
            with tempfile.NamedTemporaryFile(suffix=".json", dir="/tmp") as result:
                for round_index in range(rounds):
                    shift = round_index % len(cases)
                    for case in cases[shift:] + cases[:shift]:
                        self.shape(case.link_state)
                        started = time.monotonic()
                        request = {"case": dataclasses.asdict(case), "steps": steps, "out": result.name}
                        try:
                            driver.ask(json.dumps(request), timeout_s=CASE_TIMEOUT_S)
                        except RuntimeError as error:
                            raise RuntimeError(f"{case.label()} failed: {error}") from None
                        events = [[tuple(e) for e in step] for step in json.loads(Path(result.name).read_text())]
                        measured[case].append(events)
                        progress(f"  round {round_index + 1}/{rounds}, {case.label()}: "
                                 f"{measured_step_s(events) * 1e3:.1f} ms a step ({time.monotonic() - started:.0f} s)")
        finally:
            driver.close()
            self.shape((None, 0.0))
        return measured

    def down(self) -> None:
        self._harness("down", timeout=120)


def _state_label(state: tuple[float | None, float]) -> str:
    gbps, latency_ms = state
    return ("unshaped" if gbps is None else f"{gbps:g} Gb/s") + (f" + {latency_ms:g} ms" if latency_ms else "")


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


def chunk_compute_s(steps: list[list]) -> float:
    """Seconds of compute of one microbatch through every chunk, forward and backward: the sum over
    (action kind, chunk) of the median action's duration."""
    return sum(median_action_s(steps).values())


def measured_step_s(steps: list[list]) -> float:
    return statistics.median(account(events, N_STAGES)["step_s"] for events in steps)


def calibrate(probe: dict, case: HostCase, steps: list[list], links: dict):
    """The transferred calibration fitted to `case`'s run, over its probed links."""
    from attnres_pp.simulator.transfer import fit_messages, fit_transfer

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
    from attnres_pp.simulator.transfer import fit_transfer

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
    from attnres_pp.bench.action_probe import probe_action_cost
    from attnres_pp.bench.unit_probe import probe_units
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
           f"(`bench/action_probe.py`): forward {1e3 * payload['action_probe']['fwd_s']:.2f} ms, backward "
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
