"""Schedule passes. `insert_comm` is the one place communication is placed (docs/architecture.md rule 2).

Pure standard library.
"""

from __future__ import annotations

from attnres_pp.schedule.ir import Action, ActionKind, Schedule


def insert_comm(schedule: Schedule) -> Schedule:
    """Lower a compute-only schedule: wrap every F and B (or I) in the receives and sends it needs.

    On the rank of chunk c, for microbatch mb:
        RF c.mb  before F c.mb   (c > 0)        SF c.mb  after F c.mb   (c < C - 1)
        RB c.mb  before B c.mb   (c < C - 1)    SB c.mb  after B c.mb   (c > 0)
    I takes B's place (it makes the input gradients); W stays as it is: it exchanges nothing.
    Receives sit right before their compute, so a rank blocks only on what it needs next; sends
    sit right after, and the runtime posts them without waiting (isend). A hop between two chunks
    of the same rank (every hop when P == 1; ZB-V's middle hop) keeps its send and receive too: the
    runtime hands such a self-hop's tensors over in memory without touching the transport, and
    the simulator charges it no link time, so the runtime, simulator and validator see one shape
    of schedule for every placement.
    """
    if schedule.has_comm:
        raise ValueError(f"schedule {schedule.name!r} already has communication: insert_comm runs once")
    last_chunk = schedule.n_chunks - 1
    # Local names: enum attribute lookups dominate this loop on million-action schedules.
    forward, recv_f, send_f = ActionKind.F, ActionKind.RECV_F, ActionKind.SEND_F
    recv_b, send_b, weight = ActionKind.RECV_B, ActionKind.SEND_B, ActionKind.W
    lowered = []
    for actions in schedule.rank_actions:
        out: list[Action] = []
        append = out.append
        for action in actions:
            chunk, microbatch = action.chunk_index, action.microbatch_index
            if action.kind is forward:
                if chunk > 0:
                    append(Action(recv_f, chunk, microbatch))
                append(action)
                if chunk < last_chunk:
                    append(Action(send_f, chunk, microbatch))
            elif action.kind is weight:
                append(action)
            else:
                if chunk < last_chunk:
                    append(Action(recv_b, chunk, microbatch))
                append(action)
                if chunk > 0:
                    append(Action(send_b, chunk, microbatch))
        lowered.append(tuple(out))
    return Schedule(name=schedule.name, n_stages=schedule.n_stages, n_virtual=schedule.n_virtual,
                    n_microbatches=schedule.n_microbatches, rank_actions=tuple(lowered), placement=schedule.placement)
