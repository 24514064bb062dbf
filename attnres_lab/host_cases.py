"""The runs of `attnres-lab fidelity --hosts` as data: a `HostCase` (schedule, V, payload mode, the
link's shaping and the latency emulated in the ranks), the calibration run, the held-out runs, and
a run's measured step and compute.
"""

from __future__ import annotations

import dataclasses
import statistics

from attnres_lab.fidelity_cases import N_STAGES, Case
from attnres_pp.comm.link import LinkModel
from attnres_pp.schedule.timeline import account, median_action_s

# TCP payload per Ethernet frame that tc tbf meters: MTU 1500 less IPv4 (20) and TCP with timestamps
# (32) is 1448 bytes of the 1514 the frame takes with its Ethernet header (14). The previous model's.
TBF_PAYLOAD_FRACTION = 1448 / 1514
GBPS = (0.1, 0.5, 2.0)
LATENCIES_MS = (0.0, 1.0)  # the second only where the kernel has sch_netem
# V = 2: a block summary crosses a hop again on its way to later chunks, which the cache avoids
# (with V = 1 and P = 2 there is one hop and cached equals naive).
SCHEDULES = (("interleaved_1f1b", 2), ("gpipe", 2))
EMULATED_LATENCY_US = 1000.0  # added in the ranks: this kernel's tc has no netem
EMULATED_GBPS = 100.0  # the emulated link's own rate: far above the real link's, which sets the pace
STEPS = {False: 12, True: 4}  # steps measured per case and round (after one warm-up step): {quick: steps}
ROUNDS = {False: 3, True: 1}


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


def chunk_compute_s(steps: list[list]) -> float:
    """Seconds of compute of one microbatch through every chunk, forward and backward: the sum over
    (action kind, chunk) of the median action's duration."""
    return sum(median_action_s(steps).values())


def measured_step_s(steps: list[list]) -> float:
    return statistics.median(account(events, N_STAGES)["step_s"] for events in steps)
