"""`attnres-pp bench checkpoint` on a small model: every phase is sampled as often as its rounds
say, the checkpoint it measures holds the parameters and both AdamW moments, and the async phase
polls as the training loop does (at least one step beside each save)."""

from __future__ import annotations

import pytest

from attnres_pp.bench import checkpoint as bench
from attnres_pp.model.config import ModelConfig
from attnres_pp.model.transformer import Transformer


@pytest.mark.distributed
def test_each_phase_is_measured_and_the_checkpoint_holds_the_whole_state(monkeypatch):
    small = {**bench.QUICK_MODEL, "n_layers": 4, "d_model": 32, "seq_len": 16}
    monkeypatch.setattr(bench, "QUICK_MODEL", small)
    payload = bench.run(True, None, lambda line: None)
    samples, rounds = payload["samples"], payload["rounds"]
    assert len(samples["none_step_s"]) == rounds * bench.STEPS_PER_PHASE
    assert len(samples["blocking_save_s"]) == len(samples["async_begin_s"]) == rounds
    assert all(n >= 1 for n in samples["async_steps_per_save"])
    assert len(samples["async_step_s"]) == sum(samples["async_steps_per_save"])
    assert all(begin <= write for begin, write in zip(samples["async_begin_s"], samples["async_write_s"], strict=True))
    params = sum(p.numel() for p in Transformer(ModelConfig.from_dict(small)).parameters())
    assert payload["checkpoint_bytes"] >= 3 * 4 * params  # fp32 parameters, exp_avg, exp_avg_sq
    assert payload["tokens_per_step"] == bench.MICROBATCH_SIZE * bench.PIPELINE["microbatches"] * 16
    assert "**" in bench.to_markdown(payload)
