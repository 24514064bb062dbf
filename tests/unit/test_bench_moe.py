"""`attnres-pp bench moe` and the MoE option of `bench quality-depth`, on tiny shapes: the dense twin
has the MoE model's active parameter count, the grouped matmul and its per-expert twin give the same
outputs and gradients inside the benchmark's pass, a whole (tiny) run fills its table, and each run's
balance is read back from metrics.jsonl as written."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from attnres_pp.bench import moe as bench_moe
from attnres_pp.bench.quality_moe import BALANCE_BOUND, balance_of_run, moe_overrides
from attnres_pp.model import ModelConfig
from attnres_pp.model.moe import grouped_matmul, grouped_matmul_loop
from attnres_pp.model.transformer import active_parameter_count, parameter_count

TINY = {"vocab_size": 256, "n_layers": 2, "d_model": 32, "n_heads": 2, "seq_len": 32, "residual": "attnres",
        "block_size": 2}


@pytest.mark.parametrize("experts", [dict(moe_experts=8, moe_top_k=2, moe_shared_experts=1),
                                     dict(moe_experts=4, moe_top_k=1, moe_d_ff=24, moe_dense_layers=1)])
def test_dense_twin_has_the_active_parameter_count(experts):
    moe_cfg = ModelConfig.from_dict({**TINY, **experts})
    dense = bench_moe.dense_twin(moe_cfg)
    assert not dense.moe and dense.n_layers == moe_cfg.n_layers and dense.d_model == moe_cfg.d_model
    per_width = parameter_count(ModelConfig.from_dict({**dense.to_dict(), "d_ff": dense.d_ff + 1})) - \
        parameter_count(dense)
    # The nearest integer width: within half a width's parameters of the active count.
    assert abs(parameter_count(dense) - active_parameter_count(moe_cfg)) <= per_width / 2
    assert active_parameter_count(moe_cfg) < parameter_count(moe_cfg)


def test_grouped_and_loop_passes_agree():
    torch.manual_seed(0)
    counts = [5, 0, 7, 4]
    x = torch.randn(sum(counts), 16, requires_grad=True)
    gate_up = torch.randn(4, 2 * 8, 16, requires_grad=True)
    down = torch.randn(4, 16, 8, requires_grad=True)
    grad = torch.randn(sum(counts), 16)
    results = []
    for matmul in (grouped_matmul, grouped_matmul_loop):
        y = bench_moe.experts_pass(x, gate_up, down, counts, matmul, grad)
        results.append((y, *(t.grad.clone() for t in (x, gate_up, down))))
        for t in (x, gate_up, down):
            t.grad = None
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert results[0][2][1].abs().sum() == 0  # expert 1 has no rows: no gradient


def test_a_tiny_run_fills_the_table(monkeypatch):
    monkeypatch.setattr(bench_moe, "QUICK_SHAPE", TINY)
    monkeypatch.setattr(bench_moe, "ROUNDS", {True: (1, 2)})
    monkeypatch.setattr(bench_moe, "MATMUL_ROUNDS", {True: (1, 2)})
    # The EP = 2 row starts rank processes: its own test below.
    monkeypatch.setattr(bench_moe, "expert_parallel_row", lambda run, warmup, rounds: {
        "measured": False, "why": "left out of this test"})
    payload = bench_moe.run(True, None, lambda line: None)
    assert payload["tokens_per_step"] == bench_moe.BATCH * TINY["seq_len"]
    for clock in ("cpu", "wall"):
        times = payload["times"][clock]
        assert [len(times[name]) for name in ("moe", "dense")] == [2, 2]
        ratios = [m / d for m, d in zip(times["moe"], times["dense"], strict=True)]
        assert payload[clock]["ratio"] == pytest.approx(sum(ratios) / 2)
    assert payload["moe_over_dense"] == payload["cpu"]["ratio"]
    matmul = payload["grouped_matmul"]
    assert sum(matmul["counts_per_expert"]) == matmul["rows"] == bench_moe.BATCH * TINY["seq_len"] * 2
    assert matmul["max_abs_difference"] < 1e-5
    text = bench_moe.to_markdown(payload)
    params = payload["params"]
    assert f"| MoE (single process) | {params['moe_total']:,} | {params['moe_active']:,} |" in text
    assert "EP = 2 not measured: left out of this test." in text


@pytest.mark.distributed
def test_the_ep_row_alternates_ep_2_with_replicated_experts_and_times_the_all_to_alls():
    ep = bench_moe.expert_parallel_row(bench_moe.expert_parallel_run_config(TINY), 1, 2)
    assert ep["measured"]
    assert 0 < ep["all_to_all_share"] < 1 and ep["all_to_all_s"] > 0 and ep["all_to_all_bytes"] > 0
    times = ep["times"]
    assert [len(times[name]) for name in ("ep", "replicated")] == [2, 2]
    ratios = [a / b for a, b in zip(times["ep"], times["replicated"], strict=True)]
    assert ep["ratio"] == pytest.approx(sum(ratios) / 2)
    text = "\n".join(bench_moe._ep_markdown(ep))
    assert "EP = 2 / EP = 1" in text and f"{ep['all_to_all_share']:.1%}" in text


def _args(**flags) -> argparse.Namespace:
    names = ("moe_experts", "moe_top_k", "moe_shared_experts", "moe_d_ff", "moe_dense_layers", "moe_router",
             "moe_balance", "moe_aux_loss_coef", "moe_bias_gamma")
    return argparse.Namespace(**{name: flags.get(name) for name in names})


def test_quality_moe_flags_are_checked_on_the_benchmarks_model():
    depth = {"n_layers": 12, "d_model": 48, "n_heads": 4, "seq_len": 64}
    assert moe_overrides(_args(), depth) == {}
    assert moe_overrides(_args(moe_experts="8", moe_top_k="2", moe_router="sigmoid"), depth) == {
        "moe_experts": 8, "moe_top_k": 2, "moe_router": "sigmoid"}
    for flags, message in ((dict(moe_top_k="2"), "--moe-top-k needs --moe-experts"),
                           (dict(moe_experts="2", moe_top_k="3"), "moe_top_k=3 is invalid"),
                           (dict(moe_experts="x"), "--moe-experts 'x' is invalid"),
                           (dict(moe_experts="8", moe_d_ff="0"), "--moe-d-ff 0 is invalid")):
        with pytest.raises(ValueError, match=message):
            moe_overrides(_args(**flags), depth)


def test_balance_is_read_after_the_warm_up(tmp_path):
    worst = [4.0, 3.0, 1.6, 1.2, 1.1, 1.3]
    lines = [{"step": s, "loss": 1.0, "moe_load_max_over_mean/0": w, "moe_load_max_over_mean/1": w - 0.05,
              "moe_load_max_over_mean": w} for s, w in enumerate(worst)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    balance = balance_of_run(tmp_path, 3, 1, {"moe_expert_loads": {"0": [3.0, 5.0]}})
    assert balance["steps_after_warmup"] == 3 and balance["max_over_mean_max"] == 1.3
    assert balance["max_over_mean_median"] == 1.2 and balance["steps_at_or_over_bound"] == 0
    assert balance["max_over_mean_max_after_lr_warmup"] == 3.0
    assert balance["per_layer_max"] == {"0": 1.3, "1": pytest.approx(1.25)}
    assert balance["last_step_loads"] == {"0": [3.0, 5.0]}
    assert balance_of_run(tmp_path, 2, 1, {})["steps_at_or_over_bound"] == sum(w >= BALANCE_BOUND for w in worst[2:])


def test_a_second_quality_run_of_the_day_gets_its_own_run_directories(tmp_path):
    from attnres_pp.bench.quality_depth import fresh_runs_root

    root = tmp_path / "runs" / "quality_moe_2026-12-06"
    first, second, third = (fresh_runs_root(root) for _ in range(3))
    assert [first, second, third] == [root, root.with_name(root.name + "_2"), root.with_name(root.name + "_3")]
    assert all(path.is_dir() for path in (first, second, third))
