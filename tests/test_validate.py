"""The validator rejects broken schedules with a reason (and a step x rank table on deadlock)."""

from __future__ import annotations

import pytest

from attnres_pp.pipeline.ir import Action, Schedule
from attnres_pp.pipeline.passes import insert_comm
from attnres_pp.pipeline.schedules import build_schedule
from attnres_pp.pipeline.validate import ScheduleError, validate


def _edit(schedule: Schedule, pp_rank: int, words: str) -> Schedule:
    """`schedule` with rank `pp_rank`'s list replaced by the actions in `words`."""
    lists = list(schedule.rank_actions)
    lists[pp_rank] = tuple(Action.parse(w) for w in words.split())
    return Schedule(name=schedule.name, n_stages=schedule.n_stages, n_virtual=schedule.n_virtual,
                    n_microbatches=schedule.n_microbatches, rank_actions=tuple(lists))


LOWERED = insert_comm(build_schedule("1f1b", 2, 1, 1))  # rank 0: F0.0 SF0.0 RB0.0 B0.0


def test_dropped_receive():
    broken = _edit(LOWERED, 1, "F1.0 B1.0 SB1.0")
    with pytest.raises(ScheduleError, match="SF0.0 on rank 0 has no matching RF1.0 on rank 1"):
        validate(broken)


def test_swapped_send_and_receive_deadlock_prints_table():
    broken = _edit(LOWERED, 0, "F0.0 RB0.0 SF0.0 B0.0")
    with pytest.raises(ScheduleError) as info:
        validate(broken)
    message = str(info.value)
    assert "deadlocks at step 1" in message
    assert "rank 0 is blocked at RB0.0, waiting for SB1.0 (rank 1)" in message
    assert "rank 1 is blocked at RF1.0, waiting for SF0.0 (rank 0)" in message
    table = message.split("blocked at X):\n")[1].splitlines()
    assert table[0].split() == ["step", "|", "rank", "0", "|", "rank", "1"]
    assert table[1].split() == ["0", "|", "F0.0", "|", "."]
    assert table[2].split() == ["blocked", "|", "[RB0.0]", "|", "[RF1.0]"]


def test_compute_order_deadlock_without_comm():
    schedule = build_schedule("interleaved_1f1b", 2, 2, 2)
    words = [str(a) for a in schedule.rank_actions[0]]
    words[0], words[2] = words[2], words[0]  # F2.0 first: it needs F1.0, which needs F0.0
    with pytest.raises(ScheduleError, match=r"(?s)deadlocks.*\[F2\.0\]"):
        validate(_edit(schedule, 0, " ".join(words)))


def test_duplicated_forward():
    broken = _edit(build_schedule("gpipe", 2, 1, 2), 0, "F0.0 F0.0 F0.1 B0.0 B0.1")
    with pytest.raises(ScheduleError, match="F0.0 appears twice on rank 0"):
        validate(broken)


def test_missing_backward_and_wrong_order_and_wrong_rank():
    schedule = build_schedule("gpipe", 2, 1, 2)
    with pytest.raises(ScheduleError, match="B0.1 is missing from rank 0"):
        validate(_edit(schedule, 0, "F0.0 F0.1 B0.0"))
    with pytest.raises(ScheduleError, match="B0.0 runs before F0.0 on rank 0"):
        validate(_edit(schedule, 0, "B0.0 F0.0 F0.1 B0.1"))
    with pytest.raises(ScheduleError, match="chunk 1 runs on rank 1"):
        validate(_edit(schedule, 0, "F0.0 F0.1 B0.0 B0.1 F1.0"))


def test_send_past_the_last_chunk_and_missing_receive_for_compute():
    with pytest.raises(ScheduleError, match="SF1.0 has no peer"):
        validate(_edit(LOWERED, 1, "RF1.0 F1.0 SF1.0 B1.0 SB1.0"))
    # Drop both ends of the backward hop: the matching holds but B0.0 lacks its input.
    no_backward_hop = _edit(_edit(LOWERED, 0, "F0.0 SF0.0 B0.0"), 1, "RF1.0 F1.0 B1.0")
    with pytest.raises(ScheduleError, match="B0.0 needs RB0.0 on rank 0"):
        validate(no_backward_hop)
