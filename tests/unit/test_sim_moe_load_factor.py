"""`simulate memory --moe-load-factor F` (docs/simulator.md): under expert parallelism every rank's
experts are priced at F x the balanced N K rows (the most-loaded EP rank's; `attnres-lab
memory-predict --moe` holds it to counted imbalanced runs). Here: F = 1 is the balanced prediction;
F moves a forward's peak by exactly its MoE layers' extra rows (`moe_saved_bytes` at F less at 1)
and nothing else; at EP = 1 every rank holds every expert and F changes nothing; F below 1, NaN or
infinite is one `error:` line, exit 2, nothing on stdout."""

from __future__ import annotations

import json

import pytest

from attnres_pp.cli import main
from attnres_pp.model.config import ModelConfig
from attnres_pp.simulator.memory import MemorySetup, predict_memory
from attnres_pp.simulator.moe import moe_saved_bytes

CFG = ModelConfig(vocab_size=256, n_layers=4, d_model=32, n_heads=2, seq_len=16, residual="attnres", block_size=2,
                  moe_experts=8, moe_top_k=2, moe_shared_experts=1, moe_d_ff=16, moe_dense_layers=1)
TOKENS = 64


def _setup(**fields) -> MemorySetup:
    # P = 1 under 1f1b: F0 B0 F1 B1, the peak holds one microbatch's graph of every layer.
    base = dict(schedule="1f1b", n_stages=1, n_microbatches=2, tokens=TOKENS, dtype="fp32", data_parallel=2,
                expert_parallel=2)
    return MemorySetup(**{**base, **fields})


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("factor", [1.3, 1.9])
def test_a_forward_peak_grows_by_its_moe_layers_extra_rows(dtype, factor):
    balanced = predict_memory(CFG, _setup(dtype=dtype))
    assert balanced == predict_memory(CFG, _setup(dtype=dtype, moe_load_factor=1.0))
    loaded = predict_memory(CFG, _setup(dtype=dtype, moe_load_factor=factor))
    # the peak is a forward's end (F0.0 and F0.1 hold the same), with the graph of one microbatch
    assert [r.peak_action for r in loaded] == [r.peak_action for r in balanced] == ["F0.0", "F0.0"]
    extra = CFG.n_moe_layers * (moe_saved_bytes(CFG, tokens=TOKENS, dtype=dtype, expert_parallel=2, rows_factor=factor)
                                - moe_saved_bytes(CFG, tokens=TOKENS, dtype=dtype, expert_parallel=2))
    assert extra > 0
    for low, high in zip(balanced, loaded, strict=True):
        assert high.terms["activation_peak_bytes"] - low.terms["activation_peak_bytes"] == extra
        assert {k: v for k, v in high.terms.items() if k != "activation_peak_bytes"} == \
            {k: v for k, v in low.terms.items() if k != "activation_peak_bytes"}


def test_without_expert_parallelism_the_factor_changes_nothing():
    assert predict_memory(CFG, _setup(expert_parallel=1, moe_load_factor=1.7)) == \
        predict_memory(CFG, _setup(expert_parallel=1))


ARGV = ["simulate", "memory", "--schedule", "1f1b", "--stages", "1", "--microbatches", "2", "--layers", "4",
        "--d-model", "32", "--heads", "2", "--seq-len", "16", "--vocab-size", "256", "--moe-experts", "8",
        "--moe-d-ff", "16", "--moe-dense-layers", "1", "--data-parallel", "2", "--expert-parallel", "2",
        "--tokens", "64", "--json"]


def test_the_flag_reaches_the_prediction_and_the_json(capsys):
    capsys.readouterr()
    assert main([*ARGV, "--moe-load-factor", "1.5"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["moe_load_factor"] == 1.5
    assert main(ARGV) == 0
    assert json.loads(capsys.readouterr().out)["memory_per_rank"][0]["activation_peak_bytes"] < \
        report["memory_per_rank"][0]["activation_peak_bytes"]


@pytest.mark.parametrize("factor", ["0.9", "nan", "inf", "-2"])
def test_a_factor_below_one_is_one_error_line(capsys, factor):
    capsys.readouterr()
    assert main([*ARGV, "--moe-load-factor", factor]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and captured.err.startswith("error: --moe-load-factor ")
