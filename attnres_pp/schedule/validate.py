"""Schedule validation: every F and B (or I and W) exactly once on its rank, sends matched with
receives, cache deposits made before they are collected, and a unit-time execution that proves the
schedule cannot deadlock; and the same for forward-only schedules (`validate_forward_only`: every F
once and in order, no backward). Pure standard library.

Works on compute-only schedules (a chunk's input is then the previous chunk's compute) and on
lowered ones (`passes.insert_comm`; the input is then the receive). The execution model is the
runtime's: sends are buffered and never block; a receive blocks until its send has run; messages
are matched by tag (`Action.message_id`), so two ranks may exchange messages in any order and no
FIFO order per (sender, receiver) pair is assumed.
"""

from __future__ import annotations

from collections import Counter, deque

from attnres_pp.schedule.ir import INPUT_GRAD_KINDS, Action, ActionKind, Schedule
from attnres_pp.schedule.prerequisites import ScheduleError, input_grad_actions, prerequisites
from attnres_pp.schedule.validate_nccl import NcclDeadlock, P2PMismatch, check_nccl

# Rows of the step x rank table kept for a deadlock report (the last ones matter).
_TABLE_ROWS = 40


def validate(schedule: Schedule, p2p_semantics: str = "gloo") -> None:
    """Raise ScheduleError with a readable reason if `schedule` is not safe to run. With
    p2p_semantics="nccl" a lowered schedule must also finish under NCCL's point-to-point rules in
    the order the runtime issues it (`validate_nccl`)."""
    _check_placement(schedule)
    _check_compute_once(schedule)
    _check_deposits_before_collection(schedule)
    if schedule.has_comm:
        _check_messages(schedule)
    _check_no_deadlock(schedule)
    if p2p_semantics == "nccl" and schedule.has_comm:
        try:
            check_nccl(schedule)
        except (NcclDeadlock, P2PMismatch) as error:
            raise ScheduleError(str(error)) from None
    elif p2p_semantics not in ("gloo", "nccl"):
        raise ValueError(f"p2p_semantics={p2p_semantics!r} is invalid: choose 'gloo' or 'nccl'")


_BACKWARD_KINDS = frozenset({ActionKind.B, ActionKind.I, ActionKind.W, ActionKind.SEND_B, ActionKind.RECV_B})


def validate_forward_only(schedule: Schedule) -> None:
    """Raise ScheduleError unless a forward-only schedule (evaluation, generation) runs every chunk
    on each microbatch (piece) once, in piece order, on its own rank, has no backward action, every
    message has its other end, and unit-time execution cannot deadlock. In place of `validate`'s
    "every F has its B", which does not apply here."""
    _check_placement(schedule)
    for pp_rank, actions in enumerate(schedule.rank_actions):
        if any(a.kind in _BACKWARD_KINDS for a in actions):
            raise ScheduleError(f"rank {pp_rank}: a forward-only schedule has backward actions")
        for chunk in schedule.chunks_of(pp_rank):
            pieces = [a.microbatch_index for a in actions if a.kind is ActionKind.F and a.chunk_index == chunk]
            if pieces != list(range(schedule.n_microbatches)):
                raise ScheduleError(
                    f"rank {pp_rank}: chunk {chunk} runs pieces {pieces}, expected each of "
                    f"0..{schedule.n_microbatches - 1} once and in order (the key/value cache needs it)")
    if schedule.has_comm:
        _check_messages(schedule)
    _check_no_deadlock(schedule)


def _check_placement(schedule: Schedule) -> None:
    n_chunks, n_microbatches = schedule.n_chunks, schedule.n_microbatches
    for pp_rank, actions in enumerate(schedule.rank_actions):
        for action in actions:
            if not 0 <= action.chunk_index < n_chunks:
                raise ScheduleError(f"{action} on rank {pp_rank}: chunk {action.chunk_index} is outside "
                                    f"0..{n_chunks - 1} (P={schedule.n_stages} x V={schedule.n_virtual})")
            if not 0 <= action.microbatch_index < n_microbatches:
                raise ScheduleError(f"{action} on rank {pp_rank}: microbatch {action.microbatch_index} "
                                    f"is outside 0..{n_microbatches - 1}")
            owner = schedule.rank_of(action.chunk_index)
            if owner != pp_rank:
                raise ScheduleError(f"{action} is on rank {pp_rank}, but chunk {action.chunk_index} "
                                    f"runs on rank {owner} ({schedule.placement} placement)")


