"""Schedule generators, the IR's text form and the comm-insertion pass."""

from __future__ import annotations

import pytest

from attnres_pp.pipeline.ir import Action, ActionKind, Schedule
from attnres_pp.pipeline.passes import insert_comm
from attnres_pp.pipeline.schedules import SCHEDULES, build_schedule, interleaved_1f1b, one_f_one_b
from attnres_pp.pipeline.validate import validate


def _cases():
    for name in SCHEDULES:
        for n_stages in range(1, 5):
            for n_virtual in range(1, 4):
                if name == "1f1b" and n_virtual > 1:
                    continue
                for n_microbatches in (1, 2, 3, 4, 5, 8, 12):
                    if name == "interleaved_1f1b" and n_virtual > 1 and n_microbatches % n_stages:
                        continue
                    yield name, n_stages, n_virtual, n_microbatches


CASES = list(_cases())


@pytest.mark.parametrize(("name", "n_stages", "n_virtual", "n_microbatches"), CASES)
def test_generators_validate_with_and_without_comm(name, n_stages, n_virtual, n_microbatches):
    schedule = build_schedule(name, n_stages, n_virtual, n_microbatches)
    assert not schedule.has_comm
    validate(schedule)
    validate(insert_comm(schedule))


@pytest.mark.parametrize(("name", "n_stages", "n_virtual", "n_microbatches"), CASES)
def test_every_forward_and_backward_once_on_its_rank(name, n_stages, n_virtual, n_microbatches):
    schedule = build_schedule(name, n_stages, n_virtual, n_microbatches)
    seen = [(a.kind, a.chunk_index, a.microbatch_index, rank)
            for rank, actions in enumerate(schedule.rank_actions) for a in actions]
    expected = [(kind, c, mb, c % n_stages) for kind in (ActionKind.F, ActionKind.B)
                for c in range(n_stages * n_virtual) for mb in range(n_microbatches)]
    assert sorted(seen) == sorted(expected)


def test_small_schedules_by_hand():
    assert str(build_schedule("1f1b", 2, 1, 3)) == (
        "schedule 1f1b P=2 V=1 m=3\n"
        "rank 0: F0.0 F0.1 B0.0 F0.2 B0.1 B0.2\n"
        "rank 1: F1.0 B1.0 F1.1 B1.1 F1.2 B1.2")
    assert build_schedule("gpipe", 2, 2, 2).rank_actions[0] == tuple(
        Action.parse(s) for s in "F0.0 F0.1 F2.0 F2.1 B2.0 B2.1 B0.0 B0.1".split())
    # Megatron: rank 0 of P=2, V=2 warms up with 2 + 2 forwards; groups of P microbatches per chunk.
    head = interleaved_1f1b(2, 2, 4).rank_actions[0][:6]
    assert " ".join(map(str, head)) == "F0.0 F0.1 F2.0 F2.1 F0.2 B2.0"


@pytest.mark.parametrize("n_microbatches", [1, 2, 5, 8])
def test_interleaved_with_one_chunk_is_1f1b(n_microbatches):
    assert (interleaved_1f1b(4, 1, n_microbatches).rank_actions
            == one_f_one_b(4, 1, n_microbatches).rank_actions)


def test_action_strings_round_trip():
    for text in ("F3.1", "B0.0", "SF3.1", "RF4.1", "SB4.1", "RB3.1", "F12.345"):
        assert str(Action.parse(text)) == text
    assert Action.parse("SF3.1") == Action(ActionKind.SEND_F, 3, 1)
    with pytest.raises(ValueError, match="cannot parse action"):
        Action.parse("X3.1")


def test_matching_and_peers():
    schedule = build_schedule("interleaved_1f1b", 4, 2, 4)
    assert Action.parse("SF3.1").matching() == Action.parse("RF4.1")
    assert Action.parse("SB4.1").matching() == Action.parse("RB3.1")
    assert Action.parse("SF3.1").message_id == Action.parse("RF4.1").message_id
    assert Action.parse("SB4.1").message_id == Action.parse("RB3.1").message_id
    assert schedule.peer(Action.parse("SF3.1")) == 0  # chunk 4 lives on rank 0
    assert schedule.peer(Action.parse("RF4.1")) == 3
    assert schedule.peer(Action.parse("SB4.1")) == 3
    assert schedule.peer(Action.parse("RB3.1")) == 0


@pytest.mark.parametrize(("name", "n_stages", "n_virtual", "n_microbatches"),
                         [("gpipe", 3, 2, 2), ("interleaved_1f1b", 4, 3, 8), ("1f1b", 1, 1, 3)])
def test_schedule_text_round_trip(name, n_stages, n_virtual, n_microbatches):
    schedule = build_schedule(name, n_stages, n_virtual, n_microbatches)
    for candidate in (schedule, insert_comm(schedule)):
        assert Schedule.parse(str(candidate)) == candidate


def test_insert_comm_wraps_compute():
    lowered = insert_comm(build_schedule("1f1b", 2, 1, 1))
    assert str(lowered).splitlines()[1:] == ["rank 0: F0.0 SF0.0 RB0.0 B0.0",
                                             "rank 1: RF1.0 F1.0 B1.0 SB1.0"]
    # P == 1, V > 1: self-hops keep their sends and receives.
    assert "SF0.0" in str(insert_comm(build_schedule("gpipe", 1, 2, 1)))
    with pytest.raises(ValueError, match="already has communication"):
        insert_comm(lowered)


def test_refusals():
    with pytest.raises(ValueError, match="m must be a multiple of P=4.*try 4, 8, 12"):
        interleaved_1f1b(4, 2, 6)
    with pytest.raises(ValueError, match="use interleaved_1f1b"):
        one_f_one_b(4, 2, 8)
    with pytest.raises(ValueError, match="unknown; choose one of gpipe, 1f1b, interleaved_1f1b"):
        build_schedule("zb", 4, 1, 8)
    with pytest.raises(ValueError, match="microbatches m=0"):
        build_schedule("gpipe", 4, 1, 0)
