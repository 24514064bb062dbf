"""Schedule generators: pure functions (P, V, m) -> compute-only `Schedule` (docs/spec.md section 5).

Each returns, per rank, the ordered F and B (or, for the zero-bubble schedules, I and W) actions of
that rank's chunks under the placement it declares: loop (chunk c = v * P + rank) for all but zbv,
dualpipev and the controllable-memory v_half and v_min (the last three in their own modules), which
place their two chunks per rank in a V. Communication is added later by `passes.insert_comm`. Pure
standard library.
"""

from __future__ import annotations

from collections.abc import Callable

from attnres_pp.schedule.dualpipev import check_dualpipev_sizes, dualpipev
from attnres_pp.schedule.ir import Action, B, F, I, Schedule, W
from attnres_pp.schedule.v_memory import check_v_memory_sizes, v_half, v_min


def _check_sizes(n_stages: int, n_virtual: int, n_microbatches: int) -> None:
    sizes = (("stages P", n_stages), ("virtual V", n_virtual), ("microbatches m", n_microbatches))
    for label, value in sizes:
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{label}={value!r} is invalid: must be an integer >= 1")


def gpipe(n_stages: int, n_virtual: int, n_microbatches: int) -> Schedule:
    """All forwards, then all backwards.

    With V > 1 a rank runs every microbatch through its chunk v before chunk v + 1 (breadth first),
    and backwards from its last chunk down; with unit costs and m >= P this keeps the pipeline full
    between virtual rounds, so the bubble is (P-1)/(V m + P - 1), as for interleaved 1F1B.
    """
    _check_sizes(n_stages, n_virtual, n_microbatches)
    rank_actions = []
    for pp_rank in range(n_stages):
        chunks = [v * n_stages + pp_rank for v in range(n_virtual)]
        forwards = [F(c, mb) for c in chunks for mb in range(n_microbatches)]
        backwards = [B(c, mb) for c in reversed(chunks) for mb in range(n_microbatches)]
        rank_actions.append(tuple(forwards + backwards))
    return Schedule(name="gpipe", n_stages=n_stages, n_virtual=n_virtual,
                    n_microbatches=n_microbatches, rank_actions=tuple(rank_actions))


def one_f_one_b(n_stages: int, n_virtual: int, n_microbatches: int) -> Schedule:
    """Classic 1F1B (PipeDream-Flush): P - rank - 1 warmup forwards, then alternate, then drain."""
    _check_sizes(n_stages, n_virtual, n_microbatches)
    if n_virtual != 1:
        raise ValueError(
            f"1f1b runs one chunk per rank but virtual V={n_virtual}: use interleaved_1f1b for V > 1"
        )
    rank_actions = []
    for pp_rank in range(n_stages):
        n_warmup = min(n_stages - pp_rank - 1, n_microbatches)
        actions = [F(pp_rank, mb) for mb in range(n_warmup)]
        for mb in range(n_microbatches - n_warmup):
            actions += [F(pp_rank, mb + n_warmup), B(pp_rank, mb)]
        actions += [B(pp_rank, mb) for mb in range(n_microbatches - n_warmup, n_microbatches)]
        rank_actions.append(tuple(actions))
    return Schedule(name="1f1b", n_stages=n_stages, n_virtual=1,
                    n_microbatches=n_microbatches, rank_actions=tuple(rank_actions))


def microbatch_rounds(n_stages: int, n_microbatches: int) -> list[int]:
    """Sizes of the microbatch groups that sweep through a rank's chunks in the interleaved schedules.

    torch.distributed.pipelining's rounds rule: m // P rounds. torch then needs m divisible by the
    number of rounds; here the rounds may differ by one, the larger first (m = 9, P = 4: 5 and 4).
    Every round has at least P microbatches, so a microbatch finishes its trip through the P ranks
    before its round comes back to the rank's next chunk. (Megatron's alternative, groups of P and
    a smaller remainder last, deadlocks under this runtime's rules for m = 5, V = 3, P = 4 and
    others.) m < P has no round: the interleaved schedules refuse it.
    """
    if n_microbatches < n_stages:
        raise ValueError(f"microbatch rounds need m >= P={n_stages}, got m={n_microbatches}")
    n_rounds = n_microbatches // n_stages
    base, extra = divmod(n_microbatches, n_rounds)
    return [base + (1 if k < extra else 0) for k in range(n_rounds)]


def _refuse_fewer_microbatches_than_stages(name: str, n_stages: int, n_virtual: int, n_microbatches: int) -> None:
    if n_microbatches < n_stages:
        raise ValueError(
            f"{name} with V={n_virtual} needs m >= P={n_stages} microbatches (each round of microbatches "
            f"through a rank's chunks holds at least P), got m={n_microbatches}: use any m >= {n_stages} "
            f"(e.g. {n_stages}, {n_stages + 1}, {2 * n_stages}), or V=1"
        )


