"""Forward-only schedules for generation (docs/spec.md section 7): a training schedule's F actions, no B.

One generation pass sends m pieces of tokens (the prompt's prefill pieces, or m = 1 new token)
through every chunk. A rank runs each of its chunks over every piece before its next chunk (GPipe's
forward order, breadth first): the pipeline fills as in training, and each layer sees its pieces in
position order, which its key/value cache needs (a piece attends to the pieces before it).

The result is lowered by the same `passes.insert_comm` and checked by the validator's own placement,
message and deadlock checks; only "every F has its B" does not apply to a forward-only schedule, so
its place is taken here by "every F exactly once, pieces of a chunk in order". It is also proven
deadlock-free under NCCL's point-to-point rules (`validate_nccl.check_nccl`) when issued in
`validate_nccl.lockstep_plan`'s groups, the order the generation runtime issues on NCCL ranks.
Posting every receive of a pass up front, as the runtime may under gloo's tag matching, is not such
an order: one NCCL stream runs a rank's receive groups before its later sends, so at V >= 2 a rank
waits for a message whose chain needs its own send (`tests/test_generate_nccl.py` checks the model
rejects it).
"""

from __future__ import annotations

from functools import lru_cache

from attnres_pp.schedule import validate as _validate
from attnres_pp.schedule.ir import ActionKind, Schedule
from attnres_pp.schedule.passes import insert_comm
from attnres_pp.schedule.schedules import gpipe
from attnres_pp.schedule.validate_nccl import check_nccl


def forward_only(schedule: Schedule) -> Schedule:
    """`schedule` without its backward actions (compute-only schedules)."""
    if schedule.has_comm:
        raise ValueError("forward_only takes a compute-only schedule: apply it before insert_comm")
    return Schedule(name=f"{schedule.name}_forward", n_stages=schedule.n_stages, n_virtual=schedule.n_virtual,
                    n_microbatches=schedule.n_microbatches, placement=schedule.placement,
                    rank_actions=tuple(tuple(a for a in actions if a.kind is ActionKind.F)
                                       for actions in schedule.rank_actions))


_BACKWARD_KINDS = frozenset({ActionKind.B, ActionKind.I, ActionKind.W, ActionKind.SEND_B, ActionKind.RECV_B})


def validate_forward_only(schedule: Schedule) -> None:
    """Raise ScheduleError unless every chunk runs each piece once, in piece order, on its own rank,
    every message has its other end, and unit-time execution cannot deadlock."""
    _validate._check_placement(schedule)
    for pp_rank, actions in enumerate(schedule.rank_actions):
        if any(a.kind in _BACKWARD_KINDS for a in actions):
            raise _validate.ScheduleError(f"rank {pp_rank}: a forward-only schedule has backward actions")
        for chunk in schedule.chunks_of(pp_rank):
            pieces = [a.microbatch_index for a in actions if a.kind is ActionKind.F and a.chunk_index == chunk]
            if pieces != list(range(schedule.n_microbatches)):
                raise _validate.ScheduleError(
                    f"rank {pp_rank}: chunk {chunk} runs pieces {pieces}, expected each of "
                    f"0..{schedule.n_microbatches - 1} once and in order (the key/value cache needs it)")
    if schedule.has_comm:
        _validate._check_messages(schedule)
    _validate._check_no_deadlock(schedule)


@lru_cache(maxsize=64)
def generation_schedule(n_stages: int, n_virtual: int, n_pieces: int) -> Schedule:
    """The lowered, validated forward-only schedule of one pass of `n_pieces` pieces (loop placement),
    proven to finish under gloo's rules and, issued in `lockstep_plan`'s groups, under NCCL's."""
    schedule = insert_comm(forward_only(gpipe(n_stages, n_virtual, n_pieces)))
    validate_forward_only(schedule)
    check_nccl(schedule)
    return schedule
