"""The MoE sublayer of docs/spec.md section 12 against independent float64 references: the router's
choice (ties to the lower index, the bias only selecting), the routed and shared experts token by
token, the grouped matmul against its per-expert twin, the aux loss's gradient, the aux-free bias
rule, the loads (not counted twice under activation checkpointing), and the parameter counts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attnres_pp.model import ModelConfig, Transformer
from attnres_pp.model.layers import init_weights
from attnres_pp.model.moe import (
    MoE,
    _grouped_mm_fits,
    expert_load_stats,
    grouped_matmul,
    grouped_matmul_loop,
    moe_sublayers,
    route,
    seq_aux_loss,
    take_loads,
    update_expert_bias,
)
from attnres_pp.model.transformer import active_parameter_count, parameter_count
from attnres_pp.pipeline.config import PipelineConfig
from attnres_pp.train.config import RunConfig, TrainConfig
from attnres_pp.train.engines import make_engine

BASE = dict(vocab_size=32, n_layers=3, d_model=16, n_heads=2, seq_len=8, moe_experts=4, moe_top_k=2,
            moe_d_ff=8, moe_dense_layers=1)


def reference_choice(affinity: list[float], bias: list[float], k: int) -> list[int]:
    """Top k of affinity + bias, ties to the lower index, by plain sorting of (score, index) pairs."""
    scored = sorted(range(len(affinity)), key=lambda e: (-(affinity[e] + bias[e]), e))
    return scored[:k]


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_the_router_chooses_the_top_k_of_affinity_plus_bias_with_ties_to_the_lower_index(router):
    cfg = ModelConfig(**{**BASE, "moe_experts": 6, "moe_top_k": 3, "moe_router": router})
    g = torch.Generator().manual_seed(0)
    x_ND = torch.randn(40, 16, generator=g, dtype=torch.float64)
    router_ED = torch.randn(6, 16, generator=g, dtype=torch.float64)
    router_ED[3] = router_ED[1]  # experts 1 and 3 always tie, as do 0 and 5 below
    router_ED[5] = router_ED[0]
    bias_E = torch.tensor([0.0, 0.25, 0.0, 0.25, -0.5, 0.0], dtype=torch.float64)
    affinity_NE, expert_NK, gate_NK = route(cfg, x_ND, router_ED, bias_E)
    logits = x_ND @ router_ED.t()
    want_affinity = logits.softmax(-1) if router == "softmax" else logits.sigmoid()
    torch.testing.assert_close(affinity_NE, want_affinity, rtol=1e-12, atol=0)
    for n in range(40):
        chosen = reference_choice(want_affinity[n].tolist(), bias_E.tolist(), 3)
        assert expert_NK[n].tolist() == chosen, n
        picked = want_affinity[n, chosen]  # the bias only selects: gates are the affinities' own shares
        torch.testing.assert_close(gate_NK[n], picked / picked.sum(), rtol=1e-12, atol=0)
    assert (expert_NK == 1).any() and not ((expert_NK == 3) & ~(expert_NK == 1).any(-1, keepdim=True)).any()


def _expert(x, gate_up, down):
    gate, up = (gate_up @ x).chunk(2)
    return down @ (F.silu(gate) * up)


@pytest.mark.parametrize("overrides", [
    {},
    {"moe_shared_experts": 2, "moe_router": "sigmoid"},
    {"residual": "lr_attnres", "key_mode": "projected", "key_rank": 4, "moe_shared_experts": 1},
], ids=["routed", "shared-sigmoid", "projected-keys"])
def test_an_moe_sublayer_equals_its_experts_summed_token_by_token_in_float64(overrides):
    cfg = ModelConfig(**{**BASE, **overrides})
    model = Transformer(cfg, seed=3).double()
    moe = model.layers[1].mlp
    assert isinstance(moe, MoE) and not isinstance(model.layers[0].mlp, MoE)
    with torch.no_grad():
        moe.expert_bias.copy_(torch.tensor([0.1, 0.0, -0.1, 0.05]))
    h_BTD = torch.randn(2, 5, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    out_BTW = moe(h_BTD)
    assert out_BTW.shape == (2, 5, cfg.source_width)
    x_ND = moe.norm(h_BTD).reshape(-1, 16)
    for n, x in enumerate(x_ND):
        logits = moe.router.weight @ x
        affinity = logits.softmax(-1) if cfg.moe_router == "softmax" else logits.sigmoid()
        chosen = reference_choice(affinity.tolist(), moe.expert_bias.tolist(), cfg.moe_top_k)
        gates = affinity[chosen] / affinity[chosen].sum()
        want = sum(g * _expert(x, moe.experts.gate_up[e], moe.experts.down[e])
                   for g, e in zip(gates, chosen, strict=True))
        if moe.shared is not None:
            f = cfg.expert_dim
            gate_w, up_w = moe.shared.gate_up.weight.chunk(2)
            for s in range(cfg.moe_shared_experts):  # the shared experts one by one
                rows = slice(s * f, (s + 1) * f)
                want = want + _expert(x, torch.cat([gate_w[rows], up_w[rows]]), moe.shared.down.weight[:, rows])
        torch.testing.assert_close(out_BTW.reshape(-1, cfg.source_width)[n], want, rtol=1e-12, atol=1e-14)


def test_the_grouped_matmul_equals_one_matmul_per_expert_forward_and_backward():
    g = torch.Generator().manual_seed(5)
    counts = [5, 0, 9, 2]  # an expert without tokens in the middle
    x = torch.randn(16, 32, generator=g, requires_grad=True)
    w = torch.randn(4, 24, 32, generator=g, requires_grad=True)
    assert _grouped_mm_fits(x, w.transpose(1, 2))  # the fast path is the one under test
    y = grouped_matmul(x, w, counts)
    grad = torch.randn(y.shape, generator=g)
    gx, gw = torch.autograd.grad(y, (x, w), grad)
    y_ref = grouped_matmul_loop(x, w, counts)
    gx_ref, gw_ref = torch.autograd.grad(y_ref, (x, w), grad)
    for got, want in ((y, y_ref), (gx, gx_ref), (gw, gw_ref)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(gw[1], torch.zeros_like(gw[1]))
    assert not _grouped_mm_fits(x.double(), w.double().transpose(1, 2))  # float64 takes the twin
    # an expanded output gradient (zero strides), which torch's grouped backward alone refuses
    gx_sum, gw_sum = torch.autograd.grad(grouped_matmul(x, w, counts).sum(), (x, w))
    gx_loop, gw_loop = torch.autograd.grad(grouped_matmul_loop(x, w, counts).sum(), (x, w))
    torch.testing.assert_close(gx_sum, gx_loop, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gw_sum, gw_loop, rtol=1e-5, atol=1e-5)


def _moe_inputs(model: Transformer) -> dict[int, torch.Tensor]:
    inputs = {}
    for i, layer in enumerate(model.layers):
        if isinstance(layer.mlp, MoE):
            layer.mlp.norm.register_forward_hook(lambda _m, _args, out, i=i: inputs.__setitem__(i, out))
    return inputs


def test_the_aux_loss_trains_the_router_as_coef_e_sum_f_p_added_to_the_loss():
    cfg = ModelConfig(**BASE, moe_balance="aux_loss", moe_aux_loss_coef=0.3)
    idx = torch.randint(0, 32, (3, 8), generator=torch.Generator().manual_seed(6))
    model = Transformer(cfg, seed=1).double()
    model(idx[:, :-1], idx[:, 1:]).backward()
    got = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    # The same weights without the aux loss, which is then added by hand from the MoE inputs.
    plain = Transformer(ModelConfig(**BASE, moe_balance="none"), seed=1).double()
    inputs = _moe_inputs(plain)
    loss = plain(idx[:, :-1], idx[:, 1:])
    for i, x_BTD in inputs.items():
        x_ND = x_BTD.reshape(-1, 16)
        affinity_NE = (x_ND @ plain.layers[i].mlp.router.weight.t()).softmax(-1)
        f_E = torch.zeros(4, dtype=torch.float64)
        for row in affinity_NE.detach():
            for e in reference_choice(row.tolist(), [0.0] * 4, 2):
                f_E[e] += 1 / (x_ND.shape[0] * 2)
        loss = loss + 0.3 * 4 * (f_E * affinity_NE.mean(0)).sum()
    loss.backward()
    for name, p in plain.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(got[name], p.grad, rtol=1e-10, atol=1e-13, msg=name)
    assert got["layers.1.mlp.router.weight"].abs().sum() > 0


def test_the_aux_free_bias_moves_gamma_toward_the_mean_load_and_only_under_aux_free():
    free = MoE(ModelConfig(**BASE, moe_bias_gamma=0.01))
    off = MoE(ModelConfig(**BASE, moe_balance="none"))
    loads = torch.tensor([[30.0, 10.0, 20.0, 20.0]], dtype=torch.float64)
    update_expert_bias({"a": free}, loads)
    update_expert_bias({"b": off}, loads)
    torch.testing.assert_close(free.expert_bias.detach(), torch.tensor([-0.01, 0.01, 0.0, 0.0]))
    assert torch.equal(off.expert_bias.detach(), torch.zeros(4))
    assert not free.expert_bias.requires_grad


def _engine_step(policy: str) -> tuple[dict, dict]:
    cfg = ModelConfig(**BASE, moe_balance="aux_loss")
    train = TrainConfig(steps=1, batch_size=4, microbatches=2, seed=0, device="cpu", activation_checkpoint=policy)
    engine = make_engine(RunConfig(model=cfg, train=train, pipeline=PipelineConfig(launcher="local")))
    idx = torch.randint(0, 32, (4, 9), generator=torch.Generator().manual_seed(7))
    try:
        result = engine.train_step(0, idx[:, :-1], idx[:, 1:], lr=1e-3)
    finally:
        engine.close()
    return result.extras["moe_expert_loads"], result.metrics


def test_a_step_counts_every_token_choice_once_also_under_activation_checkpointing():
    loads, metrics = _engine_step("none")
    recomputed_loads, recomputed_metrics = _engine_step("full")
    assert loads == recomputed_loads
    assert set(loads) == {"1", "2"} and all(sum(per_expert) == 4 * 8 * 2 for per_expert in loads.values())
    for key in ("moe_aux_loss", "moe_load_max_over_mean", "moe_load_max_over_mean/1"):
        assert recomputed_metrics[key] == pytest.approx(metrics[key], rel=1e-6), key
    assert metrics["moe_load_max_over_mean"] >= 1.0


def test_load_stats_name_each_layer_and_the_worst():
    extras, metrics = expert_load_stats({"layers.2.mlp": [4, 4, 4, 4], "layers.5.mlp": [8, 0, 4, 4]}, [(0.5, 2)])
    assert extras == {"moe_expert_loads": {"2": [4, 4, 4, 4], "5": [8, 0, 4, 4]}}
    assert metrics == {"moe_load_max_over_mean/2": 1.0, "moe_load_max_over_mean/5": 2.0,
                       "moe_load_max_over_mean": 2.0, "moe_aux_loss": 0.25}


def test_evaluation_counts_no_loads_and_take_loads_empties_them():
    model = Transformer(ModelConfig(**BASE), seed=0)
    idx = torch.randint(0, 32, (2, 8))
    with torch.no_grad():
        model(idx)
    moes = moe_sublayers(model)
    assert list(moes) == ["layers.1.mlp", "layers.2.mlp"]
    assert float(take_loads(moes).sum()) == 0
    model(idx)
    assert take_loads(moes).sum(1).tolist() == [2 * 8 * 2] * 2
    assert float(take_loads(moes).sum()) == 0


@pytest.mark.parametrize("overrides", [
    {}, {"moe_shared_experts": 2, "moe_dense_layers": 0}, {"residual": "lr_attnres", "key_mode": "projected"},
    {"residual": "msar", "moe_top_k": 4, "moe_experts": 4},
])
def test_parameter_counts_total_and_active_in_closed_form(overrides):
    cfg = ModelConfig(**{**BASE, **overrides})
    with torch.device("meta"):
        model = Transformer(cfg)
    total = sum(p.numel() for p in model.parameters())
    assert parameter_count(cfg) == total
    routed = sum(m.experts.gate_up.numel() + m.experts.down.numel() for m in moe_sublayers_meta(model))
    unused = routed * (cfg.moe_experts - cfg.moe_top_k) // cfg.moe_experts
    assert active_parameter_count(cfg) == total - unused


def moe_sublayers_meta(model: Transformer) -> list[MoE]:
    return [layer.mlp for layer in model.layers if isinstance(layer.mlp, MoE)]


def reference_seq_aux(affinity_NE: torch.Tensor, bias: list[float], batch: int, k: int, coef: float) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss written out per sequence and expert: alpha sum_e f_e P_e,
    f_e = E / (K T) (tokens of the sequence choosing e), P_e = mean over its tokens of a_e / sum_j a_j,
    averaged over the sequences."""
    n_experts = affinity_NE.shape[1]
    per_sequence = []
    for affinity_TE in affinity_NE.view(batch, -1, n_experts):
        length = affinity_TE.shape[0]
        counts = [0] * n_experts
        for row in affinity_TE.detach():
            for e in reference_choice(row.tolist(), bias, k):
                counts[e] += 1
        total = 0.0
        for e in range(n_experts):
            p_e = sum(affinity_TE[t, e] / affinity_TE[t].sum() for t in range(length)) / length
            total = total + n_experts / (k * length) * counts[e] * p_e
        per_sequence.append(coef * total)
    return sum(per_sequence[1:], per_sequence[0]) / batch


