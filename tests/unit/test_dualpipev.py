"""DualPipeV (docs/spec.md section 5): torch.distributed.pipelining's own order, the overlapped
(F, B) pairs, deadlock freedom under gloo's and NCCL's rules, the closed-form bubble against the
unit-cost simulator, the V placement's minimal hops, and its refusals."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from attnres_pp.comm.partition import make_partition
from attnres_pp.comm.plan import plan_payloads
from attnres_pp.schedule.dualpipev import dualpipev, dualpipev_pairs
from attnres_pp.schedule.ir import ActionKind
from attnres_pp.schedule.passes import insert_comm
from attnres_pp.schedule.schedules import build_schedule, schedule_placement
from attnres_pp.schedule.validate import validate
from attnres_pp.schedule.validate_nccl import check_nccl, lockstep_plan
from attnres_pp.simulator.costs import unit_costs
from attnres_pp.simulator.engine import simulate
from attnres_pp.simulator.metrics import (
    closed_form_bubble_fraction,
    closed_form_bubble_ratio,
    closed_form_min_microbatches,
    peak_in_flight,
    summarize,
)

SHAPES = [(p, m) for p in (2, 3, 4) for m in sorted({2 * p, 2 * p + 1, 3 * p, 4 * p + 1})]


def _torch_order(n_stages: int, n_microbatches: int, pp_rank: int) -> tuple[list[str], list[tuple[str, str]]]:
    """torch's per-rank DualPipeV order, built without stages or a process group: the order is a
    function of the group size and m alone (`_calculate_single_rank_operations` reads nothing else).
    An OVERLAP_F_B slot becomes its sub-actions in order, and is returned as a pair too."""
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    kinds = schedules._ComputationType
    letter = {kinds.FORWARD: "F", kinds.FULL_BACKWARD: "B", kinds.BACKWARD_INPUT: "I", kinds.BACKWARD_WEIGHT: "W"}
    fake = SimpleNamespace(pp_group_size=n_stages, _n_microbatches=n_microbatches)

    def text(action) -> str:
        return f"{letter[action.computation_type]}{action.stage_index}.{action.microbatch_index}"

    order, pairs = [], []
    for action in schedules.ScheduleDualPipeV._calculate_single_rank_operations(fake, pp_rank):
        if action.computation_type == kinds.OVERLAP_F_B:
            forward, backward = (text(a) for a in action.sub_actions)
            order += [forward, backward]
            pairs.append((forward, backward))
        else:
            order.append(text(action))
    return order, pairs


@pytest.mark.parametrize(("n_stages", "n_microbatches"), [(1, 2), (1, 3), *SHAPES])
def test_order_and_pairs_equal_torch_dualpipev(n_stages, n_microbatches):
    schedule = dualpipev(n_stages, 2, n_microbatches)
    pairs = dualpipev_pairs(n_stages, n_microbatches)
    for pp_rank in range(n_stages):
        want_order, want_pairs = _torch_order(n_stages, n_microbatches, pp_rank)
        assert [str(a) for a in schedule.rank_actions[pp_rank]] == want_order
        assert [(str(f), str(b)) for f, b in pairs[pp_rank]] == want_pairs


@pytest.mark.parametrize(("n_stages", "n_microbatches"), SHAPES)
def test_a_pair_is_a_forward_of_one_arm_then_a_backward_of_the_other(n_stages, n_microbatches):
    schedule = dualpipev(n_stages, 2, n_microbatches)
    for pp_rank, (actions, pairs) in enumerate(zip(schedule.rank_actions, dualpipev_pairs(n_stages, n_microbatches),
                                                   strict=True)):
        arms = set(schedule.chunks_of(pp_rank))
        # The steady state: two slots per step, on every rank but the last's first step.
        assert len(pairs) == 2 * (n_microbatches - 2 * n_stages + pp_rank + 1) + (n_stages - pp_rank - 1) \
            - (pp_rank == n_stages - 1)
        for forward, backward in pairs:
            assert forward.kind is ActionKind.F and backward.kind is ActionKind.B
            assert {forward.chunk_index, backward.chunk_index} == arms
            assert actions.index(backward) == actions.index(forward) + 1


@pytest.mark.parametrize(("n_stages", "n_microbatches"), SHAPES)
def test_deadlock_free_under_gloo_and_nccl_rules(n_stages, n_microbatches):
    schedule = build_schedule("dualpipev", n_stages, 2, n_microbatches)
    assert schedule.placement == "vshape"
    validate(schedule)
    lowered = insert_comm(schedule)
    validate(lowered, p2p_semantics="gloo")
    validate(lowered, p2p_semantics="nccl")
    check_nccl(lowered, lockstep_plan(lowered))


@pytest.mark.parametrize("n_stages", [1, 2, 3, 4, 5])
def test_unit_cost_bubble_is_the_closed_form(n_stages):
    """F = 1, B = 2 (I = W = 1) per rank and microbatch, free links: every rank idles (P - 1) / 2,
    ZB-V's figure; the makespan is 3m + (P - 1) / 2 and the fraction (P-1)/(6m + P - 1)."""
    p = n_stages
    assert closed_form_min_microbatches("dualpipev", p) == 2 * p
    for m in range(2 * p, 4 * p + 2):
        result = simulate(build_schedule("dualpipev", p, 2, m), unit_costs(p, 2))
        report = summarize(result)
        assert report["per_rank"]["idle_s"] == pytest.approx([(p - 1) / 2] * p)
        assert result.makespan == pytest.approx(3 * m + (p - 1) / 2)
        assert report["bubble_fraction"] == pytest.approx((p - 1) / (6 * m + p - 1))
        assert report["bubble_fraction"] == pytest.approx(closed_form_bubble_fraction(p, 2, m, "dualpipev"))
        assert report["bubble_ratio"] == pytest.approx(closed_form_bubble_ratio(p, 2, m, "dualpipev"))


