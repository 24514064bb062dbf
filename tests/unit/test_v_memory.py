"""V-Half and V-Min (docs/spec.md section 5): deadlock freedom under gloo's and NCCL's rules, the
activations held per rank against the closed form and against 1F1B's and ZB-V's own orders, the
unit-cost bubble against the closed form, W as the only free, the V placement's minimal hops, and
the refusals. Their orders against the published builder's are in test_v_memory_reference.py."""

from __future__ import annotations

import pytest

from attnres_pp.cli import main
from attnres_pp.comm.partition import make_partition
from attnres_pp.comm.plan import plan_payloads
from attnres_pp.schedule.ir import ActionKind
from attnres_pp.schedule.passes import insert_comm
from attnres_pp.schedule.schedules import SIZE_CHECKS, build_schedule, schedule_placement
from attnres_pp.schedule.v_memory import (
    V_MEMORY_SCHEDULES,
    closed_form_bubble_fraction,
    closed_form_idle_per_rank,
    closed_form_peak_held,
    steady_offsets,
)
from attnres_pp.schedule.validate import validate
from attnres_pp.schedule.validate_nccl import check_nccl, lockstep_plan
from attnres_pp.simulator.costs import unit_costs
from attnres_pp.simulator.engine import simulate
from attnres_pp.simulator.metrics import peak_in_flight, summarize

SHAPES = [(p, m) for p in (1, 2, 3, 4, 5) for m in sorted({2 * p, 2 * p + 1, 3 * p, 4 * p + 1})]


@pytest.mark.parametrize("name", V_MEMORY_SCHEDULES)
@pytest.mark.parametrize(("n_stages", "n_microbatches"), SHAPES)
def test_deadlock_free_under_gloo_and_nccl_rules(name, n_stages, n_microbatches):
    schedule = build_schedule(name, n_stages, 2, n_microbatches)
    assert schedule.placement == "vshape" and not schedule.has_comm
    validate(schedule)
    lowered = insert_comm(schedule)
    validate(lowered, p2p_semantics="gloo")
    validate(lowered, p2p_semantics="nccl")
    check_nccl(lowered, lockstep_plan(lowered))


@pytest.mark.parametrize("name", V_MEMORY_SCHEDULES)
@pytest.mark.parametrize(("n_stages", "n_microbatches"), SHAPES)
def test_every_w_follows_its_i_and_every_chunk_microbatch_runs_f_i_w_once(name, n_stages, n_microbatches):
    schedule = build_schedule(name, n_stages, 2, n_microbatches)
    for pp_rank, actions in enumerate(schedule.rank_actions):
        position = {(a.kind, a.chunk_index, a.microbatch_index): k for k, a in enumerate(actions)}
        assert len(position) == len(actions) == 3 * 2 * n_microbatches
        for chunk in schedule.chunks_of(pp_rank):
            for mb in range(n_microbatches):
                f, i, w = (position[(kind, chunk, mb)] for kind in (ActionKind.F, ActionKind.I, ActionKind.W))
                assert f < i < w


def _held_halves(schedule) -> list[int]:
    """Per rank, the most activation sets alive (F to W), in halves of a rank's layers: a V = 1
    chunk is a whole rank's layers, a V = 2 chunk half of them."""
    per_chunk = 2 // schedule.n_virtual
    return [x["chunk_microbatches"] * per_chunk for x in peak_in_flight(schedule)]


@pytest.mark.parametrize(("n_stages", "n_microbatches"), [(p, m) for p in (2, 3, 4, 5, 6, 7, 8, 9)
                                                          for m in (2 * p, 3 * p + 1)])
