"""The layer recipe (docs/spec.md section 11) against references written from its formulas alone,
in float64: attention with grouped kv heads (query head h reads kv head h // group), QK-norm and
rotary positions as explicit 2-D rotations of channel pairs (i, i + E/2) by t theta^(-2i/E); the
SwiGLU MLP; the fused rows' layout against transformers' q/k/v order; tied embeddings; the
closed-form parameter count; and the refusals of a bad recipe."""

from __future__ import annotations

import math

import pytest
import torch

from attnres_pp.model import ModelConfig, Transformer
from attnres_pp.model.layers import MLP, Attention, fuse_qkv_rows, split_qkv_rows
from attnres_pp.model.transformer import parameter_count

RECIPES = {
    "mha": dict(n_heads=4),
    "gqa": dict(n_heads=4, n_kv_heads=2),
    "mqa": dict(n_heads=4, n_kv_heads=1),
    "gqa-qk-norm": dict(n_heads=4, n_kv_heads=2, qk_norm=True),
    "mha-qk-norm-theta": dict(n_heads=4, qk_norm=True, rope_theta=500.0),
    "learned": dict(n_heads=4, n_kv_heads=2, positions="learned"),
}


def _cfg(**recipe) -> ModelConfig:
    return ModelConfig(**{**dict(vocab_size=32, n_layers=2, d_model=32, seq_len=12), **recipe})