@pytest.mark.parametrize(("n_stages", "n_microbatches"), SHAPES)
def test_in_flight_activations_are_one_more_than_zbv_s(n_stages, n_microbatches):
    """docs/spec.md section 5: 2P + 1 (chunk, microbatch) sets per rank (ZB-V: 2P), over 2P - r microbatches."""
    ours = peak_in_flight(build_schedule("dualpipev", n_stages, 2, n_microbatches))
    theirs = peak_in_flight(build_schedule("zbv", n_stages, 2, n_microbatches))
    assert [x["chunk_microbatches"] for x in ours] == [2 * n_stages + 1] * n_stages
    assert [x["chunk_microbatches"] for x in theirs] == [2 * n_stages] * n_stages
    assert [x["microbatches"] for x in ours] == [2 * n_stages - r for r in range(n_stages)]


@pytest.mark.parametrize("n_stages", [2, 3, 4])
@pytest.mark.parametrize("block_size", [1, 2, 3, 4])
def test_hops_are_the_v_placement_s_minimal_ones(n_stages, block_size):
    """The payload plan reads only the partition, and dualpipev's is zbv's V: the same per-hop
    tensors, the middle hop (rank P - 1's own two chunks) carrying nothing over the wire."""
    n_layers = 2 * n_stages
    assert schedule_placement("dualpipev") == schedule_placement("zbv") == "vshape"
    ours = make_partition(n_layers, n_stages, 2, placement=schedule_placement("dualpipev"))
    assert ours == make_partition(n_layers, n_stages, 2, placement="vshape")
    for mode in ("cached", "naive"):
        plan = plan_payloads(n_sublayers=2 * n_layers, block_size=block_size, partition=ours, mode=mode)
        zbv_plan = plan_payloads(n_sublayers=2 * n_layers, block_size=block_size,
                                 partition=make_partition(n_layers, n_stages, 2, placement="vshape"), mode=mode)
        assert plan.fwd_hop_tensors == zbv_plan.fwd_hop_tensors
        if mode == "cached":
            assert plan.fwd_hop_tensors[n_stages - 1] == 0


@pytest.mark.parametrize(("n_virtual", "n_microbatches", "needle"), [
    (2, 7, "dualpipev needs m >= 2P=8 microbatches"),
    (2, 1, "dualpipev needs m >= 2P=8 microbatches"),
    (1, 8, "dualpipev places exactly 2 chunks per rank (a V), but virtual V=1"),
    (3, 8, "dualpipev places exactly 2 chunks per rank (a V), but virtual V=3"),
    (4, 8, "dualpipev places exactly 2 chunks per rank (a V), but virtual V=4"),
])
def test_refusals_name_the_rule(n_virtual, n_microbatches, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        build_schedule("dualpipev", 4, n_virtual, n_microbatches)
    with pytest.raises(ValueError, match="dualpipev"):
        dualpipev_pairs(4, n_microbatches if n_virtual == 2 else 1)
