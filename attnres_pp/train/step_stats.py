"""Per-step measurements of a pipelined run, from the ranks' action timestamps and byte ledgers:
the loss, tensors per forward hop, bytes sent, and the bubble (idle time over ranks x wall time)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from attnres_pp.pipeline.timeline import align_per_rank, own_clock_bubble, rank_bubbles


def fwd_hop_tensors(ledger: list[tuple[str, int, int, int, int]], n_chunks: int) -> list[int]:
    """Tensors carried on each forward hop c -> c+1 for microbatch 0, as the transport counted them."""
    counts = {hop: n for direction, hop, mb, n, _ in ledger if direction == "fwd" and mb == 0}
    return [counts.get(hop, 0) for hop in range(n_chunks - 1)]


@dataclass
class StepStatsLog:
    """Collects each step's rank results and keeps the summary figures up to date."""

    n_ranks: int
    n_chunks: int
    bubbles: list[float] = field(default_factory=list)
    last_events: list = field(default_factory=list)

    def add(self, rank_results: list[dict], n_microbatches: int) -> tuple[float, dict, dict]:
        """Returns (mean loss over the global batch, extras for summary.json, per-step metrics)."""
        losses = {mb: loss for result in rank_results for mb, loss in result["losses"].items()}
        if len(losses) != n_microbatches:
            raise RuntimeError(f"got losses of microbatches {sorted(losses)}, expected {n_microbatches} of them")
        # Each rank timed itself on its own clock (hosts' clocks are never compared): the bubble
        # uses each rank's own step window, and the trace aligns every rank's step at its start.
        events = align_per_rank([e for result in rank_results for e in result["events"]])
        ledger = [r for result in rank_results for r in result["ledger"]]
        bubble = own_clock_bubble(events, self.n_ranks)
        self.bubbles.append(bubble)
        self.last_events = events
        after_first = self.bubbles[1:] or self.bubbles
        extras = {
            "fwd_hop_tensors": fwd_hop_tensors(ledger, self.n_chunks),
            "bytes_sent_per_step": sum(r[4] for r in ledger),
            "bubble_fraction": statistics.median(after_first),
            "cache_peak_bytes_per_rank": [result["cache_peak_bytes"] for result in rank_results],
        }
        metrics = {"bubble_fraction": bubble, "rank_bubbles": [round(b, 4) for b in rank_bubbles(events, self.n_ranks)],
                   "grad_norm": rank_results[0]["grad_norm"]}
        return sum(losses.values()) / n_microbatches, extras, metrics
