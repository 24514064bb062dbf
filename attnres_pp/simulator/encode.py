"""A schedule and a cost model as the event engine's integer op streams, checked as `validate` would.

One op per action, one int each: `payload << 2 | op` with op COMPUTE (payload: the index into
`Encoded.compute_cost`: 2 * chunk for F, + 1 for B; 2 * (C + chunk) for I, + 1 for W), SEND or
RECV (payload: the message's slot, `lane * m + microbatch` with lane = 2 * sending chunk, + 1 for
the backward direction). Plain ints and per-lane tables keep a million-action schedule at a few
tens of MB and the engine's loop free of attribute lookups.

Two ways in, one result:
- `encode_compute_only` (the fast path): a compute-only schedule of F and B (or I and W), lowered
  while it is encoded by the rule of `passes.insert_comm` (RF before and SF after F, RB before and
  SB after B or I, none past either end of the pipeline; W exchanges nothing), and checked on the
  way: every F exactly once and either B or I then W exactly once, on its chunk's rank, B or I after
  its F, W after its I. Messages then match by construction, and the engine finds deadlocks (a
  rank whose I runs before a later chunk's of its own, which validate refuses for the cache
  deposits, is one of them). No Action object is made for the communication.
- `encode_lowered` (the slow twin): `passes.insert_comm` and `validate.validate` themselves, then
  the lowered actions one by one. It takes any schedule the IR can hold (already lowered, parsed
  from text). tests/unit/test_sim_speed.py holds the two to equal op streams for every generator.
Any failure of the fast path's checks is reported by `validate`, with its step x rank table. Up
to FULL_VALIDATION_ACTIONS lowered actions `validate` runs as well, so small and medium schedules
get every check it makes, including any it gains later.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from attnres_pp.schedule.ir import ActionKind, Schedule
from attnres_pp.schedule.passes import insert_comm
from attnres_pp.schedule.validate import ScheduleError, validate
from attnres_pp.simulator.costs import CostModel

COMPUTE, SEND, RECV = 0, 1, 2
# Up to this many lowered actions `validate` itself also runs (about 0.1 s); above it the fast
# path's own checks stand in for it (validate takes ~7 us an action: 10.7 s at 1.57 M).
FULL_VALIDATION_ACTIONS = 20_000


@dataclass(frozen=True)
class Encoded:
    """ops[r]: rank r's op stream; compute_cost[2c (+1 for B)] for F, and [2(C + c) (+1 for W)] for
    I; per lane (2 * sending chunk, + 1 backward): link time, sender's and receiver's work, wire
    time and directed link id (-1: none, a self-hop or unshared links); compute_s[r]: rank r's
    F + B (+ I + W) seconds (fixed by the costs)."""

    ops: list[list[int]]
    compute_cost: list[float]
    lane_link: list[float]
    lane_send: list[float]
    lane_recv: list[float]
    lane_wire: list[float]
    lane_link_id: list[int]
    compute_s: list[float]
    n_microbatches: int
    n_links: int


def _lane_tables(schedule: Schedule, costs: CostModel) -> tuple[list, list, list, list, list]:
    n_chunks, n_stages = schedule.n_chunks, schedule.n_stages

    def per_hop(values: tuple[float, ...]) -> tuple[float, ...]:
        return values if values else (0.0,) * (n_chunks - 1)

    n_lanes = 2 * n_chunks
    link, send, recv, wire, link_id = [0.0] * n_lanes, [0.0] * n_lanes, [0.0] * n_lanes, [0.0] * n_lanes, [-1] * n_lanes
    shared = costs.shared_links
    for hop in range(n_chunks - 1):
        for lane, direction, src, dst in ((2 * hop, 0, hop, hop + 1), (2 * (hop + 1) + 1, 1, hop + 1, hop)):
            fields = ((costs.hop_fwd_s, costs.send_fwd_s, costs.recv_fwd_s, costs.wire_fwd_s) if direction == 0
                      else (costs.hop_bwd_s, costs.send_bwd_s, costs.recv_bwd_s, costs.wire_bwd_s))
            link[lane], send[lane], recv[lane], wire[lane] = (per_hop(values)[hop] for values in fields)
            src_rank, dst_rank = schedule.rank_of(src), schedule.rank_of(dst)
            if shared and src_rank != dst_rank:
                link_id[lane] = src_rank * n_stages + dst_rank
    return link, send, recv, wire, link_id


def _compute_cost(costs: CostModel) -> list[float]:
    """F, B of each chunk, then I, W of each chunk (`CostModel.split_s`)."""
    fused = [value for pair in zip(costs.forward_s, costs.backward_s, strict=True) for value in pair]
    return fused + [value for pair in zip(*costs.split_s, strict=True) for value in pair]


def encode(schedule: Schedule, costs: CostModel) -> tuple[Encoded, Schedule | None]:
    """(encoded ops, the lowered schedule if the slow path made one). Raises ScheduleError if the
    schedule is not safe to run (the engine itself finds deadlocks)."""
    if costs.n_chunks != schedule.n_chunks:
        raise ValueError(f"cost model covers {costs.n_chunks} chunks, schedule has {schedule.n_chunks}")
    fast = encode_compute_only(schedule, costs)
    if fast is not None:
        if sum(len(ops) for ops in fast.ops) <= FULL_VALIDATION_ACTIONS:
            return fast, _validated_lowering(schedule)
        return fast, None
    lowered = schedule if schedule.has_comm else insert_comm(schedule)
    return encode_lowered(lowered, costs), lowered


@lru_cache(maxsize=32)
def _validated_lowering(schedule: Schedule) -> Schedule:
    """`insert_comm` and every check `validate` has (any it gains, too), while it is cheap; once per
    schedule (a frozen value), however many cost models simulate it (`simulate plan` prices one
    schedule under many)."""
    lowered = insert_comm(schedule)
    validate(lowered)
    return lowered


def encode_compute_only(schedule: Schedule, costs: CostModel) -> Encoded | None:
    """The fast path; None if the schedule holds anything but F, B, I and W (already lowered, or
    kinds this path does not know), so the caller takes the slow path."""
    n_microbatches, n_chunks, n_stages = schedule.n_microbatches, schedule.n_chunks, schedule.n_stages
    last = n_chunks - 1
    owner = [schedule.rank_of(c) for c in range(n_chunks)]
    compute_cost = _compute_cost(costs)
    seen = bytearray(2 * n_chunks * n_microbatches)  # (chunk * m + mb) * 2 (+ 1 for B or I)
    weight_due = bytearray(n_chunks * n_microbatches)  # chunk * m + mb: 1 after its I, 2 after its W
    kind_f, kind_b, kind_i, kind_w = ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W
    split_base = 2 * n_chunks  # compute_cost index of I of chunk 0
    # Message codes without their microbatch: lane * m << 2 | op, so code = base + (mb << 2).
    recv_f = [((2 * (c - 1)) * n_microbatches << 2) | RECV for c in range(n_chunks)]
    send_f = [((2 * c) * n_microbatches << 2) | SEND for c in range(n_chunks)]
    recv_b = [((2 * (c + 1) + 1) * n_microbatches << 2) | RECV for c in range(n_chunks)]
    send_b = [((2 * c + 1) * n_microbatches << 2) | SEND for c in range(n_chunks)]
    all_ops, compute_s = [], []
    broken = False
    for pp_rank, actions in enumerate(schedule.rank_actions):
        ops: list[int] = []
        append = ops.append
        busy = 0.0
        for action in actions:
            kind, c, mb = action.kind, action.chunk_index, action.microbatch_index
            if not (0 <= c <= last and 0 <= mb < n_microbatches) or owner[c] != pp_rank:
                broken = True
                break
            key = (c * n_microbatches + mb) << 1
            shift = mb << 2
            if kind is kind_f:
                if seen[key]:
                    broken = True
                    break
                seen[key] = 1
                if c:
                    append(recv_f[c] + shift)
                append(c << 3)  # (2 * c) << 2 | COMPUTE
                if c < last:
                    append(send_f[c] + shift)
                busy += compute_cost[2 * c]
            elif kind is kind_b:
                if seen[key + 1] or not seen[key]:  # twice, or before its own F on this rank
                    broken = True
                    break
                seen[key + 1] = 1
                if c < last:
                    append(recv_b[c] + shift)
                append((c << 3) | 4)  # (2 * c + 1) << 2 | COMPUTE
                if c:
                    append(send_b[c] + shift)
                busy += compute_cost[2 * c + 1]
            elif kind is kind_i:
                if seen[key + 1] or not seen[key]:  # twice, with a B, or before its own F
                    broken = True
                    break
                seen[key + 1] = 1
                weight_due[key >> 1] = 1
                if c < last:
                    append(recv_b[c] + shift)
                append((split_base + 2 * c) << 2)
                if c:
                    append(send_b[c] + shift)
                busy += compute_cost[split_base + 2 * c]
            elif kind is kind_w:
                if weight_due[key >> 1] != 1:  # before its I, twice, or for a fused B
                    broken = True
                    break
                weight_due[key >> 1] = 2
                append((split_base + 2 * c + 1) << 2)
                busy += compute_cost[split_base + 2 * c + 1]
            else:
                return None
        if broken:
            break
        all_ops.append(ops)
        compute_s.append(busy)
    if broken or 0 in seen or 1 in weight_due:  # ... or an I without its W
        validate(schedule)  # raises with the reason
        raise ScheduleError(f"schedule {schedule.name!r} fails the simulator's checks but passes validation")
    link, send, recv, wire, link_id = _lane_tables(schedule, costs)
    return Encoded(ops=all_ops, compute_cost=compute_cost, lane_link=link, lane_send=send, lane_recv=recv,
                   lane_wire=wire, lane_link_id=link_id, compute_s=compute_s, n_microbatches=n_microbatches,
                   n_links=n_stages * n_stages)


# Where each compute kind's cost sits in `Encoded.compute_cost`, by (chunk, number of chunks).
_COMPUTE_INDEX = {
    ActionKind.F: lambda c, n_chunks: 2 * c,
    ActionKind.B: lambda c, n_chunks: 2 * c + 1,
    ActionKind.I: lambda c, n_chunks: 2 * (n_chunks + c),
    ActionKind.W: lambda c, n_chunks: 2 * (n_chunks + c) + 1,
}


def encode_lowered(lowered: Schedule, costs: CostModel) -> Encoded:
    """The slow twin: validate the lowered schedule, then encode its actions one by one."""
    validate(lowered)
    n_microbatches = lowered.n_microbatches
    compute_cost = _compute_cost(costs)
    all_ops, compute_s = [], []
    for actions in lowered.rank_actions:
        ops, busy = [], 0.0
        for action in actions:
            kind, c, mb = action.kind, action.chunk_index, action.microbatch_index
            if action.is_compute:
                index = _COMPUTE_INDEX[kind](c, lowered.n_chunks)
                ops.append((index << 2) | COMPUTE)
                busy += compute_cost[index]
                continue
            if not (action.is_send or action.is_recv):
                raise ValueError(f"the simulator has no cost for {action} (action kind {kind.value!r})")
            direction, sending_chunk, _ = action.message_id
            lane = 2 * sending_chunk + (direction == "B")
            ops.append(((lane * n_microbatches + mb) << 2) | (SEND if action.is_send else RECV))
        all_ops.append(ops)
        compute_s.append(busy)
    link, send, recv, wire, link_id = _lane_tables(lowered, costs)
    return Encoded(ops=all_ops, compute_cost=compute_cost, lane_link=link, lane_send=send, lane_recv=recv,
                   lane_wire=wire, lane_link_id=link_id, compute_s=compute_s, n_microbatches=n_microbatches,
                   n_links=lowered.n_stages * lowered.n_stages)
