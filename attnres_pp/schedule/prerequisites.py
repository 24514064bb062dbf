"""What must run before an action (the dependency rule every validator and the NCCL issue plan
share), and the error a schedule that breaks it raises. Pure standard library; below both
`validate` and `validate_nccl`, so neither imports the other's internals."""

from __future__ import annotations

from attnres_pp.schedule.ir import INPUT_GRAD_KINDS, Action, ActionKind, Schedule


class ScheduleError(ValueError):
    """A schedule that would compute the wrong thing, or hang."""


def input_grad_actions(schedule: Schedule) -> dict[tuple[int, int], Action]:
    """(chunk, microbatch) -> the action that makes its input gradients: B, or I in a split."""
    return {(a.chunk_index, a.microbatch_index): a for actions in schedule.rank_actions for a in actions
            if a.kind in INPUT_GRAD_KINDS}


def prerequisites(action: Action, last_chunk: int, has_comm: bool,
                   input_grad: dict[tuple[int, int], Action]) -> tuple[Action, ...]:
    """What must have run (on any rank) before `action` can run."""
    kind, chunk, microbatch = action.kind, action.chunk_index, action.microbatch_index
    if kind is ActionKind.F:
        if chunk == 0:
            return ()
        return (Action(ActionKind.RECV_F, chunk, microbatch) if has_comm
                else Action(ActionKind.F, chunk - 1, microbatch),)
    if kind in INPUT_GRAD_KINDS:
        if chunk == last_chunk:
            return (Action(ActionKind.F, chunk, microbatch),)
        if has_comm:
            return (Action(ActionKind.RECV_B, chunk, microbatch),)
        return (input_grad.get((chunk + 1, microbatch), Action(ActionKind.B, chunk + 1, microbatch)),)
    if kind is ActionKind.W:
        return (Action(ActionKind.I, chunk, microbatch),)
    if kind is ActionKind.SEND_F:
        return (Action(ActionKind.F, chunk, microbatch),)
    if kind is ActionKind.SEND_B:
        return (input_grad.get((chunk, microbatch), Action(ActionKind.B, chunk, microbatch)),)
    return (action.matching(),)  # a receive waits for its send
