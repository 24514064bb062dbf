"""Schedule generators: pure functions (P, V, m) -> compute-only `Schedule` (SPEC section 5).

Each returns, per rank, the ordered F/B actions of that rank's chunks under loop placement
(chunk c = v * P + rank). Communication is added later by `passes.insert_comm`. Pure standard
library.
"""

from __future__ import annotations

from collections.abc import Callable

from attnres_pp.pipeline.ir import B, F, Schedule


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


def interleaved_1f1b(n_stages: int, n_virtual: int, n_microbatches: int) -> Schedule:
    """Megatron-LM's interleaved 1F1B with loop placement; V == 1 is exactly 1F1B.

    Virtual microbatch k (0 .. V m - 1) of a rank is local chunk (k // P) % V (reversed for the
    backward) and microbatch (k // (P V)) * P + k % P: groups of P microbatches sweep through the
    rank's chunks. Warmup runs (P - rank - 1) * 2 + (V - 1) * P forwards (capped at V m), then
    one forward and one backward alternate, then the remaining backwards drain.
    """
    _check_sizes(n_stages, n_virtual, n_microbatches)
    if n_virtual == 1:
        schedule = one_f_one_b(n_stages, 1, n_microbatches)
        return Schedule(name="interleaved_1f1b", n_stages=n_stages, n_virtual=1,
                        n_microbatches=n_microbatches, rank_actions=schedule.rank_actions)
    if n_microbatches % n_stages:
        lowest = max(1, n_microbatches // n_stages) * n_stages
        options = ", ".join(str(lowest + k * n_stages) for k in range(3))
        raise ValueError(
            f"interleaved_1f1b with V={n_virtual}: m must be a multiple of P={n_stages} "
            f"(Megatron's microbatch groups), got m={n_microbatches}: try {options}"
        )
    group = n_stages * n_virtual
    total = n_microbatches * n_virtual

    def forward(pp_rank: int, k: int):
        local = (k // n_stages) % n_virtual
        return F(local * n_stages + pp_rank, (k // group) * n_stages + k % n_stages)

    def backward(pp_rank: int, k: int):
        local = n_virtual - 1 - (k // n_stages) % n_virtual
        return B(local * n_stages + pp_rank, (k // group) * n_stages + k % n_stages)

    rank_actions = []
    for pp_rank in range(n_stages):
        n_warmup = min((n_stages - pp_rank - 1) * 2 + (n_virtual - 1) * n_stages, total)
        actions = [forward(pp_rank, k) for k in range(n_warmup)]
        for k in range(total - n_warmup):
            actions += [forward(pp_rank, k + n_warmup), backward(pp_rank, k)]
        actions += [backward(pp_rank, k) for k in range(total - n_warmup, total)]
        rank_actions.append(tuple(actions))
    return Schedule(name="interleaved_1f1b", n_stages=n_stages, n_virtual=n_virtual,
                    n_microbatches=n_microbatches, rank_actions=tuple(rank_actions))


SCHEDULES: dict[str, Callable[[int, int, int], Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved_1f1b": interleaved_1f1b,
}


# The chunk -> rank placement each schedule declares (SPEC section 3); the partition a run builds
# for a schedule must use it, so that chunks live where the schedule runs them.
PLACEMENT_OF = {name: "loop" for name in SCHEDULES}


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