@pytest.mark.parametrize("router,balance", [("sigmoid", "aux_free"), ("softmax", "aux_loss")])
def test_the_sequence_wise_balance_loss_trains_the_router_as_its_float64_reference(router, balance):
    over = dict(moe_router=router, moe_balance=balance, moe_aux_loss_coef=0.2)
    cfg = ModelConfig(**BASE, **over, moe_seq_aux_coef=0.3)
    idx = torch.randint(0, 32, (3, 9), generator=torch.Generator().manual_seed(8))
    model = Transformer(cfg, seed=2).double()
    bias = [0.05, -0.02, 0.0, 0.01]  # the bias selects in the reference too
    for layer in model.layers[1:]:
        layer.mlp.expert_bias.data = torch.tensor(bias, dtype=torch.float64)
    model(idx[:, :-1], idx[:, 1:]).backward()
    got = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    # The same weights with the sequence-wise loss off, which is then added by hand from the MoE inputs.
    plain = Transformer(ModelConfig(**BASE, **over), seed=2).double()
    plain.load_state_dict(model.state_dict())
    inputs = _moe_inputs(plain)
    loss = plain(idx[:, :-1], idx[:, 1:])
    for i, x_BTD in inputs.items():
        logits_NE = x_BTD.reshape(-1, 16) @ plain.layers[i].mlp.router.weight.t()
        affinity_NE = logits_NE.softmax(-1) if router == "softmax" else logits_NE.sigmoid()
        loss = loss + reference_seq_aux(affinity_NE, bias, 3, 2, 0.3)
    loss.backward()
    for name, p in plain.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(got[name], p.grad, rtol=1e-10, atol=1e-13, msg=name)
    assert (got["layers.1.mlp.router.weight"] - plain.layers[1].mlp.router.weight.grad).abs().max() < 1e-12