def _check_compute_once(schedule: Schedule) -> None:
    """Each (chunk, microbatch) has its F and either B or the pair I, W, in the order F, B or F, I, W."""
    kind_b, kind_i, kind_w = ActionKind.B, ActionKind.I, ActionKind.W
    for pp_rank, actions in enumerate(schedule.rank_actions):
        position: dict[Action, int] = {}
        for index, action in enumerate(actions):
            if action in position:
                raise ScheduleError(f"{action} appears twice on rank {pp_rank} "
                                    f"(positions {position[action]} and {index})")
            position[action] = index
        for chunk in schedule.chunks_of(pp_rank):
            for microbatch in range(schedule.n_microbatches):
                forward = Action(ActionKind.F, chunk, microbatch)
                fused = Action(kind_b, chunk, microbatch)
                split = (Action(kind_i, chunk, microbatch), Action(kind_w, chunk, microbatch))
                if fused in position and any(a in position for a in split):
                    raise ScheduleError(f"{fused} and {' / '.join(str(a) for a in split if a in position)} "
                                        f"both on rank {pp_rank}: a backward is either B or the pair I, W")
                chain = (forward, fused) if fused in position or not any(a in position for a in split) \
                    else (forward, *split)
                for needed in chain:
                    if needed not in position:
                        raise ScheduleError(f"{needed} is missing from rank {pp_rank}")
                for before, after in zip(chain, chain[1:], strict=False):
                    if position[after] < position[before]:
                        raise ScheduleError(f"{after} runs before {before} on rank {pp_rank}")


def _check_deposits_before_collection(schedule: Schedule) -> None:
    """docs/spec.md section 5: a chunk's I (or B) runs only after every deposit into the cache entries it collects.

    Entries a chunk puts in its rank's cache are read by the rank's later chunks, whose I (or B)
    deposits the gradients of those reads; so on every rank, per microbatch, the input-gradient
    actions must run from the rank's last chunk down. (The schedule alone does not say which
    entries a payload plan caches, so this holds every later chunk of the rank to it; a schedule
    that runs cannot break it, as each chunk's I waits for the next chunk's, but a hand-written
    one can, and this says why instead of a deadlock table.)
    """
    for pp_rank, actions in enumerate(schedule.rank_actions):
        latest: dict[int, Action] = {}  # microbatch -> the input-gradient action seen last on this rank
        for action in actions:
            if action.kind not in INPUT_GRAD_KINDS:
                continue
            before = latest.get(action.microbatch_index)
            if before is not None and before.chunk_index < action.chunk_index:
                raise ScheduleError(
                    f"{before} runs before {action} on rank {pp_rank}, but chunk {action.chunk_index} "
                    f"deposits the gradients of its cache reads into entries chunk {before.chunk_index} "
                    f"collects: a chunk's input gradients must wait for every later chunk's on its rank")
            latest[action.microbatch_index] = action


