"""V-Half and V-Min against the published greedy V builder (the paper's authors' `zbv_greedy.py`,
in sail-sg/zero-bubble-pipeline-parallelism: `PipelineGraph(P, m, "half" | "min", 1000, 1000, 1000,
1).create_schedule`). Its per-rank orders for P = 4, m = 8 (V-Half's block with its extra gap,
V-Min's without) and P = 3, m = 6 (the other way round) are written out below as data, in this
project's action names: its F is F, its B (input gradients only: its W comes separately) is I, its
W is W, and its node's layer group is the chunk index on the V placement. The order does not
depend on the costs passed (they price the timeline it reports, not the order).

Ours equals theirs action for action on every rank. Their orders also pass this project's
validators under gloo's and NCCL's rules, and hold and idle what the closed forms say: the closed
forms are checked against an order this project did not generate."""

from __future__ import annotations

import pytest

from attnres_pp.schedule.ir import Action, Schedule
from attnres_pp.schedule.passes import insert_comm
from attnres_pp.schedule.schedules import build_schedule
from attnres_pp.schedule.v_memory import closed_form_idle_per_rank, closed_form_peak_held
from attnres_pp.schedule.validate import validate
from attnres_pp.simulator.costs import unit_costs
from attnres_pp.simulator.engine import simulate
from attnres_pp.simulator.metrics import peak_in_flight, summarize

REFERENCE_ORDERS = {
    ("v_half", 4, 8): (
        ("F0.0 F0.1 F0.2 F0.3 F0.4 F7.0 I7.0 W7.0 F7.1 I7.1 W7.1 F7.2 I0.0 I7.2 W7.2 F7.3 W0.0 F0.5 "
         "I0.1 I7.3 W7.3 F7.4 W0.1 F0.6 I0.2 I7.4 W7.4 F7.5 W0.2 F0.7 I0.3 I7.5 W7.5 F7.6 I7.6 W7.6 "
         "I0.4 W0.3 W0.4 F7.7 I7.7 I0.5 W7.7 I0.6 W0.5 W0.6 I0.7 W0.7"),
        ("F1.0 F1.1 F1.2 F1.3 F6.0 F6.1 I6.0 W6.0 F6.2 I6.1 W6.1 I1.0 W1.0 F1.4 F6.3 I6.2 W6.2 I1.1 "
         "W1.1 F1.5 F6.4 I6.3 W6.3 I1.2 W1.2 F1.6 F6.5 I6.4 W6.4 I1.3 F1.7 W1.3 F6.6 I6.5 W6.5 I1.4 "
         "I6.6 W6.6 F6.7 W1.4 I1.5 I6.7 I1.6 W6.7 W1.5 W1.6 I1.7 W1.7"),
        ("F2.0 F2.1 F2.2 F5.0 F5.1 F5.2 I5.0 W5.0 F2.3 I5.1 I2.0 W5.1 W2.0 F5.3 F2.4 I2.1 I5.2 W5.2 "
         "F5.4 W2.1 F2.5 I2.2 I5.3 W5.3 F5.5 W2.2 F2.6 I2.3 I5.4 W5.4 F5.6 W2.3 F2.7 I2.4 I5.5 W5.5 "
         "F5.7 I5.6 I2.5 W5.6 I2.6 I5.7 W5.7 W2.4 I2.7 W2.5 W2.6 W2.7"),
        ("F3.0 F4.0 F3.1 F4.1 F3.2 F4.2 I4.0 W4.0 I3.0 W3.0 F3.3 F4.3 I4.1 W4.1 I3.1 W3.1 F3.4 F4.4 "
         "I4.2 W4.2 I3.2 W3.2 F3.5 F4.5 I4.3 W4.3 I3.3 F3.6 W3.3 F4.6 I4.4 I3.4 W4.4 F3.7 W3.4 F4.7 "
         "I4.5 I3.5 I4.6 I3.6 W4.5 W4.6 I4.7 I3.7 W4.7 W3.5 W3.6 W3.7"),
    ),
    ("v_min", 4, 8): (
        ("F0.0 F0.1 F0.2 F7.0 I7.0 W7.0 F7.1 I7.1 W7.1 I0.0 W0.0 F0.3 F7.2 I7.2 I0.1 W7.2 W0.1 F0.4 "
         "F7.3 I7.3 I0.2 W7.3 W0.2 F0.5 F7.4 I7.4 I0.3 W7.4 W0.3 F0.6 F7.5 I7.5 I0.4 W7.5 W0.4 F0.7 "
         "F7.6 I7.6 I0.5 W7.6 W0.5 F7.7 I7.7 I0.6 W7.7 W0.6 I0.7 W0.7"),
        ("F1.0 F1.1 F6.0 F6.1 I6.0 W6.0 F1.2 I1.0 I6.1 W6.1 W1.0 F6.2 F1.3 I1.1 I6.2 W6.2 W1.1 F6.3 "
         "F1.4 I1.2 I6.3 W6.3 W1.2 F6.4 F1.5 I1.3 I6.4 W6.4 W1.3 F6.5 F1.6 I1.4 I6.5 W6.5 W1.4 F6.6 "
         "F1.7 I1.5 I6.6 W6.6 W1.5 F6.7 I1.6 I6.7 W6.7 W1.6 I1.7 W1.7"),
        ("F2.0 F2.1 F5.0 F5.1 I5.0 W5.0 F2.2 I2.0 W2.0 I5.1 F5.2 W5.1 I2.1 F2.3 W2.1 I5.2 F5.3 W5.2 "
         "I2.2 F2.4 W2.2 I5.3 F5.4 W5.3 I2.3 F2.5 W2.3 I5.4 F5.5 W5.4 I2.4 F2.6 W2.4 I5.5 F5.6 W5.5 "
         "I2.5 F2.7 W2.5 I5.6 F5.7 W5.6 I2.6 W2.6 I5.7 W5.7 I2.7 W2.7"),
        ("F3.0 F4.0 F3.1 F4.1 I4.0 I3.0 W4.0 W3.0 F3.2 F4.2 I4.1 I3.1 W4.1 W3.1 F3.3 F4.3 I4.2 I3.2 "
         "W4.2 W3.2 F3.4 F4.4 I4.3 I3.3 W4.3 W3.3 F3.5 F4.5 I4.4 I3.4 W4.4 W3.4 F3.6 F4.6 I4.5 I3.5 "
         "W4.5 W3.5 F3.7 F4.7 I4.6 I3.6 W4.6 W3.6 I4.7 I3.7 W4.7 W3.7"),
    ),
    ("v_half", 3, 6): (
        ("F0.0 F0.1 F0.2 F5.0 I5.0 W5.0 F5.1 I5.1 W5.1 I0.0 W0.0 F0.3 F5.2 I5.2 W5.2 I0.1 W0.1 F0.4 "
         "F5.3 I5.3 W5.3 I0.2 W0.2 F0.5 F5.4 I5.4 W5.4 I0.3 W0.3 F5.5 I5.5 I0.4 W5.5 W0.4 I0.5 W0.5"),
        ("F1.0 F1.1 F4.0 F4.1 I4.0 W4.0 F1.2 I1.0 I4.1 W4.1 F4.2 W1.0 F1.3 I1.1 I4.2 W4.2 F4.3 W1.1 "
         "F1.4 I1.2 I4.3 W4.3 F4.4 W1.2 F1.5 I1.3 I4.4 W4.4 F4.5 W1.3 I1.4 I4.5 W4.5 W1.4 I1.5 W1.5"),
        ("F2.0 F3.0 F2.1 F3.1 I3.0 W3.0 I2.0 W2.0 F2.2 F3.2 I3.1 W3.1 I2.1 W2.1 F2.3 F3.3 I3.2 W3.2 "
         "I2.2 W2.2 F2.4 F3.4 I3.3 I2.3 W3.3 F2.5 W2.3 F3.5 I3.4 I2.4 W3.4 W2.4 I3.5 I2.5 W3.5 W2.5"),
    ),
    ("v_min", 3, 6): (
        ("F0.0 F0.1 F0.2 F5.0 I5.0 W5.0 F5.1 I0.0 I5.1 W5.1 W0.0 F5.2 F0.3 I0.1 I5.2 W5.2 W0.1 F5.3 "
         "F0.4 I0.2 I5.3 W5.3 W0.2 F5.4 F0.5 I0.3 I5.4 W5.4 W0.3 F5.5 I5.5 I0.4 W5.5 W0.4 I0.5 W0.5"),
        ("F1.0 F1.1 F4.0 F4.1 I4.0 W4.0 I1.0 F1.2 W1.0 I4.1 F4.2 W4.1 I1.1 F1.3 W1.1 I4.2 F4.3 W4.2 "
         "I1.2 F1.4 W1.2 I4.3 F4.4 W4.3 I1.3 F1.5 W1.3 I4.4 F4.5 W4.4 I1.4 I4.5 W4.5 W1.4 I1.5 W1.5"),
        ("F2.0 F3.0 F2.1 F3.1 I3.0 I2.0 W3.0 W2.0 F2.2 F3.2 I3.1 I2.1 W3.1 W2.1 F2.3 F3.3 I3.2 I2.2 "
         "W3.2 W2.2 F2.4 F3.4 I3.3 I2.3 W3.3 W2.3 F2.5 F3.5 I3.4 I2.4 W3.4 W2.4 I3.5 I2.5 W3.5 W2.5"),
    ),
}


