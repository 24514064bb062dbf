"""Per-step measurements of a pipelined run from the scalars each rank reports (`StepReply`): the loss,
tensors per forward hop, bytes sent, the bubble (idle time over the ranks' own step windows) and the
bytes the driver exchanged with the ranks. A rank sends its action timeline only when asked (the
traced step, or every step for the benchmarks), so a step's requests and replies stay scalars."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import NamedTuple


class StepReply(NamedTuple):
    """One rank's report of one training step. A tuple on the wire (no field names): small.

    loss_sum / n_losses: the sum and number of microbatch losses it computed (the rank of the last
    chunk; 0 elsewhere). busy_s: time in F and B actions; first_s / last_s: its first action's start
    and last action's end on this rank's own clock (`pipeline.clock`: perf_counter, or CUDA events
    converted to it on a GPU; clocks of different ranks are never compared). hop_tensors: (hop c,
    tensors) of the forward hops it sent for microbatch 0."""

    rank: int
    loss_sum: float
    n_losses: int
    grad_norm: float
    busy_s: float
    first_s: float
    last_s: float
    bytes_sent: int
    hop_tensors: tuple[tuple[int, int], ...]
    cache_peak_bytes: int
    peak_rss_bytes: int
    events: tuple | None  # (rank, action name, start_s, end_s, category) per action, when asked
    memory: dict | None = None  # the rank's `memory_per_rank` entry (`train.memory_report`)
    tp_bytes: int = 0  # what its tensor-parallel collectives send per step (`pipeline.tp_bytes`)
    moe: dict | None = None  # its MoE sublayers' loads (summed over dp) and aux losses (`StageWorker.balance_experts`)


def fwd_hop_tensors(ledger: list[tuple[str, int, int, int, int]], n_chunks: int) -> list[int]:
    """Tensors carried on each forward hop c -> c+1 for microbatch 0, as the transport counted them."""
    counts = {hop: n for direction, hop, mb, n, _ in ledger if direction == "fwd" and mb == 0}
    return [counts.get(hop, 0) for hop in range(n_chunks - 1)]


def replies_bubble(replies: list[StepReply]) -> float:
    """1 - compute / (sum over ranks of each rank's own step window, its first action's start to its
    last action's end): no rank's clock is compared with another's, so it holds for ranks on
    different hosts (`timeline.own_clock_bubble` over the replies' scalars)."""
    windows = sum(r.last_s - r.first_s for r in replies)
    busy = sum(r.busy_s for r in replies)
    return 1.0 - busy / windows if windows > 0 else 0.0


def rank_bubbles(replies: list[StepReply]) -> list[float]:
    """Each rank's bubble on its own clock: 1 - its compute / its own step window, in rank order."""
    return [1.0 - r.busy_s / (r.last_s - r.first_s) if r.last_s > r.first_s else 0.0
            for r in sorted(replies, key=lambda r: r.rank)]


@dataclass
class StepStatsLog:
    """Collects each step's rank replies and keeps the summary figures up to date. `replica0_ranks`:
    the global ranks of the first replica (the hop counts are read from them)."""

    n_chunks: int
    replica0_ranks: list[int]
    bubbles: list[float] = field(default_factory=list)
    driver_bytes: list[int] = field(default_factory=list)
    trace_step_bytes: int | None = None
    last_events: list = field(default_factory=list)

    def add(self, replies: list[StepReply], n_losses: int, driver_bytes: int,
            traced: bool) -> tuple[float, dict, dict]:
        """`n_losses`: microbatch losses the step must have (D x m). Returns (mean loss over the
        global batch, extras for summary.json, per-step metrics)."""
        got = sum(r.n_losses for r in replies)
        if got != n_losses:
            raise RuntimeError(f"the ranks reported {got} microbatch losses, expected {n_losses}")
        bubble = replies_bubble(replies)
        self.bubbles.append(bubble)
        # Each rank's own clock (one clock per host; `train.engine.Engine` aligns the trace of ranks on
        # several hosts, and the benchmarks, on one host, compare the ranks' events as they are).
        self.last_events = [e for r in replies for e in (r.events or ())]
        if traced:
            self.trace_step_bytes = driver_bytes
        else:
            self.driver_bytes.append(driver_bytes)
        hops = {hop: n for r in replies if r.rank in self.replica0_ranks for hop, n in r.hop_tensors}
        after_first = self.bubbles[1:] or self.bubbles
        extras = {
            "fwd_hop_tensors": [hops.get(hop, 0) for hop in range(self.n_chunks - 1)],
            "bytes_sent_per_step": sum(r.bytes_sent for r in replies),
            # the pipeline hop bytes each global rank sent (a tp rank: its sequence shard's)
            "bytes_sent_per_step_per_rank": [r.bytes_sent for r in sorted(replies, key=lambda r: r.rank)],
            # the tensor-parallel collectives' bytes, all ranks (0 without tensor parallelism)
            "tp_bytes_per_step": sum(r.tp_bytes for r in replies),
            "bubble_fraction": statistics.median(after_first),
            "cache_peak_bytes_per_rank": [r.cache_peak_bytes for r in replies],
            "peak_rss_bytes_per_rank": [r.peak_rss_bytes for r in replies],
            "memory_per_rank": [r.memory for r in sorted(replies, key=lambda r: r.rank)],
            # The traced step also carries every rank's timeline: reported apart.
            "driver_bytes_per_step": statistics.median(self.driver_bytes) if self.driver_bytes else driver_bytes,
            "driver_bytes_trace_step": self.trace_step_bytes,
        }
        metrics = {"bubble_fraction": bubble, "rank_bubbles": [round(b, 4) for b in rank_bubbles(replies)],
                   "grad_norm": replies[0].grad_norm, "driver_bytes": driver_bytes}
        moe_extras, moe_metrics = expert_stats([r.moe for r in replies if r.rank in self.replica0_ranks],
                                               [r.moe for r in replies])
        extras.update(moe_extras)
        metrics.update(moe_metrics)
        return sum(r.loss_sum for r in replies) / n_losses, extras, metrics


def expert_stats(replica0: list[dict | None], every: list[dict | None]) -> tuple[dict, dict]:
    """summary.json's and metrics.jsonl's MoE entries from the ranks' `moe` reports: the step's
    tokens per expert of each MoE sublayer (summed over the replicas; read from replica 0's ranks,
    which hold every layer once), max / mean load per layer, the mean aux loss of every rank's
    microbatches and sublayers, and under expert parallelism `moe_all_to_all_s` (the rank that
    spent longest in its dispatch and combine) and `moe_all_to_all_bytes` (what every rank sent
    off itself), the latter also in summary.json as `expert_all_to_all_bytes_per_step` (dispatch and
    combine rows, forward and backward, all ranks: `ExpertSlice.sent_bytes`). Empty without MoE
    sublayers."""
    from attnres_pp.model.moe import expert_load_stats

    loads = {name: load for report in replica0 if report for name, load in report["loads"].items()}
    aux = [(report["aux_sum"], report["aux_count"]) for report in every if report]
    extras, metrics = expert_load_stats(loads, aux)
    exchanges = [report for report in every if report and "all_to_all_s" in report]
    if exchanges:  # expert parallelism: the busiest rank's all-to-all seconds, every rank's bytes
        metrics["moe_all_to_all_s"] = max(report["all_to_all_s"] for report in exchanges)
        metrics["moe_all_to_all_bytes"] = sum(report["all_to_all_bytes"] for report in exchanges)
        extras["expert_all_to_all_bytes_per_step"] = metrics["moe_all_to_all_bytes"]
    return extras, metrics
