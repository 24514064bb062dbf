"""Time accounting of a measured pipelined step (`account`), from the ranks' per-action timestamps
on one shared clock (pure Python). A real run's step statistics, the benchmarks and the simulator's
calibration all use it, so it lives below both the training engines and the simulator.

The step window runs from the first action's start to the last action's end (the
final flush included); each rank's share of it (ranks x window in all) splits into:
    compute   F and B (or I and W) actions
    send      send actions: packing the hop's tensors and posting the non-blocking send (work, not idle)
    recv      the work inside receive actions: every receive is charged the median duration of the
              receives whose message had been sent completely before they began (posting, unpacking)
    idle      the rest of the receive actions and the final flush (waiting for a peer), and the time
              before a rank's first action or after its last
    dispatch  gaps between consecutive actions of a rank: the runtime's own per-action overhead
so bubble = 1 - compute / (ranks x window) = idle + recv + send + dispatch (fractions of ranks x window).
"""

from __future__ import annotations

import statistics

Event = tuple[int, str, float, float, str]  # (pp_rank, action name, start_s, end_s, "compute" | "comm")


def bubble_fraction(events: list[Event], n_ranks: int) -> float:
    """1 - compute / (ranks x step window): everything on a rank that is not F or B (or I or W) compute."""
    start = min(e[2] for e in events)
    window = max(e[3] for e in events) - start
    busy = sum(e[3] - e[2] for e in events if e[4] == "compute")
    return 1.0 - busy / (n_ranks * window) if window > 0 else 0.0


def rank_bubbles(events: list[Event], n_ranks: int) -> list[float]:
    """Each rank's bubble on its own clock: 1 - its compute / its own window (its first action's
    start to its last action's end). No clock is compared with another rank's, so it holds for
    ranks on different hosts."""
    bubbles = []
    for pp_rank in range(n_ranks):
        mine = [e for e in events if e[0] == pp_rank]
        window = max(e[3] for e in mine) - min(e[2] for e in mine) if mine else 0.0
        busy = sum(e[3] - e[2] for e in mine if e[4] == "compute")
        bubbles.append(1.0 - busy / window if window > 0 else 0.0)
    return bubbles


def own_clock_bubble(events: list[Event], n_ranks: int) -> float:
    """1 - compute / (sum over ranks of each rank's own window): `bubble_fraction` without comparing
    the ranks' clocks."""
    windows = busy = 0.0
    for pp_rank in range(n_ranks):
        mine = [e for e in events if e[0] == pp_rank]
        if mine:
            windows += max(e[3] for e in mine) - min(e[2] for e in mine)
            busy += sum(e[3] - e[2] for e in mine if e[4] == "compute")
    return 1.0 - busy / windows if windows > 0 else 0.0


def align_per_rank(events: list[Event]) -> list[Event]:
    """Each rank's events shifted so that its step starts at 0 on its own clock (traces of ranks on
    different hosts line up per step)."""
    starts: dict[int, float] = {}
    for rank, _name, start, _end, _category in events:
        starts[rank] = min(start, starts.get(rank, start))
    return [(r, n, s - starts[r], e - starts[r], c) for r, n, s, e, c in events]


def message_pairs(events: list[Event]) -> list[tuple[Event, Event]]:
    """(send, receive) event pairs of one step: SF c.mb -> RF c+1.mb and SB c.mb -> RB c-1.mb."""
    by_name = {e[1]: e for e in events if e[1][:2] in ("SF", "SB", "RF", "RB")}
    pairs = []
    for name, send in by_name.items():
        if name[0] != "S":
            continue
        chunk, microbatch = (int(x) for x in name[2:].split("."))
        receive = by_name.get(f"RF{chunk + 1}.{microbatch}" if name[1] == "F" else f"RB{chunk - 1}.{microbatch}")
        if receive is not None:
            pairs.append((send, receive))
    return pairs


def median_action_s(steps: list[list[Event]]) -> dict[tuple[str, int], float]:
    """{(action kind, chunk): the median compute action's seconds} over the steps' events, e.g.
    ("F", 0) or ("W", 3): one microbatch's compute through each chunk, as a run took it."""
    from attnres_pp.schedule.ir import Action

    durations: dict[tuple[str, int], list[float]] = {}
    for events in steps:
        for _rank, name, start, end, category in events:
            if category == "compute":
                action = Action.parse(name)
                durations.setdefault((action.kind.name, action.chunk_index), []).append(end - start)
    return {key: statistics.median(values) for key, values in durations.items()}


def account(events: list[Event], n_ranks: int) -> dict[str, float]:
    """Time accounting of one step (see the module docstring). Fractions are of ranks x window."""
    start = min(e[2] for e in events)
    end = max(e[3] for e in events)
    window = end - start
    compute = send = wait = dispatch = 0.0
    n_gaps = n_compute = n_recv = 0
    for pp_rank in range(n_ranks):
        mine = sorted((e for e in events if e[0] == pp_rank), key=lambda e: e[2])
        if not mine:
            wait += window
            continue
        wait += (mine[0][2] - start) + (end - mine[-1][3])
        for before, after in zip(mine, mine[1:], strict=False):
            dispatch += max(0.0, after[2] - before[3])
            n_gaps += 1
        for _rank, name, begin, finish, category in mine:
            if category == "compute":
                compute += finish - begin
                n_compute += 1
            elif name.startswith("S"):
                send += finish - begin
            else:
                wait += finish - begin
                n_recv += name.startswith("R")
    ready = [r[3] - r[2] for s, r in message_pairs(events) if s[3] <= r[2]]
    recv = min(wait, n_recv * statistics.median(ready)) if ready else 0.0
    capacity = n_ranks * window
    fraction = (lambda seconds: seconds / capacity) if capacity > 0 else (lambda seconds: 0.0)
    return {
        "step_s": window,
        "bubble": bubble_fraction(events, n_ranks),
        "idle": fraction(wait - recv),
        "recv": fraction(recv),
        "send": fraction(send),
        "dispatch": fraction(dispatch),
        "dispatch_us_per_action": 1e6 * dispatch / n_gaps if n_gaps else 0.0,
        # Per compute action, the runtime's work around it (gaps, sends, receive work): what the
        # simulator, which knows only F, B and links, must add to every F and B.
        "overhead_s_per_compute": (dispatch + send + recv) / n_compute if n_compute else 0.0,
        "compute_s_per_rank": compute / n_ranks,
    }
