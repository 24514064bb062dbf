"""Activation checkpointing (`--activation-checkpoint full | selective`): W never recomputes what I
did (one recomputation per layer and microbatch), and checkpointing lowers the counted activation
peak. Its parity with the single-process model (every variant, the fused and the split backward,
cached and naive, float64) is in tests/parity/test_parity.py's curated case list."""

from __future__ import annotations

import pytest

from attnres_pp.pipeline import activation_checkpoint
from tests.pipeline_helpers import loopback_step, model_config

# (schedule, P, V, m): the fused backward, the I/W split and the V schedule.
SCHEDULES = {"1f1b": ("1f1b", 2, 1, 2), "zb_h1": ("zb_h1", 2, 1, 2), "zbv": ("zbv", 2, 2, 2)}


@pytest.mark.parametrize("policy", ["full", "selective"])
@pytest.mark.parametrize("schedule_name", sorted(SCHEDULES))
def test_each_layer_is_recomputed_once_per_microbatch_also_under_the_split(monkeypatch, schedule_name, policy):
    calls = []
    original = activation_checkpoint._Frame._recompute

    def counting(frame):
        calls.append(1)
        original(frame)

    monkeypatch.setattr(activation_checkpoint._Frame, "_recompute", counting)
    layout = SCHEDULES[schedule_name]
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
