"""Fitting the simulator's transferable calibration (`attnres_pp.simulator.transfer.TransferCalibration`)
to ONE measured pipelined run: the lab's side of the calibration the simulator only reads.

Fitted from the run (its per-action timestamps, one clock for every rank):
    compute   the probed unit times (`attnres_lab.unit_probe`) give only the split of a chunk's work
              between units (layers, depth reads by sources and queries, embedding, head); phase 1's
              time is a plane in (n, k, n k) through the probed points (`fit_plane`). One factor per
              direction brings them to the run's median F (B) seconds summed over its chunks; then
              one common factor sets the level so that the run itself, simulated, takes its median
              measured step. On a quiet machine that factor is close to 1; on a loaded one it
              spreads the time the ranks lose to other work (a preempted rank stalls its peer) over
              the compute, which is how it stretches the other runs too.
    messages  send work: the run's median send less the probed copy time of its bytes (packing),
              plus that copy per byte; receive work: the median receive whose message was already
              there; the link: clean deliveries (the receiver already waiting: send start to
              receive end) less the send and receive work, with the copy cost per byte again;
              dispatch: the median gap between a rank's actions.
The split-backward schedules (zb_h1, interleaved_zb, zbv) run B as I then W: a calibration run that
splits fits the backward to its median I + W per chunk and the W share to its W over I + W; one that
does not leaves the share unknown (None). Pure Python: no torch.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

from attnres_pp.schedule.ir import Action, ActionKind
from attnres_pp.schedule.timeline import Event, account, message_pairs
from attnres_pp.simulator.transfer import RunShape, TransferCalibration, measured_hops
from attnres_pp.simulator.units import MessageCosts, UnitTimes, chunk_work


def unit_times_from_probe(probe: dict, direction: str) -> UnitTimes:
    """The probe's median unit times for `direction` ("fwd" or "bwd"), phase 1 as a fitted plane,
    with the runtime's cost per action where the probe has one (`attnres_lab.action_probe`)."""
    key = f"{direction}_s"
    points = [(p["sources"], p["queries"], p[key]) for p in probe["phase1"]]
    return UnitTimes(layer=probe["layer"][key], add=probe["add"][key], embed=probe["embed"][key],
                     head=probe["head"][key], merge=probe["merge"][key], phase1=fit_plane(points),
                     phase1_floor=min(t for _, _, t in points), action=probe.get("action", {}).get(key, 0.0))


def fit_plane(points: list[tuple[int, int, float]]) -> tuple[float, float, float, float]:
    """Least-squares (a, b, c, e) of t = a + b n + c k + e n k through (n, k, t) points."""
    rows = [(1.0, float(n), float(k), float(n * k)) for n, k, _ in points]
    normal = [[sum(r[i] * r[j] for r in rows) for j in range(4)] for i in range(4)]
    rhs = [sum(r[i] * t for r, (_, _, t) in zip(rows, points, strict=True)) for i in range(4)]
    return tuple(_solve(normal, rhs))


