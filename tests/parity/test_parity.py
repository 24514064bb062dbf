"""Pipelined steps against the single-process model, over the curated case list of
tests/parity/parity_cases.py: loss and every parameter gradient (fp32 to 1e-5, float64 to 1e-10), and the
transport counts, per forward hop, what the payload plan says (nothing at all between two chunks of
one rank). Also: the list covers what docs/testing.md says it covers."""

from __future__ import annotations

import pytest

from attnres_pp.comm.plan import plan_for_model
from attnres_pp.comm.transport import ByteLedger
from attnres_pp.pipeline.config import AC_POLICIES
from attnres_pp.schedule.schedules import SCHEDULES
from attnres_pp.train.step_stats import fwd_hop_tensors
from tests.pipeline_helpers import assert_step_matches, loopback_step, shared_reference_step
from tests.reference_model import VARIANTS

from .parity_cases import (
    CASES,
    CHECKPOINT_CASES,
    FLOAT64_CASES,
    MOE_CASES,
    ONE_RANK_CASES,
    RECIPE_CASES,
    RECIPES,
    SCHEDULE_CASES,
    V_MEMORY_CASES,
    VARIANT_CASES,
    ParityCase,
)


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_pipelined_step_equals_single_process(case: ParityCase):
    cfg, m = case.config(), case.n_microbatches
    ledger = ByteLedger()
    loss, grads, _ = loopback_step(cfg, case.schedule, case.n_stages, case.n_virtual, m, case.cache, case.policy,
                                   dtype=case.torch_dtype, ledger=ledger)
    # Cases on several layouts of one model and batch share its single-process step.
    want_loss, want_grads = shared_reference_step(cfg, m, dtype=case.torch_dtype)
    assert_step_matches(case.dtype, loss, grads, want_loss, want_grads)
    plan = plan_for_model(cfg, case.partition(), case.cache)
    assert fwd_hop_tensors(ledger.records, case.n_stages * case.n_virtual) == plan.fwd_hop_tensors
    if case.n_stages == 1:  # every hop a self-hop: nothing touches the transport, the plan counts zero
        assert ledger.records == [] and plan.fwd_hop_tensors == [0] * (case.n_virtual - 1)


def _layout(case: ParityCase) -> tuple:
    return (case.schedule, case.n_stages, case.n_virtual, case.n_microbatches, case.n_layers, case.block_size)


def test_the_case_ids_are_unique():
    assert len({case.id for case in CASES}) == len(CASES)


def test_every_schedule_runs_block_and_msar_where_block_and_chunk_edges_meet_and_where_not():
    for schedule in SCHEDULES:
        for variant in ("block", "msar"):
            ran = [c for c in SCHEDULE_CASES if c.schedule == schedule and c.variant == variant and c.cache]
            assert {c.edges_meet() for c in ran} == {True, False}, (schedule, variant)
        assert any(c.schedule == schedule and not c.cache for c in SCHEDULE_CASES), schedule
    uneven = [c for c in SCHEDULE_CASES if len(set(c.partition().layers_per_chunk)) > 1]
    assert {c.n_stages for c in SCHEDULE_CASES} == {2, 3} and {c.split for c in uneven} == {True, False}


def test_every_variant_runs_on_two_layouts_cached_and_naive_and_on_one_rank():
    for variant in VARIANTS:
        for group in (VARIANT_CASES, ONE_RANK_CASES):
            ran = [c for c in group if c.variant == variant]
            assert {c.cache for c in ran} == {True, False}, (variant, group is ONE_RANK_CASES)
        layouts = {_layout(c) for c in VARIANT_CASES if c.variant == variant}
        assert len(layouts) == 2 and {c.split for c in VARIANT_CASES if c.variant == variant} == {True, False}
    assert all(c.n_stages == 1 and c.n_virtual > 1 for c in ONE_RANK_CASES)
    assert any(c.edges_meet() for c in ONE_RANK_CASES) and not all(c.edges_meet() for c in ONE_RANK_CASES)


def test_checkpointing_runs_every_policy_on_the_fused_and_the_split_backward():
    policies = [p for p in AC_POLICIES if p != "none"]
    for variant in VARIANTS:
        assert {c.policy for c in CHECKPOINT_CASES if c.variant == variant} == set(policies), variant
        assert {c.split for c in CHECKPOINT_CASES if c.variant == variant} == {True, False}, variant
    for variant in ("block", "msar"):
        for policy in policies:
            ran = [c for c in CHECKPOINT_CASES if c.variant == variant and c.policy == policy]
            assert {c.split for c in ran} == {True, False} and {c.cache for c in ran} == {True, False}


def test_the_float64_subset_spans_both_backwards_placements_and_policies():
    assert all(c.dtype == "float64" for c in FLOAT64_CASES)
    assert {c.split for c in FLOAT64_CASES} == {True, False}
    assert {c.schedule for c in FLOAT64_CASES} >= {"interleaved_1f1b", "dualpipev", "zbv", "1f1b"}
    assert {c.policy for c in FLOAT64_CASES if c.split} == set(AC_POLICIES)
    assert any(c.blocks for c in FLOAT64_CASES) and any(c.n_stages == 3 for c in FLOAT64_CASES)


def test_every_recipe_runs_every_variant_on_two_layouts_and_in_float64():
    for recipe in RECIPES:
        if recipe == "default" or recipe.startswith("moe"):
            continue
        for variant in VARIANTS:
            ran = [c for c in RECIPE_CASES if c.recipe == recipe and c.variant == variant]
            assert len({_layout(c) for c in ran}) >= 2 and {c.split for c in ran} >= {True}, (recipe, variant)
        assert any(c.dtype == "float64" for c in RECIPE_CASES if c.recipe == recipe), recipe
    grouped = {c.policy for c in RECIPE_CASES if c.recipe == "grouped"}
    assert grouped == set(AC_POLICIES), grouped


def test_moe_runs_every_variant_on_both_backwards_every_policy_one_rank_and_float64():
    assert {c.recipe for c in MOE_CASES} == {r for r in RECIPES if r.startswith("moe")}
    for variant in VARIANTS:
        ran = [c for c in MOE_CASES if c.variant == variant and c.recipe == "moe"]
        assert {c.split for c in ran} == {True, False} and {c.cache for c in ran} == {True, False}, variant
    assert {c.policy for c in MOE_CASES} == set(AC_POLICIES)
    assert any(c.n_stages == 1 for c in MOE_CASES)
    assert {c.variant for c in MOE_CASES if c.dtype == "float64"} >= {"block", "lr_projected", "msar"}


def test_the_controllable_memory_v_schedules_run_both_caches_both_edges_and_full_checkpointing():
    for schedule in ("v_half", "v_min"):
        ran = [c for c in V_MEMORY_CASES if c.schedule == schedule]
        assert all(c.split and c.n_virtual == 2 and c.n_microbatches >= 2 * c.n_stages for c in ran)
        for variant in ("block", "msar"):
            assert {c.edges_meet() for c in ran if c.variant == variant and c.cache} == {True, False}
        assert any(not c.cache for c in ran) and any(c.policy == "full" for c in ran), schedule
    assert {c.variant for c in V_MEMORY_CASES if c.policy == "full"} == {"block", "msar"}
    assert set(V_MEMORY_CASES) <= set(CASES)