def test_the_sequence_wise_loss_at_uniform_routing_is_its_coefficient():
    cfg = ModelConfig(**BASE, moe_seq_aux_coef=0.25)
    affinity_NE = torch.full((2 * 4, 4), 0.25, dtype=torch.float64)
    expert_NK = torch.tensor([[0, 1], [2, 3]] * 4)  # every expert chosen equally often in each sequence
    assert float(seq_aux_loss(cfg, affinity_NE, expert_NK, 2)) == pytest.approx(0.25, rel=1e-15)
    collapsed_NK = torch.tensor([[0, 1]] * 8)
    peaked_NE = torch.tensor([[0.4, 0.4, 0.1, 0.1]] * 8, dtype=torch.float64)
    assert float(seq_aux_loss(cfg, peaked_NE, collapsed_NK, 2)) == pytest.approx(0.25 * 4 * 0.4, rel=1e-12)


def _train_collapsed_router(coef: float, steps: int) -> list[float]:
    """max / mean load of a lone MoE sublayer whose router starts collapsed (every token's input shares
    one direction that the router maps to experts 0 and 1), trained on its balance losses alone."""
    cfg = ModelConfig(**{**BASE, "moe_experts": 8}, moe_router="sigmoid", moe_bias_gamma=0.0,
                      moe_seq_aux_coef=coef)
    moe = MoE(cfg)
    # A module built alone holds its experts as `torch.empty` until the model's initialisation runs:
    # left so, a NaN in that memory reaches the router's gradient through 0 x NaN in the backward.
    init_weights(moe, cfg, seed=0)
    moe = moe.double()
    g = torch.Generator().manual_seed(3)
    h_BTD = torch.randn(8, 32, 16, generator=g, dtype=torch.float64) + 0.7  # a shared mean direction
    with torch.no_grad():
        moe.router.weight.copy_(torch.randn(8, 16, generator=g, dtype=torch.float64) * 0.02)
        moe.router.weight[:2] += 0.2
    optimizer = torch.optim.Adam(moe.router.parameters(), lr=1e-2)
    ratios = []
    for _ in range(steps):
        moe(h_BTD).sum().mul(0.0).backward()  # only the balance loss reaches the router
        optimizer.step()
        optimizer.zero_grad()
        load_E = take_loads({"m": moe})[0]
        ratios.append(float(load_E.max() / load_E.mean()))
    return ratios


