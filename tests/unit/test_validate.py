"""The validator rejects broken schedules with a reason (and a step x rank table on deadlock)."""

from __future__ import annotations

import pytest

from attnres_pp.schedule.forward_schedule import forward_only_schedule
from attnres_pp.schedule.ir import Action, Schedule
from attnres_pp.schedule.passes import insert_comm
from attnres_pp.schedule.schedules import build_schedule
from attnres_pp.schedule.validate import ScheduleError, validate, validate_forward_only


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


SPLIT = build_schedule("zb_h1", 2, 1, 1)  # rank 0: F0.0 I0.0 W0.0; rank 1: F1.0 I1.0 W1.0


def test_split_backward_needs_both_halves_in_order_and_never_with_b():
    with pytest.raises(ScheduleError, match="W0.0 is missing from rank 0"):
        validate(_edit(SPLIT, 0, "F0.0 I0.0"))
    with pytest.raises(ScheduleError, match="W0.0 runs before I0.0 on rank 0"):
        validate(_edit(SPLIT, 0, "F0.0 W0.0 I0.0"))
    with pytest.raises(ScheduleError, match="B0.0 and I0.0 / W0.0 both on rank 0"):
        validate(_edit(SPLIT, 0, "F0.0 B0.0 I0.0 W0.0"))
    # Lowered: I waits for the backward hop's receive as B does, and SB follows I.
    validate(insert_comm(SPLIT))
    with pytest.raises(ScheduleError, match="I0.0 needs RB0.0 on rank 0"):
        validate(_edit(_edit(insert_comm(SPLIT), 0, "F0.0 SF0.0 I0.0 W0.0"), 1, "RF1.0 F1.0 I1.0 W1.0"))


def _lists(schedule: Schedule, lists: dict[int, str]) -> Schedule:
    out = list(schedule.rank_actions)
    for rank, words in lists.items():
        out[rank] = tuple(Action.parse(w) for w in words.split())
    return Schedule(name=schedule.name, n_stages=schedule.n_stages, n_virtual=schedule.n_virtual,
                    n_microbatches=schedule.n_microbatches, rank_actions=tuple(out), placement=schedule.placement)


@pytest.mark.parametrize("lowered", [False, True])
def test_input_gradients_before_the_deposits_they_collect_are_refused(lowered):
    """P = 2, V = 2: chunk 2 (rank 0) reads what chunk 0 put in rank 0's cache, so I0.0 must wait
    for I2.0, whose reads deposit into those entries. The check names both, before any deadlock
    table; schedules that run always pass it (each chunk's I waits for the next chunk's)."""
    schedule = build_schedule("interleaved_zb", 2, 2, 2)
    validate(schedule)
    broken = _lists(schedule, {0: "F0.0 F0.1 F2.0 F2.1 I0.0 W0.0 I2.0 W2.0 I2.1 W2.1 I0.1 W0.1"})
    with pytest.raises(ScheduleError, match="I0.0 runs before I2.0 on rank 0, but chunk 2 deposits"):
        validate(insert_comm(broken) if lowered else broken)
    # The same with fused backwards.
    fused = _lists(build_schedule("interleaved_1f1b", 2, 2, 2), {0: "F0.0 F0.1 F2.0 F2.1 B0.0 B2.0 B2.1 B0.1"})
    with pytest.raises(ScheduleError, match="B0.0 runs before B2.0 on rank 0"):
        validate(fused)


# ---- forward-only schedules (evaluation, generation) ----

FORWARD = forward_only_schedule(2, 1, 2)  # rank 0: F0.0 SF0.0 F0.1 SF0.1; rank 1: RF1.0 F1.0 RF1.1 F1.1


def test_a_forward_only_schedule_validates_in_every_placement():
    for placement in ("loop", "vshape"):
        validate_forward_only(forward_only_schedule(2, 2, 3, placement))
    with pytest.raises(ScheduleError, match="B0.0 is missing from rank 0"):
        validate(FORWARD)  # the training validator wants every F's backward


def test_a_forward_only_schedule_with_a_backward_is_refused():
    with pytest.raises(ScheduleError, match="rank 1: a forward-only schedule has backward actions"):
        validate_forward_only(_edit(FORWARD, 1, "RF1.0 F1.0 RF1.1 F1.1 B1.1"))


def test_a_forward_only_schedule_without_its_receive_is_refused():
    with pytest.raises(ScheduleError, match="SF0.1 on rank 0 has no matching RF1.1 on rank 1"):
        validate_forward_only(_edit(FORWARD, 1, "RF1.0 F1.0 F1.1"))


def test_a_forward_only_schedule_that_deadlocks_is_refused():
    with pytest.raises(ScheduleError, match="deadlocks"):
        validate_forward_only(_edit(FORWARD, 1, "RF1.1 F1.0 RF1.0 F1.1"))