def _interleaved(name: str, n_stages: int, n_virtual: int, n_microbatches: int, *, split: bool) -> Schedule:
    """Warmup forwards, then one forward and one backward alternate, then the backwards drain.

    A rank's forwards follow the rounds (`microbatch_rounds`): round by round, every microbatch of
    the round through local chunk 0, then chunk 1, ...; its backwards follow the same order with
    the chunks reversed. Warmup: (V - 1) x (first round) forwards plus 2 per rank after this one
    (Megatron's and torch's count); a split schedule needs 1 per rank after this one, and runs
    each I as B would run, its W `rank` backwards later (torch's ZB1P; the first rank never waits
    for its W), the held-back ones at the end: they fill the drain's idle time.
    """
    rounds = [n_microbatches] if n_virtual == 1 else microbatch_rounds(n_stages, n_microbatches)
    order = []  # (local chunk, microbatch) in forward order
    first = 0
    for size in rounds:
        order += [(v, mb) for v in range(n_virtual) for mb in range(first, first + size)]
        first += size
    rank_actions = tuple(_interleaved_rank(pp_rank, n_stages, n_virtual, order, rounds[0], split)
                         for pp_rank in range(n_stages))
    return Schedule(name=name, n_stages=n_stages, n_virtual=n_virtual, n_microbatches=n_microbatches,
                    rank_actions=rank_actions)


def _interleaved_rank(pp_rank: int, n_stages: int, n_virtual: int, order: list[tuple[int, int]],
                      first_round: int, split: bool) -> tuple[Action, ...]:
    total = len(order)
    forwards = [F(v * n_stages + pp_rank, mb) for v, mb in order]
    backwards = [((n_virtual - 1 - v) * n_stages + pp_rank, mb) for v, mb in order]
    per_later_rank = 1 if split else 2
    n_warmup = min((n_stages - pp_rank - 1) * per_later_rank + (n_virtual - 1) * first_round, total)
    actions = forwards[:n_warmup]
    held: list[tuple[int, int]] = []  # split: backwards whose W has not run yet

    def backward(k: int) -> None:
        if not split:
            actions.append(B(*backwards[k]))
            return
        actions.append(I(*backwards[k]))
        held.append(backwards[k])
        if len(held) > pp_rank:
            actions.append(W(*held.pop(0)))

    for k in range(total - n_warmup):
        actions.append(forwards[n_warmup + k])
        backward(k)
    for k in range(total - n_warmup, total):
        backward(k)
    return tuple(actions + [W(*pair) for pair in held])


def interleaved_1f1b(n_stages: int, n_virtual: int, n_microbatches: int) -> Schedule:
    """Interleaved 1F1B with loop placement (Megatron-LM, torch's ScheduleInterleaved1F1B); V == 1
    is exactly 1F1B. Any m >= P for V > 1 (`microbatch_rounds`)."""
    _check_sizes(n_stages, n_virtual, n_microbatches)
    if n_virtual == 1:
        schedule = one_f_one_b(n_stages, 1, n_microbatches)
        return Schedule(name="interleaved_1f1b", n_stages=n_stages, n_virtual=1,
                        n_microbatches=n_microbatches, rank_actions=schedule.rank_actions)
    _refuse_fewer_microbatches_than_stages("interleaved_1f1b", n_stages, n_virtual, n_microbatches)
    return _interleaved("interleaved_1f1b", n_stages, n_virtual, n_microbatches, split=False)


def zb_h1(n_stages: int, n_virtual: int, n_microbatches: int) -> Schedule:
    """ZB-H1 (Qi et al., zero-bubble pipeline parallelism): 1F1B with B split into I and W. Rank r
    holds back up to r of its W and runs them in the drain, which fills what 1F1B leaves idle:
    bubble (P-1)/(3m+P-1) for m >= P with F = I = W, and 1F1B's activation memory (P in flight)."""
    _check_sizes(n_stages, n_virtual, n_microbatches)
    if n_virtual != 1:
        raise ValueError(f"zb_h1 runs one chunk per rank but virtual V={n_virtual}: use interleaved_zb for V > 1")
    return _interleaved("zb_h1", n_stages, 1, n_microbatches, split=True)


def interleaved_zb(n_stages: int, n_virtual: int, n_microbatches: int) -> Schedule:
    """Interleaved 1F1B with the I/W split (torch's ScheduleInterleavedZeroBubble, the paper's ZB1P):
    loop placement, any m >= P for V > 1; V == 1 is ZB-H1."""
    _check_sizes(n_stages, n_virtual, n_microbatches)
    if n_virtual > 1:
        _refuse_fewer_microbatches_than_stages("interleaved_zb", n_stages, n_virtual, n_microbatches)
    return _interleaved("interleaved_zb", n_stages, n_virtual, n_microbatches, split=True)


