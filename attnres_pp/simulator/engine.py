"""Discrete-event execution of a schedule under a cost model.

Each rank runs its action list in order on its own clock. Every action but a rank's first begins
with the runtime's dispatch gap (`CostModel.dispatch_s`). F and B (or I and W) take their
chunk's cost. A send keeps its rank busy
for the send work, then never blocks: its message arrives link-time later (with overlap_comm=False
the sender is also busy for the link time; with wire times the messages from one rank to another
leave one after the other, as on one link). A receive completes at max(now, arrival) plus the
receive work; if its send has not run yet, the rank parks until it has. Ranks share nothing but
the messages (a link is used by one sender only, in its own order), so the order in which ranks
are advanced changes no time: a worklist of runnable ranks replaces a global event heap, and
each action is visited once, O(actions) in all.

The schedule is encoded (and checked) by `simulator.encode`: a compute-only schedule is lowered
on the fly by `passes.insert_comm`'s rule, so no Action object is made for its communication.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property

from attnres_pp.schedule.ir import Schedule
from attnres_pp.schedule.passes import insert_comm
from attnres_pp.schedule.trace import TimelineEvent
from attnres_pp.schedule.validate import ScheduleError, validate
from attnres_pp.simulator.costs import CostModel
from attnres_pp.simulator.encode import COMPUTE, SEND, Encoded, encode


@dataclass(frozen=True)
class SimResult:
    """ends[r][i]: seconds at which action i of rank r's lowered list ended (it began at the end of
    the action before it plus the dispatch gap, the first at 0); compute_s[r]: rank r's seconds in
    F and B (or I and W)."""

    schedule: Schedule  # as given: compute-only or lowered
    costs: CostModel
    ends: list[list[float]]
    compute_s: list[float]  # per rank, seconds spent in F and B (or I and W)
    wall_s: float
    lowered_schedule: Schedule | None = None  # the lowered form, if one was made while simulating

    @property
    def makespan(self) -> float:
        return max((ends[-1] for ends in self.ends if ends), default=0.0)

    @property
    def n_actions(self) -> int:
        """Actions simulated, communication included."""
        return sum(len(ends) for ends in self.ends)

    @cached_property
    def lowered(self) -> Schedule:
        """The schedule with its communication (made here, only when a trace or plot asks for it)."""
        if self.lowered_schedule is not None:
            return self.lowered_schedule
        return self.schedule if self.schedule.has_comm else insert_comm(self.schedule)

    @cached_property
    def starts(self) -> list[list[float]]:
        dispatch = self.costs.dispatch_s
        return [[ends[i - 1] + dispatch if i else 0.0 for i in range(len(ends))] for ends in self.ends]

    def events(self) -> Iterator[TimelineEvent]:
        """Every action as a timeline event (zero-length sends included)."""
        for pp_rank, actions in enumerate(self.lowered.rank_actions):
            for action, start, end in zip(actions, self.starts[pp_rank], self.ends[pp_rank], strict=True):
                yield TimelineEvent(pp_rank, str(action), start, end, "compute" if action.is_compute else "comm")


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """The cyclic garbage collector off for a block. A big schedule is millions of objects without
    cycles; the collector would walk them again and again for nothing (about 10% of the
    `simulate schedule` command at 64 x 8 x 512)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def simulate(schedule: Schedule, costs: CostModel) -> SimResult:
    """Execute `schedule` (lowered here if it is compute-only) and time every action.

    Raises ScheduleError (with the validator's step x rank table) if the schedule is not safe to
    run: an F or B missing, repeated or on the wrong rank, a message without its other end, or a
    deadlock.
    """
    started = time.perf_counter()
    encoded, lowered = encode(schedule, costs)
    ends = _run(encoded, costs)
    if ends is None:
        validate(lowered or schedule)  # raises with the step x rank table
        raise ScheduleError(f"schedule {schedule.name!r} hangs in the simulator but passes validation")
    return SimResult(schedule=schedule, costs=costs, ends=ends, compute_s=encoded.compute_s,
                     wall_s=time.perf_counter() - started, lowered_schedule=lowered)


def _run(encoded: Encoded, costs: CostModel) -> list[list[float]] | None:
    """Per rank the end time of every op; None if the ranks deadlock."""
    lean = (costs.overlap_comm and not costs.dispatch_s and not costs.shared_links
            and not any(encoded.lane_send) and not any(encoded.lane_recv))
    return _run_lean(encoded) if lean else _run_general(encoded, costs)


