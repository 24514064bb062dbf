"""Discrete-event execution of a lowered schedule under a cost model.

Each rank runs its action list in order on its own clock. F and B (or I and W) take their chunk's
cost. A send
never blocks: its message arrives link-time later (with overlap_comm=False the sender is also busy
for the link time). A receive completes at max(now, arrival); if its send has not run yet, the rank
parks until it has. With no shared resources between ranks, the order in which ranks are advanced
does not change any time, so a worklist of runnable ranks replaces a global event heap: each
action is visited once, O(actions) in all.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

from attnres_pp.pipeline.ir import ActionKind, Schedule
from attnres_pp.pipeline.passes import insert_comm
from attnres_pp.pipeline.trace import TimelineEvent
from attnres_pp.pipeline.validate import ScheduleError, validate
from attnres_pp.simulator.costs import CostModel

_COMPUTE, _SEND, _RECV = 0, 1, 2


@dataclass(frozen=True)
class SimResult:
    """starts[r][i] / ends[r][i]: seconds at which action i of rank r began and ended."""

    schedule: Schedule
    costs: CostModel
    starts: list[list[float]]
    ends: list[list[float]]
    compute_s: list[float]  # per rank, seconds spent in F and B (or I and W)
    wall_s: float

    @property
    def makespan(self) -> float:
        return max((ends[-1] for ends in self.ends if ends), default=0.0)

    def events(self) -> Iterator[TimelineEvent]:
        """Every action as a timeline event (zero-length sends included)."""
        for pp_rank, actions in enumerate(self.schedule.rank_actions):
            for action, start, end in zip(actions, self.starts[pp_rank], self.ends[pp_rank], strict=True):
                yield TimelineEvent(pp_rank, str(action), start, end,
                                    "compute" if action.is_compute else "comm")


def _encode(schedule: Schedule, costs: CostModel) -> list[list[tuple[int, float, int]]]:
    """Per rank (op, cost, message slot): plain tuples keep the hot loop free of attribute lookups.

    A message's slot is 2 * (sending chunk * m + microbatch), + 1 for the backward direction.
    """
    n_microbatches = schedule.n_microbatches
    fwd, bwd, hop_fwd, hop_bwd = costs.forward_s, costs.backward_s, costs.hop_fwd_s, costs.hop_bwd_s
    kind_f, kind_b, send_f = ActionKind.F, ActionKind.B, ActionKind.SEND_F
    recv_f, send_b = ActionKind.RECV_F, ActionKind.SEND_B
    kind_i, kind_w = ActionKind.I, ActionKind.W
    input_s, weight_s = costs.split_s
    encoded = []
    for actions in schedule.rank_actions:
        ops = []
        append = ops.append
        for action in actions:
            kind, c, mb = action.kind, action.chunk_index, action.microbatch_index
            if kind is kind_f:
                append((_COMPUTE, fwd[c], 0))
            elif kind is kind_b:
                append((_COMPUTE, bwd[c], 0))
            elif kind is kind_i:
                append((_COMPUTE, input_s[c], 0))
            elif kind is kind_w:
                append((_COMPUTE, weight_s[c], 0))
            elif kind is send_f:
                append((_SEND, hop_fwd[c], 2 * (c * n_microbatches + mb)))
            elif kind is recv_f:
                append((_RECV, 0.0, 2 * ((c - 1) * n_microbatches + mb)))
            elif kind is send_b:
                append((_SEND, hop_bwd[c - 1], 2 * (c * n_microbatches + mb) + 1))
            else:
                append((_RECV, 0.0, 2 * ((c + 1) * n_microbatches + mb) + 1))
        encoded.append(ops)
    return encoded


def simulate(schedule: Schedule, costs: CostModel) -> SimResult:
    """Execute `schedule` (lowered here if it is compute-only) and time every action.

    Raises ScheduleError (with the validator's step x rank table) if the schedule deadlocks.
    """
    started = time.perf_counter()
    if costs.n_chunks != schedule.n_chunks:
        raise ValueError(f"cost model covers {costs.n_chunks} chunks, schedule has {schedule.n_chunks}")
    lowered = schedule if schedule.has_comm else insert_comm(schedule)
    encoded = _encode(lowered, costs)
    n_stages, overlap = lowered.n_stages, costs.overlap_comm
    n_slots = 2 * lowered.n_chunks * lowered.n_microbatches
    arrival = [-1.0] * n_slots  # -1: the send has not run yet
    waiting = [-1] * n_slots  # the rank parked on this message, if any
    starts = [[0.0] * len(ops) for ops in encoded]
    ends = [[0.0] * len(ops) for ops in encoded]
    cursor, clock, compute_s = [0] * n_stages, [0.0] * n_stages, [0.0] * n_stages
    runnable = list(range(n_stages))
    while runnable:
        pp_rank = runnable.pop()
        ops, rank_starts, rank_ends = encoded[pp_rank], starts[pp_rank], ends[pp_rank]
        i, now, n_ops, busy = cursor[pp_rank], clock[pp_rank], len(ops), compute_s[pp_rank]
        while i < n_ops:
            op, cost, slot = ops[i]
            if op == _COMPUTE:
                rank_starts[i] = now
                now += cost
                busy += cost
            elif op == _SEND:
                rank_starts[i] = now
                if overlap:
                    arrival[slot] = now + cost
                else:
                    now += cost
                    arrival[slot] = now
                if waiting[slot] >= 0:
                    runnable.append(waiting[slot])
                    waiting[slot] = -1
            else:
                arrived = arrival[slot]
                if arrived < 0:
                    waiting[slot] = pp_rank
                    break
                rank_starts[i] = now
                if arrived > now:
                    now = arrived
            rank_ends[i] = now
            i += 1
        cursor[pp_rank], clock[pp_rank], compute_s[pp_rank] = i, now, busy
    if any(cursor[r] < len(encoded[r]) for r in range(n_stages)):
        validate(lowered)  # raises with the step x rank table
        raise ScheduleError(f"schedule {lowered.name!r} hangs in the simulator but passes validation")
    return SimResult(schedule=lowered, costs=costs, starts=starts, ends=ends, compute_s=compute_s,
                     wall_s=time.perf_counter() - started)
