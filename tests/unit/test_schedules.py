"""Schedule generators, the IR's text form and the comm-insertion pass."""

from __future__ import annotations

import pytest

from attnres_pp.comm.partition import chunk_rank
from attnres_pp.schedule.ir import Action, ActionKind, Schedule
from attnres_pp.schedule.passes import insert_comm
from attnres_pp.schedule.schedules import (
    PLACEMENT_OF,
    SCHEDULES,
    build_schedule,
    interleaved_1f1b,
    interleaved_zb,
    microbatch_rounds,
    one_f_one_b,
    zb_h1,
    zbv,
)
from attnres_pp.schedule.validate import validate

SPLIT = ("zb_h1", "interleaved_zb", "zbv", "v_half", "v_min")
V_SHAPED = ("zbv", "dualpipev", "v_half", "v_min")
AT_LEAST_2P = ("dualpipev", "v_half", "v_min")  # the V schedules that need m >= 2P


def _cases():
    for name in SCHEDULES:
        for n_stages in range(1, 5):
            for n_virtual in range(1, 4):
                if name in ("1f1b", "zb_h1") and n_virtual > 1 or name in V_SHAPED and n_virtual != 2:
                    continue
                for n_microbatches in (1, 2, 3, 4, 5, 7, 8, 12):
                    if name.startswith("interleaved") and n_virtual > 1 and n_microbatches < n_stages:
                        continue
                    if name in AT_LEAST_2P and n_microbatches < 2 * n_stages:
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
    assert schedule.placement == PLACEMENT_OF[name] == ("vshape" if name in V_SHAPED else "loop")
    seen = [(a.kind, a.chunk_index, a.microbatch_index, rank)
            for rank, actions in enumerate(schedule.rank_actions) for a in actions]
    if name == "dualpipev":  # fused B in the steady state, I and W in the drain: one or the other per pair
        split = {(c, mb) for kind, c, mb, _ in seen if kind is ActionKind.I}
        assert split and any(kind is ActionKind.B for kind, *_ in seen)
        seen = [(ActionKind.B if kind is ActionKind.I else kind, c, mb, rank) for kind, c, mb, rank in seen
                if not (kind is ActionKind.W and (c, mb) in split)]
    kinds = (ActionKind.F, ActionKind.I, ActionKind.W) if name in SPLIT else (ActionKind.F, ActionKind.B)
    expected = [(kind, c, mb, chunk_rank(c, n_stages, schedule.placement)) for kind in kinds
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
    for text in ("F3.1", "B0.0", "I3.1", "W3.1", "SF3.1", "RF4.1", "SB4.1", "RB3.1", "F12.345"):
        assert str(Action.parse(text)) == text
    assert Action.parse("SF3.1") == Action(ActionKind.SEND_F, 3, 1)
    assert Action.parse("I3.1") == Action(ActionKind.I, 3, 1) and Action.parse("W3.1").is_compute
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
                         [("gpipe", 3, 2, 2), ("interleaved_1f1b", 4, 3, 8), ("1f1b", 1, 1, 3),
                          ("zb_h1", 3, 1, 4), ("interleaved_zb", 2, 3, 5), ("zbv", 3, 2, 4),
                          ("dualpipev", 3, 2, 7)])
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
    # I takes B's place between the backward hop's receive and send; W exchanges nothing.
    split = insert_comm(build_schedule("zb_h1", 2, 1, 1))
    assert str(split).splitlines()[1:] == ["rank 0: F0.0 SF0.0 RB0.0 I0.0 W0.0",
                                           "rank 1: RF1.0 F1.0 I1.0 SB1.0 W1.0"]
    with pytest.raises(ValueError, match="already has communication"):
        insert_comm(lowered)


def test_refusals():
    for generator in (interleaved_1f1b, interleaved_zb):
        with pytest.raises(ValueError, match="V=2 needs m >= P=4 microbatches.*got m=3: use any m >= 4"):
            generator(4, 2, 3)
    with pytest.raises(ValueError, match="use interleaved_1f1b"):
        one_f_one_b(4, 2, 8)
    with pytest.raises(ValueError, match="use interleaved_zb"):
        zb_h1(4, 2, 8)
    with pytest.raises(ValueError, match="exactly 2 chunks per rank"):
        zbv(4, 3, 8)
    with pytest.raises(ValueError, match="unknown; choose one of gpipe, 1f1b, interleaved_1f1b, zb_h1"):
        build_schedule("zb", 4, 1, 8)
    with pytest.raises(ValueError, match="microbatches m=0"):
        build_schedule("gpipe", 4, 1, 0)


@pytest.mark.parametrize("n_stages", [1, 2, 3, 4, 5])
def test_microbatch_rounds_cover_m_with_rounds_of_at_least_p(n_stages):
    for n_microbatches in range(n_stages, 6 * n_stages):
        rounds = microbatch_rounds(n_stages, n_microbatches)
        assert sum(rounds) == n_microbatches and len(rounds) == n_microbatches // n_stages
        assert min(rounds) >= n_stages and max(rounds) - min(rounds) <= 1
        assert rounds == sorted(rounds, reverse=True)  # the larger rounds first
    with pytest.raises(ValueError, match="need m >= P"):
        microbatch_rounds(n_stages, n_stages - 1)


def test_interleaved_any_m_keeps_megatron_order_for_multiples_of_p():
    """m = 6, P = 4: one round of 6 (torch's rounds rule); m = 8: rounds of 4 as before."""
    rank0 = [str(a) for a in interleaved_1f1b(4, 2, 6).rank_actions[0]]
    assert rank0[:12] == [f"F0.{mb}" for mb in range(6)] + [f"F4.{mb}" for mb in range(6)]
    rank0 = [str(a) for a in interleaved_1f1b(4, 2, 8).rank_actions[0]]
    assert rank0[:10] == ["F0.0", "F0.1", "F0.2", "F0.3", "F4.0", "F4.1", "F4.2", "F4.3", "F0.4", "F0.5"]


def test_zero_bubble_schedules_by_hand():
    # ZB-H1, P = 2: the last rank runs F I W; the first holds back no W and waits for its first I.
    assert str(zb_h1(2, 1, 3)).splitlines()[1:] == [
        "rank 0: F0.0 F0.1 I0.0 W0.0 F0.2 I0.1 W0.1 I0.2 W0.2",
        "rank 1: F1.0 I1.0 F1.1 I1.1 W1.0 F1.2 I1.2 W1.1 W1.2"]
    # Rank r holds back up to r of its W until the drain.
    for pp_rank, actions in enumerate(zb_h1(4, 1, 8).rank_actions):
        held = peak = 0
        for action in actions:
            held += {ActionKind.I: 1, ActionKind.W: -1}.get(action.kind, 0)
            peak = max(peak, held)
        assert peak == pp_rank + 1  # the I just run plus the r held back
    # ZB-V: chunk r and 2P - 1 - r on rank r; the V's turn (chunks P - 1, P) stays on rank P - 1.
    schedule = zbv(3, 2, 6)
    assert [schedule.chunks_of(r) for r in range(3)] == [[0, 5], [1, 4], [2, 3]]
    assert " ".join(map(str, schedule.rank_actions[2][:8])) == "F2.0 F3.0 F2.1 F3.1 F2.2 F3.2 I3.0 W3.0"
