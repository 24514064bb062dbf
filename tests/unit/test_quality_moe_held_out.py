"""The held-out balance of `bench quality-depth --moe-experts E`: the token-choices counted while the
held-out loss is read equal the router's choices made by hand in float64, the balance figures equal
their definitions on loads worked out by hand, and the table shows both readings."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from attnres_pp.bench.quality_depth import DEPTH_MODEL, HELD_OUT_BATCH, held_out_loss, to_markdown
from attnres_pp.bench.quality_moe import ExpertChoices, held_out_balance, kept, kept_held_out
from attnres_pp.model import ModelConfig, Transformer
from attnres_pp.model.moe import MoE

TINY = dict(vocab_size=32, n_layers=3, d_model=16, n_heads=2, seq_len=8, moe_experts=4, moe_top_k=2,
            moe_d_ff=8, moe_dense_layers=1, moe_router="sigmoid", residual="attnres", block_size=2)


def hand_choices_E(x_ND: torch.Tensor, router_ED: torch.Tensor, bias_E: torch.Tensor, top_k: int) -> list[int]:
    """Token-choices per expert: each token's top k of sigmoid(x W^T) + bias, ties to the lower index,
    by plain sorting of (score, index) pairs."""
    score_NE = (x_ND @ router_ED.t()).sigmoid() + bias_E
    counts = [0] * router_ED.shape[0]
    for score_E in score_NE.tolist():
        for expert in sorted(range(len(score_E)), key=lambda e: (-score_E[e], e))[:top_k]:
            counts[expert] += 1
    return counts


def test_held_out_choices_equal_the_routers_choices_made_by_hand():
    cfg = ModelConfig(**TINY)
    model = Transformer(cfg, seed=3).double()
    for i, layer in enumerate(model.layers[1:]):  # a bias that changes choices: it selects in the reference too
        layer.mlp.expert_bias.data = torch.tensor([0.01, -0.005, 0.0, 0.003 * i], dtype=torch.float64)
    windows = 2 * HELD_OUT_BATCH + 3  # two full held-out batches and a short last one
    tokens = torch.randint(0, 32, (windows, 9), generator=torch.Generator().manual_seed(5))
    plain_loss = held_out_loss(model, tokens[:, :-1], tokens[:, 1:])
    router_inputs: dict[int, list[torch.Tensor]] = {}
    for i, layer in enumerate(model.layers):
        if isinstance(layer.mlp, MoE):
            layer.mlp.norm.register_forward_hook(
                lambda _m, _args, out, i=i: router_inputs.setdefault(i, []).append(out.detach()))
    with ExpertChoices(model) as choices:
        counted_loss = held_out_loss(model, tokens[:, :-1], tokens[:, 1:])
    assert counted_loss == plain_loss  # counting does not change the forward
    assert choices.layers == ["1", "2"] and len(choices.batches_BLE) == 3
    for batch, loads_LE in enumerate(choices.batches_BLE):
        for row, layer in enumerate((1, 2)):
            mlp = model.layers[layer].mlp
            x_ND = router_inputs[layer][batch].reshape(-1, 16)
            expected = hand_choices_E(x_ND, mlp.router.weight.detach(), mlp.expert_bias.detach(), 2)
            assert loads_LE[row].tolist() == expected and sum(expected) == 2 * x_ND.shape[0]
    # The engine's training counters take no held-out forward (eval, no_grad): the reason for the hooks.
    assert all(float(layer.mlp.load_E.sum()) == 0 for layer in model.layers[1:])
    balance = held_out_balance(choices)
    assert balance["held_out_batches"] == 3
    assert sum(balance["held_out_loads"]["1"]) == 2 * 8 * windows
    total_E = [sum(float(b[0, e]) for b in choices.batches_BLE) for e in range(4)]
    assert balance["held_out_max_over_mean"]["1"] == pytest.approx(max(total_E) / (sum(total_E) / 4), rel=1e-12)
    with ExpertChoices(model):
        pass
    assert not any(m._forward_pre_hooks for m in model.modules() if isinstance(m, MoE))  # hooks removed


def _balance_row(variant: str, seed: int, batches: list[list[list[float]]]) -> dict:
    choices = SimpleNamespace(layers=["0", "1"], batches_BLE=[torch.tensor(b, dtype=torch.float64) for b in batches])
    per_step = {"warmup_steps": 100, "steps_after_warmup": 300, "lr_warmup_steps": 30,
                "max_over_mean_max_after_lr_warmup": 3.25, "max_over_mean_max": 1.75,
                "max_over_mean_median": 1.3, "max_over_mean_p95": 1.52, "layer_mean_median": 1.18,
                "layer_mean_p95": 1.29, "steps_at_or_over_bound": 17, "per_layer_max": {}, "last_step_loads": {}}
    return {"variant": variant, "seed": seed, **per_step, **held_out_balance(choices)}


def test_held_out_balance_figures_and_the_table_with_both_readings():
    # Layer 0: batches [4,4,4,4] (1.0) and [10,2,2,2] (2.5), whole set [14,6,6,6] -> 14 / 8 = 1.75.
    # Layer 1: batches [8,4,2,2] (2.0) and [2,4,6,4] (1.5), whole set [10,8,8,6] -> 10 / 8 = 1.25.
    row = _balance_row("standard", 0, [[[4, 4, 4, 4], [8, 4, 2, 2]], [[10, 2, 2, 2], [2, 4, 6, 4]]])
    assert row["held_out_loads"] == {"0": [14.0, 6.0, 6.0, 6.0], "1": [10.0, 8.0, 8.0, 6.0]}
    assert row["held_out_max_over_mean"] == {"0": 1.75, "1": 1.25}
    assert (row["held_out_worst"], row["held_out_layer_mean"]) == (1.75, 1.5)
    assert (row["held_out_batch_worst_median"], row["held_out_batch_worst_max"]) == (2.25, 2.5)
    assert kept_held_out(row) == "no" and kept(row) == "no"
    # Both layers [9,7,8,8] over the set (9 / 8 = 1.125) though one batch's layer 0 is at 2.0.
    good = _balance_row("Block AttnRes (N=8)", 1, [[[8, 0, 4, 4], [5, 3, 4, 4]], [[1, 7, 4, 4], [4, 4, 4, 4]]])
    assert good["held_out_worst"] == 1.125 and kept_held_out(good) == "yes"
    moe = ModelConfig(**DEPTH_MODEL, moe_experts=4, moe_top_k=2, moe_router="sigmoid").to_dict()
    result = {"date": "2026-12-07", "wall_time_s": 60.0, "moe": moe, "balance": [good, row],
              "budget": {"steps": 400, "batch_size": 32, "seq_len": 64, "tokens_per_run": 819200, "seeds": 2,
                         "held_out_bytes": 131072, "held_out_batch_windows": 64},
              "environment": {"jobs": 2}, "rows": [], "block_run_sites": []}
    lines = to_markdown(result).splitlines()
    header = next(line for line in lines if line.startswith("| variant | seed |"))
    cells = [c.strip() for c in header.strip("|").split("|")]
    assert cells[2:7] == ["held out: worst layer", "mean over layers", "per batch: median", "max", "kept, held out"]
    assert cells[7:] == ["per step: steps after warm-up", "worst layer: median", "p95", "max", "steps >= 1.5",
                         "mean over layers: median", "p95", "kept, per step", "max after lr warm-up"]
    body = [line for line in lines if line.startswith(("| standard | 0 |", "| Block AttnRes (N=8) | 1 |"))]
    assert body[0] == ("| standard | 0 | 1.750 | 1.500 | 2.250 | 2.500 | no | 300 | 1.300 | 1.520 | 1.750 | 17 | "
                       "1.180 | 1.290 | no | 3.250 |")
    assert body[1].startswith("| Block AttnRes (N=8) | 1 | 1.125 | 1.125 | 1.875 | 2.000 | yes | 300 |")
    assert any("64 x 64 = 4,096 tokens" in line and "131,072 bytes" in line for line in lines)
