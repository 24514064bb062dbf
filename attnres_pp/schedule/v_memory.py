"""V-Half and V-Min: the controllable-memory V schedules (docs/spec.md section 5).

Qi et al., "Pipeline Parallelism with Controllable Memory": on ZB-V's placement (V = 2, chunk r
and chunk 2P - 1 - r on rank r) a rank repeats one building block every 6 unit slots (F and I of
each arm, then the two W in the block's free slots). The offsets of the block's four F and I
set how long each chunk-microbatch stays alive, from its F to its W: V-Half keeps about half of
1F1B's activations in flight, V-Min about a third. Warm-up and cool-down are then squeezed
greedily: each action moves to the earliest free slot its dependencies allow, unless that would
raise the rank's peak of activations held (an activation is freed only at its W, the split
backward's store).

The construction is the one the paper's authors publish as their greedy V builder: the same
offsets, squeeze passes and tie-breaks, so its per-rank orders are theirs action for action
(tests/unit/test_v_memory_reference.py holds their orders for P = 4, m = 8 and P = 3, m = 6). Pure standard library.

Slot plans. A rank's plan is a list of lanes, each the slot times of one kind of action for
microbatches 0, 1, ...: lane 0 forwards of the first arm, 1 forwards of the second arm, 2 input
gradients of the second arm (the loss is at rank 0's second chunk, so this backward comes first),
3 input gradients of the first arm; then the weight lanes (one lane of either arm's W while
squeezing, split into 4: second arm, 5: first arm at the end).
"""

from __future__ import annotations

from attnres_pp.schedule.ir import Action, F, I, Schedule, W

V_MEMORY_SCHEDULES = ("v_half", "v_min")
# Unit slots per microbatch and rank: F, I and W on each of the two arms.
_BLOCK_SLOTS = 6
_FORWARD_LANES, _INPUT_LANES = (0, 1), (2, 3)


def min_microbatches(n_stages: int) -> int:
    """The fewest microbatches V-Half and V-Min take: 2P, as DualPipeV. From 2P on the squeezed
    warm-up and cool-down leave the same idle time whatever m (`closed_form_idle_per_rank`); below,
    they overlap and the idle time varies with m (V-Half, P = 4: 4 instead of 2.5 at m = 5)."""
    return 2 * n_stages


def check_v_memory_sizes(name: str, n_stages: int, n_virtual: int, n_microbatches: int) -> None:
    """Refuse V != 2 (a V has two arms) and m below `min_microbatches`."""
    if n_virtual != 2:
        raise ValueError(f"{name} places exactly 2 chunks per rank (a V), but virtual V={n_virtual}: use virtual=2")
    fewest = min_microbatches(n_stages)
    if n_microbatches < fewest:
        raise ValueError(f"{name} needs m >= 2P={fewest} microbatches, got m={n_microbatches}: "
                         f"use any m >= {fewest}")


def steady_offsets(name: str, n_stages: int) -> list[list[int]]:
    """Per rank, the slots of microbatch 0's F (first arm), F (second arm), I (second arm) and
    I (first arm) in the repeating block. The gap between a chunk's F and its I is the time its
    activations live: about 2P slots for V-Min, 3P for V-Half (1F1B keeps them about 6P). The
    extra gap where P divides by 3 (V-Min) or 2 (V-Half) keeps the four offsets distinct mod 6."""
    p = n_stages
    if name == "v_min":
        gap = 2 if p % 3 == 0 else 0
        return [[r, 2 * p - r - 1, 2 * p + gap + r, 4 * p + gap - r - 1] for r in range(p)]
    if name == "v_half":
        gap = 3 if p % 2 == 0 else 0
        return [[2 * r, 3 * p - r - 2, 3 * p + gap + 2 * r - 1, 6 * p + gap - r - 2] for r in range(p)]
    raise ValueError(f"schedule {name!r} is not a controllable-memory V schedule: choose one of "
                     f"{', '.join(V_MEMORY_SCHEDULES)}")


