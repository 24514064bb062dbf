"""`attnres-pp bench quality-depth`'s bookkeeping: one fixed held-out set for every seed, and paired deltas
with their sign counts (the trainings themselves are the benchmark, not a test)."""

from __future__ import annotations

import pytest
import torch

from attnres_pp.bench import quality_depth


def test_held_out_set_is_fixed_and_at_least_128k_bytes():
    inputs_NT, targets_NT = quality_depth.held_out_windows(131072)
    assert inputs_NT.numel() == 131072 and inputs_NT.shape[1] == quality_depth.DEPTH_MODEL["seq_len"]
    assert torch.equal(inputs_NT.flatten()[1:], targets_NT.flatten()[:-1])  # targets: the next byte
    again, _ = quality_depth.held_out_windows(131072)
    assert torch.equal(inputs_NT, again)


def test_paired_rows_take_deltas_per_seed_and_count_signs():
    runs = [{"variant": v, "seed": s, "held_out_loss": loss, "params": 1, "train_time_s": 1.0}
            for v, losses in (("standard", (2.0, 2.1, 2.2)), ("x", (1.9, 2.2, 2.1)))
            for s, loss in enumerate(losses)]
    rows = quality_depth.paired_rows(["standard", "x"], runs, 3)
    assert rows[0]["deltas"] == [0.0, 0.0, 0.0] and rows[0]["better_on"] == 0
    assert rows[1]["deltas"] == pytest.approx([-0.1, 0.1, -0.1])
    assert rows[1]["better_on"] == 2 and rows[1]["mean_delta"] == pytest.approx(-0.1 / 3)
