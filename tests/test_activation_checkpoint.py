"""Activation checkpointing (`--activation-checkpoint full | selective`) against the single-process
model: loss and every gradient, for every variant x schedule (fused B, and the I/W split) x cache
on/off, in-process; the float64 cases at 1e-10. Also: W never recomputes what I did (one
recomputation per layer and microbatch), and checkpointing lowers the counted activation peak."""

from __future__ import annotations

import pytest
import torch

from attnres_pp.pipeline import activation_checkpoint
from tests.pipeline_helpers import (
    assert_grads_match,
    batch,
    loopback_step,
    model_config,
    reference_step,
)
from tests.reference_model import VARIANTS

# (schedule, P, V, m): the loop schedules with and without the split, and the V schedule.
SCHEDULES = [("1f1b", 2, 1, 2), ("interleaved_1f1b", 2, 2, 2), ("zb_h1", 2, 1, 2), ("interleaved_zb", 2, 2, 2),
             ("zbv", 2, 2, 2)]


@pytest.mark.parametrize("policy", ["full", "selective"])
@pytest.mark.parametrize("cache", [True, False], ids=["cached", "naive"])
@pytest.mark.parametrize("layout", SCHEDULES, ids=lambda x: x[0])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_checkpointed_step_equals_single_process_fp32(variant, layout, cache, policy):
    schedule_name, P, V, m = layout
    cfg = model_config(variant, 4)
    loss, grads, _ = loopback_step(cfg, schedule_name, P, V, m, cache, policy)
    want_loss, want_grads = reference_step(cfg, *batch(m), m)
    assert abs(loss - want_loss) <= 1e-5 * abs(want_loss)
    assert_grads_match(grads, want_grads, rtol=1e-5)


@pytest.mark.parametrize("policy", ["full", "selective"])
@pytest.mark.parametrize("schedule_name", ["1f1b", "interleaved_zb", "zbv"])
@pytest.mark.parametrize("variant", ["block", "msar"])
def test_checkpointed_step_equals_single_process_float64(variant, schedule_name, policy):
    layout = next(s for s in SCHEDULES if s[0] == schedule_name)
    cfg = model_config(variant, 4)
    loss, grads, _ = loopback_step(cfg, *layout, True, policy, dtype=torch.float64)
    want_loss, want_grads = reference_step(cfg, *batch(layout[3]), layout[3], dtype=torch.float64)
    assert abs(loss - want_loss) <= 1e-12
    assert_grads_match(grads, want_grads, rtol=1e-10)


@pytest.mark.parametrize("policy", ["full", "selective"])
@pytest.mark.parametrize("schedule_name", ["1f1b", "zb_h1", "zbv"])
def test_each_layer_is_recomputed_once_per_microbatch_also_under_the_split(monkeypatch, schedule_name, policy):
    calls = []
    original = activation_checkpoint._Frame._recompute

    def counting(frame):
        calls.append(1)
        original(frame)

    monkeypatch.setattr(activation_checkpoint._Frame, "_recompute", counting)
    layout = next(s for s in SCHEDULES if s[0] == schedule_name)
    cfg = model_config("block", 4)
    loopback_step(cfg, *layout, True, policy)
    assert len(calls) == cfg.n_layers * layout[3]  # every layer, every microbatch, once (I and W share it)


def test_full_checkpointing_lowers_the_counted_activation_peak():
    cfg = model_config("block", 8)
    peaks = {}
    for policy in ("none", "selective", "full"):
        *_, records = loopback_step(cfg, "1f1b", 2, 1, 4, True, policy)
        peaks[policy] = max(r.activation_peak_bytes for r in records)
    assert peaks["full"] < peaks["selective"] < peaks["none"], peaks
    assert peaks["full"] <= 0.5 * peaks["none"], peaks