def test_held_activations_are_half_and_a_third_of_1f1b_s(n_stages, n_microbatches):
    """1F1B's and ZB-V's own orders hold P microbatches of a whole rank (2P halves); V-Half holds
    P // 2 + 1 of them and V-Min (P + 4) // 3, every rank at most that and the fullest exactly."""
    p = n_stages
    one_f_one_b = max(_held_halves(build_schedule("1f1b", p, 1, n_microbatches)))
    assert one_f_one_b == max(_held_halves(build_schedule("zbv", p, 2, n_microbatches))) == 2 * p
    half = _held_halves(build_schedule("v_half", p, 2, n_microbatches))
    third = _held_halves(build_schedule("v_min", p, 2, n_microbatches))
    assert max(half) == closed_form_peak_held("v_half", p) == 2 * (p // 2 + 1)
    assert max(third) == closed_form_peak_held("v_min", p) == 2 * ((p + 4) // 3)
    assert max(half) <= one_f_one_b / 2 + 2 and max(third) <= one_f_one_b / 3 + 8 / 3
    assert max(third) <= max(half) <= one_f_one_b


@pytest.mark.parametrize("name", V_MEMORY_SCHEDULES)
@pytest.mark.parametrize("n_stages", [1, 2, 3, 4, 5, 6])
def test_unit_cost_bubble_is_the_closed_form(name, n_stages):
    """F = 1, I = W = 1 per rank and microbatch, free links: every rank idles the same time for
    every m >= 2P, between ZB-V's (P - 1) / 2 and 1F1B's 3 (P - 1)."""
    p = n_stages
    idle = closed_form_idle_per_rank(name, p)
    assert (p - 1) / 2 <= idle <= 3 * (p - 1)
    for m in range(2 * p, 4 * p + 2):
        result = simulate(build_schedule(name, p, 2, m), unit_costs(p, 2))
        report = summarize(result)
        assert report["per_rank"]["idle_s"] == pytest.approx([idle] * p)
        assert result.makespan == pytest.approx(3 * m + idle)
        assert report["bubble_fraction"] == pytest.approx(closed_form_bubble_fraction(name, p, m))
        # `simulate schedule` prints the simulator's closed forms beside what it measured.
        assert report["closed_form_bubble_fraction"] == pytest.approx(report["bubble_fraction"])
        assert report["closed_form_bubble_ratio"] == pytest.approx(report["bubble_ratio"])


def test_the_memory_is_the_price_of_the_bubble_at_p4():
    """The table of docs/pipeline.md: P = 4, bubble fraction and the fullest rank's held halves."""
    table = {}
    for name in ("1f1b", "zbv", "v_half", "v_min"):
        for m in (8, 16):
            schedule = build_schedule(name, 4, 1 if name == "1f1b" else 2, m)
            bubble = summarize(simulate(schedule, unit_costs(4, schedule.n_virtual)))["bubble_fraction"]
            table[name, m] = (round(bubble, 4), max(_held_halves(schedule)))
    assert table == {("1f1b", 8): (0.2727, 8), ("1f1b", 16): (0.1579, 8),
                     ("zbv", 8): (0.0588, 8), ("zbv", 16): (0.0303, 8),
                     ("v_half", 8): (0.0943, 6), ("v_half", 16): (0.0495, 6),
                     ("v_min", 8): (0.1864, 4), ("v_min", 16): (0.1028, 4)}


@pytest.mark.parametrize("name", V_MEMORY_SCHEDULES)
def test_the_block_s_offsets_are_distinct_slots_of_a_period(name):
    """The repeating block puts the four F and I of a microbatch in distinct slots mod 6 (the two
    W take the other two): what the extra gap where 2 or 3 divides P is for."""
    for n_stages in range(1, 13):
        for offsets in steady_offsets(name, n_stages):
            assert len({slot % 6 for slot in offsets}) == 4, (n_stages, offsets)


@pytest.mark.parametrize("name", V_MEMORY_SCHEDULES)
@pytest.mark.parametrize("block_size", [1, 2, 3])
def test_hops_are_the_v_placement_s_minimal_ones(name, block_size):
    """The payload plan reads only the partition: the schedule's is ZB-V's V, and the middle hop
    (rank P - 1's own two chunks) carries nothing over the wire under the cache."""
    n_stages = 3
    assert schedule_placement(name) == schedule_placement("zbv") == "vshape"
    ours = make_partition(2 * n_stages, n_stages, 2, placement=schedule_placement(name))
    assert ours == make_partition(2 * n_stages, n_stages, 2, placement=schedule_placement("zbv"))
    cached = plan_payloads(n_sublayers=4 * n_stages, block_size=block_size, partition=ours, mode="cached")
    naive = plan_payloads(n_sublayers=4 * n_stages, block_size=block_size, partition=ours, mode="naive")
    assert cached.fwd_hop_tensors[n_stages - 1] == 0
    assert sum(cached.fwd_hop_tensors) < sum(naive.fwd_hop_tensors)


@pytest.mark.parametrize("name", V_MEMORY_SCHEDULES)
@pytest.mark.parametrize(("n_virtual", "n_microbatches", "needle"), [
    (2, 7, "needs m >= 2P=8 microbatches, got m=7: use any m >= 8"),
    (2, 1, "needs m >= 2P=8 microbatches, got m=1"),
    (1, 8, "places exactly 2 chunks per rank (a V), but virtual V=1"),
    (3, 8, "places exactly 2 chunks per rank (a V), but virtual V=3"),
])
def test_refusals_name_the_rule(name, n_virtual, n_microbatches, needle):
    for refuse in (lambda: build_schedule(name, 4, n_virtual, n_microbatches),
                   lambda: SIZE_CHECKS[name](4, n_virtual, n_microbatches)):
        with pytest.raises(ValueError, match=f"^{name} " + needle.replace("(", r"\(").replace(")", r"\)")):
            refuse()


@pytest.mark.parametrize("command", ["train", "simulate"])
def test_train_and_simulate_refuse_too_few_microbatches_in_one_line(command, capsys, tmp_path):
    layout = ["--schedule", "v_min", "--stages", "2", "--virtual", "2", "--microbatches", "3", "--layers", "4"]
    argv = (["train", "--batch-size", "3", "--steps", "1", "--launcher", "inprocess", "--quiet", "--out", str(tmp_path)]
            if command == "train" else ["simulate", "schedule"])
    assert main(argv + layout) == 2
    assert capsys.readouterr().err.strip() == "error: v_min needs m >= 2P=4 microbatches, got m=3: use any m >= 4"