def closed_form_peak_held(name: str, n_stages: int) -> int:
    """The most chunk-microbatches (activation sets of half a rank's layers) the fullest rank
    holds, F to W, for any m >= 2P: V-Half 2 (P // 2 + 1), V-Min 2 ((P + 4) // 3). 1F1B and ZB-V
    hold 2P such halves (P whole-stage microbatches), so these are about 1/2 and 1/3 of theirs."""
    steady_offsets(name, n_stages)  # refuses an unknown name
    if name == "v_half":
        return 2 * (n_stages // 2 + 1)
    return 2 * ((n_stages + 4) // 3)


def closed_form_idle_per_rank(name: str, n_stages: int) -> float:
    """Idle time of every rank under the unit costs (F = 1, I = W = 1 per rank and microbatch,
    half each per chunk; free links) for any m >= 2P; makespan 3m plus it. Derived from the
    orders (the paper gives no closed form for the squeezed ends): V-Half 3 ((P - 1) // 2) - 1/2,
    V-Min 2P - 5/2 (2P - 7/2 where 3 divides P, whose block has the extra gap); P = 1 idles 0, and
    V-Half at P = 2 idles 1/2."""
    steady_offsets(name, n_stages)
    if n_stages == 1:
        return 0.0
    if name == "v_half":
        return 0.5 if n_stages == 2 else 3 * ((n_stages - 1) // 2) - 0.5
    return 2 * n_stages - (3.5 if n_stages % 3 == 0 else 2.5)


def closed_form_bubble_fraction(name: str, n_stages: int, n_microbatches: int) -> float:
    """Idle over (ranks x makespan) under the unit costs, m >= 2P: idle / (3m + idle)."""
    idle = closed_form_idle_per_rank(name, n_stages)
    return idle / (3 * n_microbatches + idle)


def _repeat(offsets: list[int], n_microbatches: int) -> list[list[int]]:
    return [list(range(first, first + _BLOCK_SLOTS * n_microbatches, _BLOCK_SLOTS)) for first in offsets]


def _events_by_slot(lanes: list[list[int]]) -> dict[int, int]:
    """slot -> lane of the action there (a rank runs one action per slot)."""
    return {slot: lane for lane, slots in enumerate(lanes) for slot in slots}


def place_weights(lanes: list[list[int]], split_by_arm: bool) -> list[list[int]]:
    """Add W lanes to a rank's four F/I lanes: each W takes the first free slot after an I made
    one pending (the second arm's first when both wait); the rest follow the last action. One W
    lane for both arms, or two (second arm, first arm) with `split_by_arm`."""
    occupied = _events_by_slot(lanes[:4])
    last = max(slots[-1] for slots in lanes[:4])
    weights: list[list[int]] = [[], []]
    pending = [0, 0]
    for slot in range(last + 1):
        lane = occupied.get(slot)
        if lane in _INPUT_LANES:
            pending[lane - 2 if split_by_arm else 0] += 1
        elif lane is None:
            arm = 0 if pending[0] else 1
            if pending[arm]:
                weights[arm].append(slot)
                pending[arm] -= 1
    for arm in (0, 1):
        for _ in range(pending[arm]):
            last += 1
            weights[arm].append(last)
    return [*lanes[:4], *(weights if split_by_arm else weights[:1])]


def peak_held(lanes: list[list[int]]) -> int:
    """Most chunk-microbatches a rank holds at once: each F adds one, each W frees one. Without a
    W lane, a pending W is assumed to run in each free slot (what `place_weights` will do)."""
    occupied = _events_by_slot(lanes)
    has_weights = len(lanes) > 4
    held = peak = pending = 0
    for slot in range(max(slots[-1] for slots in lanes) + 1):
        lane = occupied.get(slot)
        if lane in _FORWARD_LANES:
            held += 1
        elif lane in _INPUT_LANES:
            pending += 1
        elif lane == 4:
            held -= 1
        elif not has_weights and pending:
            held -= 1
            pending -= 1
        peak = max(peak, held)
    return peak


def _earliest_allowed(plans: list[list[list[int]]], rank: int, lane: int, mb: int) -> int:
    """The first slot action (rank, lane, mb) may take: after what it waits for. A first-arm
    forward and a second-arm backward come from the rank before, the others from the rank after;
    on one rank the second arm's forward follows the first's, I follows its F (the second arm's
    I at rank 0 follows the loss's F), the first arm's I follows the second's; a W follows the
    rank's mb-th I; and each lane keeps microbatch order."""
    plan, last_rank = plans[rank], len(plans) - 1
    after = -1
    if lane in (0, 2) and rank > 0:
        after = plans[rank - 1][lane][mb]
    if lane in (1, 3) and rank < last_rank:
        after = max(after, plans[rank + 1][lane][mb])
    if lane in (1, 2, 3):
        after = max(after, plan[lane - 1][mb])
    if lane == 4:
        after = max(after, sorted(plan[2] + plan[3])[mb])
    if mb > 0:
        after = max(after, plan[lane][mb - 1])
    return after + 1


def squeeze(plans: list[list[list[int]]], with_weights: bool) -> list[list[list[int]]]:
    """Move actions to earlier free slots, rank by rank in slot order, without raising the peak
    any rank holds. The steady state (from rank 0's first first-arm I to the first forward of the
    last microbatch's first arm, rank 0's) stays as the block repeats it; the warm-up is squeezed only `with_weights`
    (the W lane placed), the cool-down always."""
    plans = [place_weights(plan, split_by_arm=False) if with_weights else [list(s) for s in plan]
             for plan in plans]
    bound = max(peak_held(plan) for plan in plans)
    last_mb = len(plans[0][0]) - 1
    taken = [set() for _ in plans]
    order = sorted((slot, rank, lane, mb) for rank, plan in enumerate(plans)
                   for lane, slots in enumerate(plan) for mb, slot in enumerate(slots))
    phase = "warm-up"
    for planned, rank, lane, mb in order:
        if phase == "warm-up" and lane == 3 and rank == 0:
            phase = "steady"
        if phase == "steady" or (phase == "warm-up" and not with_weights):
            if phase == "steady" and lane == 0 and mb == last_mb:
                phase = "cool-down"
            taken[rank].add(planned)
            continue
        plans[rank][lane][mb] = _first_free_within_bound(plans, rank, lane, mb, planned, taken[rank], bound)
        taken[rank].add(plans[rank][lane][mb])
    return plans


def _first_free_within_bound(plans: list[list[list[int]]], rank: int, lane: int, mb: int, planned: int,
                             taken: set[int], bound: int) -> int:
    """The earliest slot before `planned` that is free on the rank and keeps its peak within
    `bound`, else `planned`. Only slots before `planned` are free or taken by now: every action
    planned earlier has been placed (the squeeze goes in slot order)."""
    plan = plans[rank]
    for slot in range(_earliest_allowed(plans, rank, lane, mb), planned):
        if slot not in taken:
            plan[lane][mb] = slot
            if peak_held(plan) <= bound:
                return slot
    return planned


def as_soon_as_possible(plans: list[list[list[int]]]) -> list[list[list[int]]]:
    """Start slots when each rank keeps its actions' slot order but runs each as soon as its
    inputs (the `_earliest_allowed` rules but W's, which its rank order already covers) and the
    rank's previous action are done: unit time per action, free links."""
    last_rank = len(plans) - 1
    starts = [[[0] * len(slots) for slots in plan] for plan in plans]
    rank_free = [0] * len(plans)
    order = sorted((slot, rank, lane, mb) for rank, plan in enumerate(plans)
                   for lane, slots in enumerate(plan) for mb, slot in enumerate(slots))
    for _, rank, lane, mb in order:
        ready = rank_free[rank]
        if lane in (0, 2) and rank > 0:
            ready = max(ready, starts[rank - 1][lane][mb] + 1)
        if lane in (1, 3) and rank < last_rank:
            ready = max(ready, starts[rank + 1][lane][mb] + 1)
        if lane in (1, 2, 3):
            ready = max(ready, starts[rank][lane - 1][mb] + 1)
        if mb > 0:
            ready = max(ready, starts[rank][lane][mb - 1] + 1)
        starts[rank][lane][mb] = ready
        rank_free[rank] = ready + 1
    return starts


def build_plans(name: str, n_stages: int, n_microbatches: int) -> list[list[list[int]]]:
    """Every rank's slot plan: the block repeated m times, squeezed with the W placed (warm-up and
    cool-down), compacted, squeezed again without them (cool-down), compacted, and the W placed
    again, now one lane per arm."""
    plans = [_repeat(offsets, n_microbatches) for offsets in steady_offsets(name, n_stages)]
    plans = as_soon_as_possible(squeeze(plans, with_weights=True))
    plans = squeeze([plan[:4] for plan in plans], with_weights=False)
    plans = as_soon_as_possible([place_weights(plan, split_by_arm=False) for plan in plans])
    return [place_weights(plan[:4], split_by_arm=True) for plan in plans]


def _rank_actions(pp_rank: int, n_stages: int, plan: list[list[int]]) -> tuple[Action, ...]:
    first_arm, second_arm = pp_rank, 2 * n_stages - 1 - pp_rank
    lane_action = ((F, first_arm), (F, second_arm), (I, second_arm), (I, first_arm), (W, second_arm),
                   (W, first_arm))
    by_slot = sorted((slot, lane, mb) for lane, slots in enumerate(plan) for mb, slot in enumerate(slots))
    return tuple(lane_action[lane][0](lane_action[lane][1], mb) for _, lane, mb in by_slot)


def _v_memory(name: str, n_stages: int, n_virtual: int, n_microbatches: int) -> Schedule:
    check_v_memory_sizes(name, n_stages, n_virtual, n_microbatches)
    plans = build_plans(name, n_stages, n_microbatches)
    rank_actions = tuple(_rank_actions(r, n_stages, plan) for r, plan in enumerate(plans))
    return Schedule(name=name, n_stages=n_stages, n_virtual=2, n_microbatches=n_microbatches,
                    rank_actions=rank_actions, placement="vshape")


def v_half(n_stages: int, n_virtual: int, n_microbatches: int) -> Schedule:
    """V-Half: about half of 1F1B's activations held per rank; V = 2, m >= 2P (placement vshape)."""
    return _v_memory("v_half", n_stages, n_virtual, n_microbatches)


def v_min(n_stages: int, n_virtual: int, n_microbatches: int) -> Schedule:
    """V-Min: about a third of 1F1B's activations held per rank; V = 2, m >= 2P (placement vshape)."""
    return _v_memory("v_min", n_stages, n_virtual, n_microbatches)