def _check_messages(schedule: Schedule) -> None:
    last_chunk = schedule.n_chunks - 1
    sends: Counter = Counter()
    receives: Counter = Counter()
    ordered = [action for actions in schedule.rank_actions for action in actions]
    present = set(ordered)
    for action in ordered:
        if not action.is_compute:
            if not 0 <= action.matching().chunk_index <= last_chunk:
                raise ScheduleError(f"{action} has no peer: chunk {action.matching().chunk_index} "
                                    f"does not exist (chunks 0..{last_chunk})")
            (sends if action.is_send else receives)[action.message_id] += 1
    # Walk in schedule order (not set order) so the first error reported is the same every run.
    for action in ordered:
        if action.is_compute:
            continue
        mine, theirs = (sends, receives) if action.is_send else (receives, sends)
        if mine[action.message_id] > 1:
            raise ScheduleError(f"{action} appears {mine[action.message_id]} times")
        if theirs[action.message_id] == 0:
            raise ScheduleError(
                f"{action} on rank {schedule.rank_of(action.chunk_index)} has no matching "
                f"{action.matching()} on rank {schedule.peer(action)}"
            )
    # Every compute that takes an input from another chunk needs the receive that brings it.
    for action in ordered:
        if action.kind is ActionKind.F and action.chunk_index > 0:
            needed = Action(ActionKind.RECV_F, action.chunk_index, action.microbatch_index)
        elif action.kind in INPUT_GRAD_KINDS and action.chunk_index < last_chunk:
            needed = Action(ActionKind.RECV_B, action.chunk_index, action.microbatch_index)
        else:
            continue
        if needed not in present:
            raise ScheduleError(f"{action} needs {needed} on rank {schedule.rank_of(action.chunk_index)}, "
                                f"which the schedule lacks")


def _check_no_deadlock(schedule: Schedule) -> None:
    """Run every rank's list with unit time per action; raise with a step x rank table on a hang."""
    last_chunk, has_comm = schedule.n_chunks - 1, schedule.has_comm
    input_grad = input_grad_actions(schedule)
    lists = schedule.rank_actions
    cursor = [0] * schedule.n_stages
    done: set[Action] = set()
    rows: deque[tuple[int, list[str]]] = deque(maxlen=_TABLE_ROWS)
    step = 0
    remaining = sum(len(actions) for actions in lists)
    while remaining:
        # Decide every rank's move from the state at the start of the step, then commit.
        ran = [lists[r][cursor[r]] if cursor[r] < len(lists[r]) and all(
            p in done for p in prerequisites(lists[r][cursor[r]], last_chunk, has_comm, input_grad)) else None
            for r in range(schedule.n_stages)]
        if not any(ran):
            raise ScheduleError(_deadlock_report(schedule, cursor, done, rows, step))
        rows.append((step, [str(a) if a else "." for a in ran]))
        for pp_rank, action in enumerate(ran):
            if action is not None:
                done.add(action)
                cursor[pp_rank] += 1
                remaining -= 1
        step += 1


def _deadlock_report(schedule: Schedule, cursor: list[int], done: set[Action],
                     rows: deque, step: int) -> str:
    last_chunk, has_comm = schedule.n_chunks - 1, schedule.has_comm
    input_grad = input_grad_actions(schedule)
    blocked_row, reasons = [], []
    for pp_rank, actions in enumerate(schedule.rank_actions):
        if cursor[pp_rank] == len(actions):
            blocked_row.append("done")
            continue
        action = actions[cursor[pp_rank]]
        blocked_row.append(f"[{action}]")
        missing = [p for p in prerequisites(action, last_chunk, has_comm, input_grad) if p not in done]
        waits = ", ".join(f"{p} (rank {schedule.rank_of(p.chunk_index)})" for p in missing)
        reasons.append(f"  rank {pp_rank} is blocked at {action}, waiting for {waits}")
    header = ["step"] + [f"rank {r}" for r in range(schedule.n_stages)]
    table = [header] + [[str(s)] + cells for s, cells in rows] + [["blocked"] + blocked_row]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines = [" | ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
             for row in table]
    skipped = step - len(rows)
    if skipped:
        lines.insert(1, f"... ({skipped} earlier steps)")
    return (f"schedule {schedule.name!r} (P={schedule.n_stages}, V={schedule.n_virtual}, "
            f"m={schedule.n_microbatches}) deadlocks at step {step}: no rank can progress.\n"
            + "\n".join(reasons)
            + "\nunit-time execution ('.' = idle, [X] = blocked at X):\n" + "\n".join(lines))