def zbv(n_stages: int, n_virtual: int, n_microbatches: int) -> Schedule:
    """ZB-V (the zero-bubble paper, section 6; torch's ScheduleZBVZeroBubble): two chunks per rank in
    a V, chunk r and chunk 2P - 1 - r on rank r, so the middle hop stays on rank P - 1 (in memory).

    Rank r: 2(P - r) - 1 forwards of its first chunk; r pairs (second chunk, first chunk); P - r
    rounds of F, I, W on the second chunk; then, while forwards remain, F I W on the first chunk
    and F I W on the second; the drain runs r pairs of I (first, second chunk), P - r of I, W on
    the first chunk, then the held-back W. Written for max(m, 2P - 1) microbatches and cut to m,
    so any m works; bubble (P-1)/(6m+P-1) for m >= 2P - 1 with F = I = W.
    """
    _check_sizes(n_stages, n_virtual, n_microbatches)
    if n_virtual != 2:
        raise ValueError(f"zbv places exactly 2 chunks per rank (a V), but virtual V={n_virtual}: use virtual=2")
    n_planned = max(n_microbatches, 2 * n_stages - 1)
    rank_actions = tuple(tuple(a for a in _zbv_rank(r, n_stages, n_planned) if a.microbatch_index < n_microbatches)
                         for r in range(n_stages))
    return Schedule(name="zbv", n_stages=n_stages, n_virtual=2, n_microbatches=n_microbatches,
                    rank_actions=rank_actions, placement="vshape")


def _zbv_rank(pp_rank: int, n_stages: int, n_planned: int) -> list[Action]:
    chunk_of = (pp_rank, 2 * n_stages - 1 - pp_rank)  # local chunk 0 and 1: the V's two arms
    forwards, inputs, weights = [0, 0], [0, 0], [0, 0]  # next microbatch per local chunk
    actions: list[Action] = []

    def run(kind, counts: list[int], v: int) -> None:
        actions.append(kind(chunk_of[v], counts[v]))
        counts[v] += 1

    for _ in range(2 * (n_stages - pp_rank) - 1):
        run(F, forwards, 0)
    for _ in range(pp_rank):
        run(F, forwards, 1)
        run(F, forwards, 0)
    for _ in range(n_stages - pp_rank):
        run(F, forwards, 1)
        run(I, inputs, 1)
        run(W, weights, 1)
    while forwards[1] < forwards[0] or forwards[0] < n_planned:
        if forwards[0] < n_planned:
            run(F, forwards, 0)
        run(I, inputs, 0)
        run(W, weights, 0)
        run(F, forwards, 1)
        run(I, inputs, 1)
        run(W, weights, 1)
    for _ in range(pp_rank):
        run(I, inputs, 0)
        run(I, inputs, 1)
    for _ in range(n_stages - pp_rank):
        run(I, inputs, 0)
        run(W, weights, 0)
    while weights[1] < inputs[1]:
        run(W, weights, 1)
    while weights[0] < inputs[0]:
        run(W, weights, 0)
    return actions


SCHEDULES: dict[str, Callable[[int, int, int], Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved_1f1b": interleaved_1f1b,
    "zb_h1": zb_h1,
    "interleaved_zb": interleaved_zb,
    "zbv": zbv,
    "dualpipev": dualpipev,
    "v_half": v_half,
    "v_min": v_min,
}


# The schedules whose backward is split into I (input gradients) and W (weight gradients): the runtime
# keeps a W store for them, and the simulator and the planner count it.
SPLIT_SCHEDULES = frozenset({"zb_h1", "interleaved_zb", "zbv", "dualpipev", "v_half", "v_min"})


# The chunk -> rank placement each schedule declares (docs/spec.md section 3); the partition a run builds
# for a schedule must use it, so that chunks live where the schedule runs them.
PLACEMENT_OF = {name: "vshape" if name in ("zbv", "dualpipev", "v_half", "v_min") else "loop" for name in SCHEDULES}


# Size rules a run's config checks before any rank starts, for the schedules whose generator would
# otherwise refuse only on the ranks (each raises the generator's own message).
SIZE_CHECKS: dict[str, Callable[[int, int, int], None]] = {
    "dualpipev": check_dualpipev_sizes,
    "v_half": lambda p, v, m: check_v_memory_sizes("v_half", p, v, m),
    "v_min": lambda p, v, m: check_v_memory_sizes("v_min", p, v, m),
}


def schedule_placement(name: str) -> str:
    if name not in SCHEDULES:
        raise ValueError(f"schedule {name!r} is unknown; choose one of {', '.join(SCHEDULES)}")
    return PLACEMENT_OF[name]


def build_schedule(name: str, n_stages: int, n_virtual: int, n_microbatches: int) -> Schedule:
    """The compute-only schedule `name` for P ranks, V chunks per rank and m microbatches."""
    if name not in SCHEDULES:
        raise ValueError(f"schedule {name!r} is unknown; choose one of {', '.join(SCHEDULES)}")
    _check_sizes(n_stages, n_virtual, n_microbatches)
    return SCHEDULES[name](n_stages, n_virtual, n_microbatches)