def _solve(matrix: list[list[float]], rhs: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting (a 4 x 4 system)."""
    size = len(rhs)
    a = [row[:] + [value] for row, value in zip(matrix, rhs, strict=True)]
    for col in range(size):
        pivot = max(range(col, size), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-300:
            raise ValueError("phase-1 points do not determine a plane: probe more (sources, queries) pairs")
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(col + 1, size):
            factor = a[r][col] / a[col][col]
            for c in range(col, size + 1):
                a[r][c] -= factor * a[col][c]
    out = [0.0] * size
    for r in reversed(range(size)):
        out[r] = (a[r][size] - sum(a[r][c] * out[c] for c in range(r + 1, size))) / a[r][r]
    return out


def _median(values: list[float], default: float = 0.0) -> float:
    return statistics.median(values) if values else default


def fit_transfer(probe: dict, shape: RunShape, steps: list[list[Event]]) -> TransferCalibration:
    """Fit unit and message costs to a measured run of `shape` (`steps`: each step's events)."""
    partition = shape.partition()
    n_chunks = partition.n_chunks
    kinds = (ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W)
    measured: dict[ActionKind, list[list[float]]] = {kind: [[] for _ in range(n_chunks)] for kind in kinds}
    for events in steps:
        for _rank, name, start, end, category in events:
            if category == "compute":
                action = Action.parse(name)
                measured[action.kind][action.chunk_index].append(end - start)
    weight_share = None
    if any(measured[ActionKind.I]):  # a split-backward run: B = I + W per chunk, W's share kept
        if any(not i or not w for i, w in zip(measured[ActionKind.I], measured[ActionKind.W], strict=True)):
            raise ValueError("the calibration run has a chunk without I or W events: is its trace complete?")
        inputs = [_median(t) for t in measured[ActionKind.I]]
        weights = [_median(t) for t in measured[ActionKind.W]]
        measured[ActionKind.B] = [[i + w] for i, w in zip(inputs, weights, strict=True)]
        weight_share = sum(weights) / (sum(inputs) + sum(weights))
    if any(not times for kind in (ActionKind.F, ActionKind.B) for times in measured[kind]):
        raise ValueError("the calibration run has a chunk without F or B (or I and W) events: is its trace complete?")
    works = [chunk_work(shape.model, partition, c) for c in range(n_chunks)]
    probed = {direction: unit_times_from_probe(probe, direction) for direction in ("fwd", "bwd")}
    factors = {direction: sum(_median(t) for t in measured[kind]) / sum(probed[direction].chunk_s(w) for w in works)
               for kind, direction in ((ActionKind.F, "fwd"), (ActionKind.B, "bwd"))}
    messages = fit_messages(probe, shape, steps)

    def calibration(level: float) -> TransferCalibration:
        return TransferCalibration(forward=probed["fwd"].scaled(level * factors["fwd"]),
                                   backward=probed["bwd"].scaled(level * factors["bwd"]), messages=messages,
                                   forward_scale=level * factors["fwd"], backward_scale=level * factors["bwd"],
                                   calibrated_on=shape, weight_share=weight_share)

    measured_step = _median([account(events, shape.n_stages)["step_s"] for events in steps])
    return calibration(_solve_level(lambda level: calibration(level).predict_step_s(shape), measured_step))


def _solve_level(step_at: Callable[[float], float], target_s: float) -> float:
    """The compute level at which the simulated step equals `target_s` (the step grows with the
    level, about linearly: a few secant steps from 1)."""
    low, high = 1.0, 1.0
    step_low = step_high = step_at(1.0)
    if abs(step_low - target_s) <= 1e-9 * target_s:
        return 1.0
    while step_high < target_s:  # bracket the target
        low, step_low, high = high, step_high, high * 2
        step_high = step_at(high)
    while step_low > target_s and low > 1e-6:
        high, step_high, low = low, step_low, low / 2
        step_low = step_at(low)
    if step_low > target_s:
        raise ValueError(f"the run's measured step ({target_s * 1e3:.3g} ms) is shorter than its messages and "
                         "fixed work alone, as simulated: no compute level fits it (is its link priced too slow?)")
    for _ in range(60):
        level = low + (high - low) * (target_s - step_low) / (step_high - step_low) if step_high > step_low else high
        step = step_at(level)
        if abs(step - target_s) <= 1e-9 * target_s:
            return level
        if step < target_s:
            low, step_low = level, step
        else:
            high, step_high = level, step
    return level


def fit_messages(probe: dict, shape: RunShape, steps: list[list[Event]]) -> MessageCosts:
    """Send and receive work, link latency and dispatch from the run's communication events. Where
    the shape names its links (`rank_links`, or an emulated `link`), a message is taken as there
    only once that link can have delivered it (after the messages queued before it on the link):
    on a slow link a receive that started after the send ended may still have waited for the
    bytes, and that wait is not the receiver's work."""
    hop_bytes = shape.hop_bytes()
    per_byte = float(probe["pack_s_per_byte"])
    known = _known_link_times(shape, hop_bytes)

    def message_bytes(name: str) -> int:
        return hop_bytes[_hop_of(name)]

    send_fixed, ready, clean, dispatch = [], [], [], []
    for events in steps:
        dispatch.append(account(events, shape.n_stages)["dispatch_us_per_action"] * 1e-6)
        for event in events:
            if event[1][:2] in ("SF", "SB"):
                send_fixed.append(event[3] - event[2] - per_byte * message_bytes(event[1]))
        arrival = _arrivals(events, known) if known else {}
        for send, receive in message_pairs(events):
            if arrival.get(send[1], send[3]) <= receive[2]:  # already there: the receive's duration is its own work
                ready.append(receive[3] - receive[2])
            elif receive[2] <= send[2]:  # the receiver was waiting: a clean delivery
                clean.append((receive[3] - send[2], message_bytes(send[1])))
    send_s = max(0.0, _median(send_fixed))
    recv_s = _median(ready)
    latency = _median([total - send_s - 2 * per_byte * n_bytes - recv_s for total, n_bytes in clean])
    return MessageCosts(send_fixed_s=send_s, send_s_per_byte=per_byte, recv_fixed_s=recv_s,
                        link_latency_s=max(0.0, latency), link_s_per_byte=per_byte, dispatch_s=_median(dispatch))


def _hop_of(name: str) -> int:
    """The hop a send or receive event's message crosses."""
    direction, sending_chunk, _ = Action.parse(name).message_id
    return sending_chunk if direction == "F" else sending_chunk - 1


def _known_link_times(shape: RunShape, hop_bytes: list[int]) -> dict[str, tuple[tuple[float, ...], tuple[float, ...]]]:
    """{"F" | "B": (hop seconds, wire seconds) per hop} of the shape's named links; {} without."""
    partition = shape.partition()
    if shape.rank_links:
        return {"F": measured_hops(shape, partition, hop_bytes, True)[:2],
                "B": measured_hops(shape, partition, hop_bytes, False)[:2]}
    if shape.link is not None:
        hops = tuple(shape.link.message_s(b) for b in hop_bytes)
        wires = tuple(shape.link.wire_s(b) for b in hop_bytes)
        return {"F": (hops, wires), "B": (hops, wires)}
    return {}


def _arrivals(events: list[Event], known: dict) -> dict[str, float]:
    """When each sent message can have arrived: it leaves when its send ends and the link from its
    rank to its peer is free, occupies the link for its wire time and arrives after its hop time."""
    receivers = {send[1]: receive[0] for send, receive in message_pairs(events)}
    free: dict[tuple[int, int], float] = {}
    arrival = {}
    for rank, name, _start, end, _category in sorted((e for e in events if e[1][:2] in ("SF", "SB")),
                                                     key=lambda e: e[3]):
        if name not in receivers:
            continue
        hops, wires = known[name[1]]
        hop = _hop_of(name)
        link = (rank, receivers[name])
        depart = max(end, free.get(link, end))
        free[link] = depart + wires[hop]
        arrival[name] = depart + hops[hop]
    return arrival