def test_a_collapsed_router_is_rebalanced_by_the_sequence_wise_loss_and_not_without_it():
    with_loss, without = _train_collapsed_router(0.1, 100), _train_collapsed_router(0.0, 100)
    assert with_loss[0] == without[0] == pytest.approx(4.0)  # every token to experts 0 and 1: E / K
    assert without[-1] == pytest.approx(4.0)
    assert max(with_loss[-20:]) < 1.5


def test_the_sequence_wise_loss_under_sequence_parallelism_is_one_clear_error():
    from attnres_pp.train import RunConfig

    model = ModelConfig(**{**BASE, "n_heads": 2}, moe_seq_aux_coef=1e-3).to_dict()
    with pytest.raises(ValueError, match="--moe-seq-aux-coef with --tensor-parallel 2 under sequence parallelism"):
        RunConfig.from_dict({"model": model, "train": {"batch_size": 4, "microbatches": 1},
                             "pipeline": {"launcher": "local", "tensor_parallel": 2}})
    RunConfig.from_dict({"model": model, "train": {"batch_size": 4, "microbatches": 1},
                         "pipeline": {"launcher": "local", "tensor_parallel": 2, "sequence_parallel": False}})


def test_the_routers_learning_rate_is_its_scale_times_the_runs_and_one_group_without_a_scale():
    from attnres_pp.train.optim import build_optimizer, set_lr

    model = Transformer(ModelConfig(**BASE), seed=0)
    train = TrainConfig(steps=1, batch_size=2)
    plain = build_optimizer(model, train)
    assert len(plain.param_groups) == 2  # an old checkpoint's optimizer state keeps its groups
    scaled = build_optimizer(model, train, router_lr_scale=0.1)
    set_lr(scaled, 2e-3)
    routers = {id(m.router.weight) for m in moe_sublayers(model).values()}
    for group in scaled.param_groups:
        ids = {id(p) for p in group["params"]}
        assert group["lr"] == pytest.approx(2e-4 if ids == routers else 2e-3)
    assert sum(len(g["params"]) for g in scaled.param_groups) == sum(len(g["params"]) for g in plain.param_groups)
    assert any({id(p) for p in g["params"]} == routers and g["weight_decay"] == train.weight_decay
               for g in scaled.param_groups)


