"""Emulated slow links: when a pipelined message would arrive over a link of a given bandwidth and
latency (`--link-gbps`, `--link-latency-us`). Pure standard library; the transport uses it.

An experiment on one host: the real transfer (loopback, GB/s) still happens, and the receiver then
waits until the emulated arrival. The sender computes that arrival when it posts the send and
carries it in the message, so it is never blocked itself: it goes on computing while its message
"travels". Messages from one rank to another share one link, one after the other, in the order the
sender posts them (as on a real link): a message leaves when the link is free, occupies it for
bytes / bandwidth and arrives latency later:

    depart  = max(posted, link free)        link free = depart + bytes / bandwidth
    arrival = depart + bytes / bandwidth + latency

Times are on `time.perf_counter()`, one clock for every process of a host (CLOCK_MONOTONIC on
Linux): ranks on other hosts would need synchronised clocks, which this emulation does not assume.
The simulator models the same link (`CostModel.wire_*_s`, shared links).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True, kw_only=True)
class LinkModel:
    """A point-to-point link: `gbps` gigabits per second (1e9 bits/s) and `latency_s` seconds. The
    shares (0-1, measured links only; the emulation ignores them): of a core the sender's and the
    receiver's network stack take from their compute while a message is on the wire."""

    gbps: float
    latency_s: float = 0.0
    sender_cpu_share: float = 0.0
    receiver_cpu_share: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.gbps, bool) or not isinstance(self.gbps, int | float) or not (
                math.isfinite(self.gbps) and self.gbps > 0):
            raise ValueError(f"link bandwidth {self.gbps!r} Gb/s is invalid: give a finite number > 0, e.g. 0.2")
        if isinstance(self.latency_s, bool) or not isinstance(self.latency_s, int | float) or not (
                math.isfinite(self.latency_s) and self.latency_s >= 0):
            raise ValueError(f"link latency {self.latency_s!r} s is invalid: give a finite number >= 0")
        for name in ("sender_cpu_share", "receiver_cpu_share"):
            share = getattr(self, name)
            if isinstance(share, bool) or not isinstance(share, int | float) or not 0 <= share <= 1:
                raise ValueError(f"link {name} {share!r} is invalid: give a share of a core between 0 and 1")

    @property
    def bytes_per_s(self) -> float:
        return self.gbps * 1e9 / 8

    def wire_s(self, n_bytes: int) -> float:
        """Seconds `n_bytes` occupy the link."""
        return n_bytes / self.bytes_per_s

    def message_s(self, n_bytes: int) -> float:
        """Seconds from departure to arrival of one message of `n_bytes` (idle link)."""
        return self.latency_s + self.wire_s(n_bytes)


@dataclass
class LinkClock:
    """One sender's links to its peers: when each is next free (seconds, perf_counter clock)."""

    link: LinkModel
    free_at: dict[int, float] = field(default_factory=dict)

    def arrival(self, dst: int, n_bytes: int, posted_s: float) -> float:
        """The emulated arrival of a message of `n_bytes` posted to `dst` at `posted_s`."""
        depart = max(posted_s, self.free_at.get(dst, posted_s))
        self.free_at[dst] = depart + self.link.wire_s(n_bytes)
        return self.free_at[dst] + self.link.latency_s
