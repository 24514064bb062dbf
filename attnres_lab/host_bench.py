"""The cluster of `attnres-lab fidelity --hosts`: two hosts of one machine made by the harness
(`python -m attnres_lab.netns_cluster`: network namespaces, a Ray node in each), the link between
them shaped and probed (`attnres_lab.link_probe`), and the runs made by ONE driver process in host
0's namespace (`netns_cluster exec`), told one case at a time over stdin while this process shapes
the link between them. Every wait is bounded.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import select
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import attnres_lab
import attnres_pp
from attnres_lab.fidelity_cases import N_STAGES
from attnres_lab.host_cases import HostCase, measured_step_s
from attnres_lab.link_probe import DONE as PROBE_DONE
from attnres_lab.link_probe import GAP_S, REPEATS, SIZES_KIB, summarize

HARNESS = [sys.executable, "-m", "attnres_lab.netns_cluster"]
CASE_TIMEOUT_S = 300
# The probe rounds per link state: idle ranks, and ranks computing meanwhile as a pipeline's do. The
# busy round prices the runs; the idle one is reported beside it.
PROBE_LOADS = ("idle", "busy")
DRIVER_DONE = "@@host-case-done"


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
        self.state_dir = tempfile.mkdtemp(prefix="attnres-fh-", dir="/tmp")  # short: Ray's socket paths
        os.rmdir(self.state_dir)  # `up` makes it, and refuses a cluster that is already there
        self.info = json.loads(self._harness("up", "--hosts", "2", "--cpus-per-host", "1", "--prefix", prefix,
                                             "--net", net, timeout=300).stdout)

    def _harness(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        done = subprocess.run([*HARNESS, "--state-dir", self.state_dir, *args], capture_output=True, text=True,
                              timeout=timeout, env=self._env())
        if done.returncode != 0:
            raise RuntimeError(f"netns_cluster {' '.join(args)}: {done.stderr.strip()}")
        return done

    def _exec(self, host: int, *command: str) -> list[str]:
        return [*HARNESS, "--state-dir", self.state_dir, "exec", str(host), "--", *command]

    @staticmethod
    def _env() -> dict:
        # The harness and every process in the hosts import the lab and the product this process imported.
        sources = dict.fromkeys(str(Path(package.__file__).resolve().parents[1])
                                for package in (attnres_lab, attnres_pp))
        path = os.pathsep.join(filter(None, [*sources, os.environ.get("PYTHONPATH")]))
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
        """The link probe (`attnres_lab.link_probe`) on each link state, idle and busy: {state: {load:
        summary}}. One pair of probe ranks for every round; this process shapes the link between."""
        address = self.info["hosts"][0]["ip"]
        port = 45000 + secrets.randbelow(5000)
        rank_argv = [sys.executable, "-m", "attnres_lab.link_probe", "--address", address, "--port", str(port)]
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
        code = "import sys; from attnres_lab.host_bench import driver_main; sys.exit(driver_main())"
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