def test_a_saved_config_without_the_balance_options_loads_with_them_off():
    saved = ModelConfig(**BASE).to_dict()
    del saved["moe_seq_aux_coef"], saved["moe_router_lr_scale"]  # as a checkpoint written before them
    cfg = ModelConfig.from_dict(saved)
    assert (cfg.moe_seq_aux_coef, cfg.moe_router_lr_scale) == (0.0, 1.0)
    for bad in ({"moe_router_lr_scale": 0.0}, {"moe_router_lr_scale": 1.5}, {"moe_seq_aux_coef": -1e-3}):
        with pytest.raises(ValueError, match="--moe-router-lr-scale|--moe-seq-aux-coef"):
            ModelConfig(**BASE, **bad)


def test_the_balance_table_gives_percentiles_of_the_worst_layer_and_of_the_mean_over_layers(tmp_path):
    import json

    import numpy as np

    from attnres_pp.bench.quality_moe import balance_of_run, kept, percentile

    values = torch.rand(37, generator=torch.Generator().manual_seed(4)).tolist()
    for q in (0.0, 0.5, 0.95, 1.0):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, 100 * q)), rel=1e-12)
    layer0, layer1 = [3.0, 1.2, 1.4, 1.1, 1.6], [2.0, 1.3, 1.0, 1.2, 1.0]
    lines = [{"step": s, "moe_load_max_over_mean/0": a, "moe_load_max_over_mean/1": b,
              "moe_load_max_over_mean": max(a, b)} for s, (a, b) in enumerate(zip(layer0, layer1, strict=True))]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    row = balance_of_run(tmp_path, 1, 0, {})
    worst, means = [1.3, 1.4, 1.2, 1.6], [1.25, 1.2, 1.15, 1.3]
    assert row["max_over_mean_p95"] == pytest.approx(float(np.percentile(worst, 95)))
    assert row["layer_mean_median"] == pytest.approx(float(np.median(means)))
    assert row["layer_mean_p95"] == pytest.approx(float(np.percentile(means, 95)))
    assert kept(row) == "no" and kept({**row, "max_over_mean_p95": 1.49}) == "yes"
