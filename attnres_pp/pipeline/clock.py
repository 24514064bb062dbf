"""The clock that times a rank's actions. On CPU the host's `perf_counter`. On a GPU the work is
asynchronous, so host time around an action measures its launch, not its run: CUDA events are
recorded on the current stream around each action and turned into seconds on this rank's own host
clock once per step (one synchronisation at the end of the step). Every rank's times are its own;
nothing compares clocks across hosts (`train.step_stats` aligns each rank's step at its start).
"""

from __future__ import annotations

import time

import torch


class HostClock:
    def start_step(self) -> None:
        pass

    def mark(self) -> float:
        return time.perf_counter()

    def resolve(self, events: list) -> None:
        pass


class CudaEventClock:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._origin: tuple | None = None  # (first event of the step, host time when it was recorded)

    def start_step(self) -> None:
        self._origin = None

    def mark(self):
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        if self._origin is None:
            self._origin = (event, time.perf_counter())
        return event

    def resolve(self, events: list) -> None:
        """Replace the events' start/end CUDA events by seconds on this rank's host clock."""
        if self._origin is None:
            return
        torch.cuda.synchronize(self.device)
        origin_event, origin_s = self._origin
        for event in events:
            if not isinstance(event.start_s, float):
                event.start_s = origin_s + origin_event.elapsed_time(event.start_s) / 1e3
                event.end_s = origin_s + origin_event.elapsed_time(event.end_s) / 1e3


def make_clock(device: torch.device):
    return CudaEventClock(device) if device.type == "cuda" else HostClock()