def _rms(x, gain, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * gain


def _rotate_pairs(x_TE: torch.Tensor, theta: float) -> torch.Tensor:
    """Channel pair (i, i + E/2) of position t turned by the angle t theta^(-2i/E), one pair at a time."""
    seq, head_dim = x_TE.shape
    out = x_TE.clone()
    for t in range(seq):
        for i in range(head_dim // 2):
            angle = t * theta ** (-2 * i / head_dim)
            a, b = x_TE[t, i], x_TE[t, i + head_dim // 2]
            out[t, i] = a * math.cos(angle) - b * math.sin(angle)
            out[t, i + head_dim // 2] = a * math.sin(angle) + b * math.cos(angle)
    return out


def _reference_attention(attn: Attention, cfg: ModelConfig, h_TD: torch.Tensor) -> torch.Tensor:
    """One sequence, head by head, from q_proj / k_proj / v_proj rows in transformers' order."""
    seq, head_dim, group = h_TD.shape[0], cfg.head_dim, cfg.n_heads // cfg.kv_heads
    wq, wk, wv = split_qkv_rows(cfg, attn.qkv.weight)
    x_TD = _rms(h_TD, attn.norm.weight, cfg.norm_eps)
    outputs = []
    for h in range(cfg.n_heads):
        g = h // group
        q = x_TD @ wq[h * head_dim:(h + 1) * head_dim].T
        k = x_TD @ wk[g * head_dim:(g + 1) * head_dim].T
        v = x_TD @ wv[g * head_dim:(g + 1) * head_dim].T
        if cfg.qk_norm:
            q, k = _rms(q, attn.q_norm.weight, cfg.norm_eps), _rms(k, attn.k_norm.weight, cfg.norm_eps)
        if cfg.positions == "rope":
            q, k = _rotate_pairs(q, cfg.rope_theta), _rotate_pairs(k, cfg.rope_theta)
        scores = q @ k.T / math.sqrt(head_dim)
        scores = scores.masked_fill(torch.ones(seq, seq, dtype=torch.bool).triu(1), float("-inf"))
        outputs.append(torch.softmax(scores, -1) @ v)
    return torch.cat(outputs, -1) @ attn.proj.weight.T


def _randomised(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=generator, dtype=p.dtype) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
    return module


@pytest.mark.parametrize("name", RECIPES)
def test_attention_equals_a_head_by_head_float64_reference(name):
    cfg = _cfg(**RECIPES[name])
    attn = _randomised(Attention(cfg).double(), seed=3)
    h_BTD = torch.randn(2, cfg.seq_len, cfg.d_model, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    got = attn(h_BTD)
    for b in range(2):
        torch.testing.assert_close(got[b], _reference_attention(attn, cfg, h_BTD[b]), rtol=1e-10, atol=1e-12)


def test_the_reference_tells_the_rotation_and_the_grouping_apart():
    """Not vacuous: the reference with another theta, or with kv heads read as h % kv_heads, differs."""
    cfg = _cfg(**RECIPES["gqa"])
    attn = _randomised(Attention(cfg).double(), seed=3)
    h_TD = torch.randn(cfg.seq_len, cfg.d_model, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    want = _reference_attention(attn, cfg, h_TD)
    other_theta = _reference_attention(attn, _cfg(**RECIPES["gqa"], rope_theta=100.0), h_TD)
    assert (want - other_theta).abs().max() > 1e-3
    wq, wk, wv = split_qkv_rows(cfg, attn.qkv.weight)
    swapped = torch.cat([wq.view(cfg.n_heads, -1)[[0, 2, 1, 3]].view_as(wq), wk, wv])  # heads 1 and 2 trade groups
    with torch.no_grad():
        attn.qkv.weight.copy_(fuse_qkv_rows(cfg, *swapped.split([wq.shape[0], wk.shape[0], wv.shape[0]])))
    assert (attn(h_TD[None])[0] - want).abs().max() > 1e-3


def test_rotation_scores_depend_only_on_the_distance():
    """<rot(q, m), rot(k, n)> is a function of m - n: what makes rotary positions relative."""
    cfg = _cfg(n_heads=4, qk_norm=False)
    from attnres_pp.model.rotary import apply_rotary, rotary_cos_sin

    gen = torch.Generator().manual_seed(5)
    q, k = torch.randn(cfg.head_dim, generator=gen, dtype=torch.float64), torch.randn(cfg.head_dim, generator=gen,
                                                                                     dtype=torch.float64)
    cos, sin = rotary_cos_sin(torch.arange(40), cfg.head_dim, cfg.rope_theta, torch.float64)
    rq, rk = apply_rotary(q.expand(40, -1), cos, sin), apply_rotary(k.expand(40, -1), cos, sin)
    for distance in (0, 3, 17):
        scores = torch.stack([rq[m] @ rk[m - distance] for m in range(distance, 40)])
        torch.testing.assert_close(scores, scores[0].expand_as(scores), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(rq, torch.stack([_rotate_pairs(q[None], cfg.rope_theta)[0]] * 1 + [
        _rotate_pairs(q.expand(m + 1, -1).clone(), cfg.rope_theta)[m] for m in range(1, 40)]), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mlp", ["swiglu", "gelu"])
def test_mlp_equals_its_formula(mlp):
    cfg = _cfg(n_heads=4, mlp=mlp)
    module = _randomised(MLP(cfg).double(), seed=6)
    h = torch.randn(2, 5, cfg.d_model, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    x = _rms(h, module.norm.weight, cfg.norm_eps)
    if mlp == "swiglu":
        gate, up = module.gate_up.weight[:cfg.ff_dim], module.gate_up.weight[cfg.ff_dim:]
        a = x @ gate.T
        want = (a * torch.sigmoid(a) * (x @ up.T)) @ module.down.weight.T
    else:
        want = torch.nn.functional.gelu(x @ module.up.weight.T) @ module.down.weight.T
    torch.testing.assert_close(module(h), want, rtol=1e-10, atol=1e-12)


def test_default_hidden_width_follows_the_recipe():
    assert ModelConfig(d_model=64).ff_dim == 192 and ModelConfig(d_model=4096, n_heads=32).ff_dim == 10944
    assert ModelConfig(d_model=64, mlp="gelu").ff_dim == 256 and ModelConfig(d_model=64, d_ff=100).ff_dim == 100


@pytest.mark.parametrize("name", RECIPES)
def test_fused_rows_round_trip_and_multi_head_rows_are_q_k_v(name):
    cfg = _cfg(**RECIPES[name])
    w = torch.randn(cfg.qkv_parts * cfg.kv_heads * cfg.head_dim, cfg.d_model, dtype=torch.float64)
    q, k, v = split_qkv_rows(cfg, w)
    assert q.shape == (cfg.d_model, cfg.d_model) and k.shape == v.shape == (cfg.kv_heads * cfg.head_dim, cfg.d_model)
    assert torch.equal(fuse_qkv_rows(cfg, q, k, v), w)
    if cfg.kv_heads == cfg.n_heads:  # every checkpoint written before grouped heads: rows [q | k | v]
        assert torch.equal(torch.cat([q, k, v]), w)


@pytest.mark.parametrize("recipe", [{}, dict(n_kv_heads=1, qk_norm=True), dict(tie_embeddings=True),
                                    dict(positions="learned", mlp="gelu", n_kv_heads=2),
                                    dict(residual="lr_attnres", key_mode="projected", n_kv_heads=2),
                                    dict(residual="msar", qk_norm=True, tie_embeddings=True)])
def test_parameter_count_in_closed_form(recipe):
    cfg = _cfg(n_heads=4, **recipe)
    model = Transformer(cfg)
    assert sum(p.numel() for p in model.parameters()) == parameter_count(cfg)


def test_tied_embeddings_are_one_parameter_whose_gradient_has_both_uses():
    cfg = _cfg(n_heads=4, tie_embeddings=True)
    model = Transformer(cfg, seed=1).double()
    assert model.head.lm_head.weight is model.embed.tok.weight
    assert "head.lm_head.weight" not in dict(model.named_parameters())
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=torch.Generator().manual_seed(8))
    model(idx, idx).backward()
    untied = Transformer(_cfg(n_heads=4), seed=1).double()
    with torch.no_grad():
        for name, p in untied.named_parameters():
            p.copy_(dict(model.named_parameters())["embed.tok.weight" if name == "head.lm_head.weight" else name])
    untied(idx, idx).backward()
    both = untied.embed.tok.weight.grad + untied.head.lm_head.weight.grad
    torch.testing.assert_close(model.embed.tok.weight.grad, both, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("fields, message", [
    (dict(n_heads=4, n_kv_heads=3), "must divide the 4 query heads"),
    (dict(n_heads=4, positions="alibi"), "choose one of rope, learned"),
    (dict(n_heads=4, mlp="relu"), "choose one of swiglu, gelu"),
    (dict(n_heads=4, rope_theta=0), "must be a finite number > 0"),
    (dict(n_heads=4, rope_theta=-5.0), "must be a finite number > 0"),
    (dict(d_model=24, n_heads=8), "rotary positions need an even head dimension"),
    (dict(n_heads=4, qk_norm="yes"), "must be true or false"),
])
def test_a_bad_recipe_is_refused_saying_how_to_fix_it(fields, message):
    with pytest.raises(ValueError, match=message):
        _cfg(**fields)
