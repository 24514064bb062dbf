"""`attnres-lab memory-predict --moe`'s imbalance columns (`attnres_lab.memory_predict_moe`): F read
off a run's per-rank shares (the largest; the mean over layers, under AC full the largest layer),
the prediction at F against each stage's most-loaded replica, and the at-counted-rows diagnosis,
which must price each rank at its own share (below 1 too) whatever factor the walk passes."""

from __future__ import annotations

import pytest

from attnres_lab.memory_predict import case_flags, predict
from attnres_lab.memory_predict_moe import CASES, load_factor, most_loaded_errors, predict_at_rows

SHARES = [{"mean": 0.7, "max": 1.1}, {"mean": 0.6, "max": 1.0}, {"mean": 1.3, "max": 1.5}, {"mean": 1.4, "max": 1.8}]


@pytest.mark.parametrize("checkpoint,want", [("none", 1.4), ("full", 1.8)])
def test_the_factor_is_the_most_loaded_ranks_share(checkpoint, want):
    assert load_factor({"activation_checkpoint": checkpoint}, SHARES) == want
    assert load_factor({}, [{"mean": 0.9, "max": 0.95}] * 2) == 1.0  # never below balanced
    assert load_factor({}, [None, None]) is None


def test_the_factor_is_compared_with_each_stages_most_loaded_replica():
    measured = [{"activation_peak_bytes": b} for b in (100, 200, 110, 190)]  # dp x P + pp, P = 2
    row = {"flags": {"stages": 2}, "measured": measured, "predicted_at_factor": [121, 190, 121, 190]}
    assert most_loaded_errors(row) == pytest.approx([0.1, -0.05])


def test_counted_rows_price_each_rank_at_its_own_share():
    flags = case_flags(dict(CASES)["MoE EP=2 D=2 P=2"])
    assert flags["expert_parallel"] == 2
    balanced = [r["activation_peak_bytes"] for r in predict(flags)["memory_per_rank"]]
    at_rows = predict_at_rows(flags, "inprocess", SHARES)
    assert at_rows[0] < balanced[0] and at_rows[1] < balanced[1]  # shares below 1: fewer rows
    assert at_rows[2] > balanced[2] and at_rows[3] > balanced[3]
    at_one = predict_at_rows(flags, "inprocess", [{"mean": 1.0, "max": 1.0}] * 4)
    assert at_one == balanced