def _reference(name: str, n_stages: int, n_microbatches: int) -> Schedule:
    ranks = REFERENCE_ORDERS[name, n_stages, n_microbatches]
    return Schedule(name=name, n_stages=n_stages, n_virtual=2, n_microbatches=n_microbatches, placement="vshape",
                    rank_actions=tuple(tuple(Action.parse(word) for word in text.split()) for text in ranks))


@pytest.mark.parametrize("shape", sorted(REFERENCE_ORDERS))
def test_our_orders_are_the_reference_s(shape):
    theirs = _reference(*shape)
    ours = build_schedule(*shape[:2], 2, shape[2])
    for pp_rank, (mine, reference) in enumerate(zip(ours.rank_actions, theirs.rank_actions, strict=True)):
        assert [str(a) for a in mine] == [str(a) for a in reference], f"rank {pp_rank}"


@pytest.mark.parametrize("shape", sorted(REFERENCE_ORDERS))
def test_the_reference_orders_pass_our_validators_and_meet_the_closed_forms(shape):
    name, n_stages, n_microbatches = shape
    theirs = _reference(*shape)
    validate(theirs)
    lowered = insert_comm(theirs)
    validate(lowered, p2p_semantics="gloo")
    validate(lowered, p2p_semantics="nccl")
    assert max(x["chunk_microbatches"] for x in peak_in_flight(theirs)) == closed_form_peak_held(name, n_stages)
    report = summarize(simulate(theirs, unit_costs(n_stages, 2)))
    assert report["per_rank"]["idle_s"] == pytest.approx([closed_form_idle_per_rank(name, n_stages)] * n_stages)
