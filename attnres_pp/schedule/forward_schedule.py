"""Forward-only schedules (docs/spec.md section 7): F actions and their hops, no backward and no deposits,
for pipelined evaluation (`forward_only_schedule`) and for one generation pass
(`generation_schedule`); and `forward_only`, a compute schedule without its backward actions.

Order per rank: GPipe's forward half, breadth first: every microbatch (or piece of tokens) through
one chunk before the rank's next chunk, in the order a microbatch visits the rank's chunks. The
pipeline fills as in training, every hop's sends leave in the order their receiver posts the
receives (so it runs under NCCL's in-order matching as well as gloo's tags), and each layer sees
a generation pass's pieces in position order, which its key/value cache needs (a piece attends to
the pieces before it).

Both are lowered by `passes.insert_comm` and checked by `validate.validate_forward_only`. A
generation pass is also proven deadlock-free under NCCL's point-to-point rules
(`validate_nccl.check_nccl`) when issued in `validate_nccl.lockstep_plan`'s groups, the order the
executor issues on NCCL ranks. Posting every receive of a pass up front, as the executor may under
gloo's tag matching, is not such an order: one NCCL stream runs a rank's receive groups before its
later sends, so at V >= 2 a rank waits for a message whose chain needs its own send
(`tests/parity/test_generate_nccl.py` checks the model rejects it).
"""

from __future__ import annotations

from functools import lru_cache

from attnres_pp.comm.partition import chunk_rank
from attnres_pp.schedule.ir import ActionKind, F, Schedule
from attnres_pp.schedule.passes import insert_comm
from attnres_pp.schedule.validate import validate_forward_only
from attnres_pp.schedule.validate_nccl import check_nccl

__all__ = ["forward_only", "forward_only_schedule", "generation_schedule", "validate_forward_only"]


def forward_only(schedule: Schedule) -> Schedule:
    """`schedule` without its backward actions (compute-only schedules)."""
    if schedule.has_comm:
        raise ValueError("forward_only takes a compute-only schedule: apply it before insert_comm")
    return Schedule(name=f"{schedule.name}_forward", n_stages=schedule.n_stages, n_virtual=schedule.n_virtual,
                    n_microbatches=schedule.n_microbatches, placement=schedule.placement,
                    rank_actions=tuple(tuple(a for a in actions if a.kind is ActionKind.F)
                                       for actions in schedule.rank_actions))


def forward_only_schedule(n_stages: int, n_virtual: int, n_microbatches: int, placement: str = "loop") -> Schedule:
    """The lowered, validated forward-only schedule of P ranks x V chunks and m microbatches."""
    n_chunks = n_stages * n_virtual
    rank_actions = []
    for pp_rank in range(n_stages):
        chunks = [c for c in range(n_chunks) if chunk_rank(c, n_stages, placement) == pp_rank]
        rank_actions.append(tuple(F(c, mb) for c in chunks for mb in range(n_microbatches)))
    schedule = insert_comm(Schedule(name="forward_only", n_stages=n_stages, n_virtual=n_virtual,
                                    n_microbatches=n_microbatches, rank_actions=tuple(rank_actions),
                                    placement=placement))
    validate_forward_only(schedule)
    return schedule


@lru_cache(maxsize=64)
def generation_schedule(n_stages: int, n_virtual: int, n_pieces: int) -> Schedule:
    """The lowered, validated forward-only schedule of one pass of `n_pieces` pieces (loop placement),
    proven to finish under gloo's rules and, issued in `lockstep_plan`'s groups, under NCCL's."""
    schedule = forward_only_schedule(n_stages, n_virtual, n_pieces)
    check_nccl(schedule)
    return schedule