def _run_lean(encoded: Encoded) -> list[list[float]] | None:
    """`_run_general` without the runtime's work and shared links: F, B and link times only (unit
    and FLOP costs). The same times; about a third less work per action on big schedules."""
    all_ops = encoded.ops
    n_stages = len(all_ops)
    n_microbatches = encoded.n_microbatches
    compute_cost, lane_link = encoded.compute_cost, encoded.lane_link
    n_slots = len(lane_link) * n_microbatches
    arrival = [-1.0] * n_slots
    waiting = [-1] * n_slots
    ends = [[0.0] * len(ops) for ops in all_ops]
    cursor, clock = [0] * n_stages, [0.0] * n_stages
    runnable = list(range(n_stages))
    while runnable:
        pp_rank = runnable.pop()
        ops, rank_ends = all_ops[pp_rank], ends[pp_rank]
        i, now, n_ops = cursor[pp_rank], clock[pp_rank], len(ops)
        while i < n_ops:
            code = ops[i]
            op = code & 3
            if op == COMPUTE:
                now += compute_cost[code >> 2]
            elif op == SEND:
                slot = code >> 2
                arrival[slot] = now + lane_link[slot // n_microbatches]
                parked = waiting[slot]
                if parked >= 0:
                    runnable.append(parked)
                    waiting[slot] = -1
            else:
                arrived = arrival[code >> 2]
                if arrived < 0:
                    waiting[code >> 2] = pp_rank
                    break
                if arrived > now:
                    now = arrived
            rank_ends[i] = now
            i += 1
        cursor[pp_rank], clock[pp_rank] = i, now
    if any(cursor[r] < len(all_ops[r]) for r in range(n_stages)):
        return None
    return ends


def _run_general(encoded: Encoded, costs: CostModel) -> list[list[float]] | None:
    all_ops = encoded.ops
    n_stages = len(all_ops)
    n_microbatches = encoded.n_microbatches
    compute_cost = encoded.compute_cost
    lane_link, lane_send, lane_recv = encoded.lane_link, encoded.lane_send, encoded.lane_recv
    lane_wire, lane_link_id = encoded.lane_wire, encoded.lane_link_id
    dispatch, overlap = costs.dispatch_s, costs.overlap_comm
    n_slots = len(lane_link) * n_microbatches
    arrival = [-1.0] * n_slots  # -1: the send has not run yet
    waiting = [-1] * n_slots  # the rank parked on this message, if any
    link_free = [0.0] * max(1, encoded.n_links)  # when each directed link is next free
    ends = [[0.0] * len(ops) for ops in all_ops]
    # A rank's first action has no gap before it (the gap is between actions): it starts at 0.
    cursor, clock = [0] * n_stages, [-dispatch] * n_stages
    runnable = list(range(n_stages))
    while runnable:
        pp_rank = runnable.pop()
        ops, rank_ends = all_ops[pp_rank], ends[pp_rank]
        i, now, n_ops = cursor[pp_rank], clock[pp_rank], len(ops)
        while i < n_ops:
            code = ops[i]
            op = code & 3
            if op == COMPUTE:
                now += dispatch + compute_cost[code >> 2]
            elif op == SEND:
                slot = code >> 2
                lane = slot // n_microbatches
                now += dispatch + lane_send[lane]
                if not overlap:
                    now += lane_link[lane]
                    arrival[slot] = now
                elif lane_link_id[lane] >= 0:  # a shared link: wait until it is free
                    link = lane_link_id[lane]
                    depart = now if now > link_free[link] else link_free[link]
                    link_free[link] = depart + lane_wire[lane]
                    arrival[slot] = depart + lane_link[lane]
                else:
                    arrival[slot] = now + lane_link[lane]
                parked = waiting[slot]
                if parked >= 0:
                    runnable.append(parked)
                    waiting[slot] = -1
            else:
                slot = code >> 2
                arrived = arrival[slot]
                if arrived < 0:
                    waiting[slot] = pp_rank
                    break
                now += dispatch
                if arrived > now:
                    now = arrived
                now += lane_recv[slot // n_microbatches]
            rank_ends[i] = now
            i += 1
        cursor[pp_rank], clock[pp_rank] = i, now
    if any(cursor[r] < len(all_ops[r]) for r in range(n_stages)):
        return None
    return ends
