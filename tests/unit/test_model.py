"""The model family against a float64 oracle written from docs/spec.md section 1, plus its identities."""

from __future__ import annotations

import pytest
import torch

from attnres_pp.model import ModelConfig, Transformer, parameter_count
from tests.reference_model import VARIANTS, randomize_depth_params, reference_logits

TINY = dict(vocab_size=32, n_layers=3, d_model=16, n_heads=2, seq_len=12)


def _model(variant: str, **overrides) -> Transformer:
    cfg = ModelConfig(**{**TINY, **VARIANTS[variant], **overrides})
    torch.manual_seed(0)
    return Transformer(cfg, backend="torch")


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_two_phase_model_equals_one_softmax_oracle_float64(variant):
    model = _model(variant).double()
    randomize_depth_params(model, torch.Generator().manual_seed(1))
    idx = torch.randint(0, 32, (2, 12), generator=torch.Generator().manual_seed(2))
    got = model(idx)
    want = reference_logits(model, idx)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_parameter_count_matches_formula(variant):
    model = _model(variant)
    assert sum(p.numel() for p in model.parameters()) == parameter_count(model.cfg)


def test_zero_queries_make_every_read_the_plain_mean():
    model = _model("full").double()
    idx = torch.randint(0, 32, (2, 12))
    captured = []
    first_mlp = model.layers[0].mlp
    handle = first_mlp.register_forward_pre_hook(lambda mod, args: captured.append(args[0]))
    model(idx)
    handle.remove()
    # Sublayer 1 (layer 0's MLP) reads b_0 = embedding and b_1 = attention output, plain mean.
    o_emb = model.embed(idx)
    o_attn = model.layers[0].attn(o_emb)  # sublayer 0 reads only b_0: its input is o_emb itself
    torch.testing.assert_close(captured[0], (o_emb + o_attn) / 2)


def test_sliced_keys_with_full_rank_equal_standard_attnres():
    d = TINY["d_model"]
    sliced = _model("lr_sliced", key_rank=d, block_size=2).double()
    plain = _model("block", block_size=2).double()
    plain.load_state_dict(sliced.state_dict())
    randomize_depth_params(sliced, torch.Generator().manual_seed(3))
    plain.load_state_dict(sliced.state_dict())
    idx = torch.randint(0, 32, (2, 12))
    torch.testing.assert_close(sliced(idx), plain(idx), rtol=0, atol=1e-12)


def test_block_size_equal_to_depth_reads_embedding_and_one_running_partial():
    model = _model("block", block_size=2 * TINY["n_layers"]).double()
    randomize_depth_params(model, torch.Generator().manual_seed(4))
    idx = torch.randint(0, 32, (2, 12))
    o_emb = model.embed(idx)
    partial = None
    for l in range(model.cfg.n_sublayers):
        sub = model.layers[l // 2].sublayer(l % 2)
        if partial is None:
            h = o_emb
        else:
            from attnres_pp.kernels import rms_normalize

            s = torch.stack([rms_normalize(x, 1e-6) @ sub.read.query for x in (o_emb, partial)], -1)
            a = torch.softmax(s, -1)
            h = a[..., :1] * o_emb + a[..., 1:] * partial
        out = sub(h)
        partial = out if partial is None else partial + out
    s = torch.stack([rms_normalize(x, 1e-6) @ model.head.read.query for x in (o_emb, partial)], -1)
    a = torch.softmax(s, -1)
    want = model.head.lm_head(model.head.norm(a[..., :1] * o_emb + a[..., 1:] * partial))
    torch.testing.assert_close(model(idx), want, rtol=1e-10, atol=1e-10)


def test_msar_streams_differ_from_step_zero():
    model = _model("msar")
    v = torch.randn(1, 12, TINY["d_model"])
    streams = model.stream_convs.streams(0, v)
    for s in range(1, len(streams)):
        assert not torch.allclose(streams[s], streams[0])
    # Causal: the first output of a moving average only sees v[0].
    torch.testing.assert_close(streams[1][:, 0], v[:, 0] / model.cfg.stream_kernels[0])


def test_sequence_longer_than_seq_len_is_refused():
    model = _model("block")
    with pytest.raises(ValueError, match="seq_len"):
        model(torch.zeros(1, 13, dtype=torch.long))


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (dict(block_size=0), "block_size"),
        (dict(residual="lr_attnres", key_rank=17), "key_rank"),
        (dict(n_heads=3), "n_heads"),
        (dict(residual="bogus"), "residual"),
        (dict(seq_len=0), "seq_len"),
        (dict(key_mode="diagonal"), "key_mode"),
        (dict(block_size=7), "block_size"),
        (dict(stream_kernels=()), "stream_kernels"),
    ],
)
def test_bad_config_names_the_field_and_the_fix(overrides, field):
    with pytest.raises(ValueError, match=rf"ModelConfig\.{field}=.*: (must|choose)"):
        ModelConfig(**{**TINY, **overrides})


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_initialisation_is_keyed_by_seed_and_parameter_name(variant):
    """Same seed, same values whatever the global RNG state; another seed, other random values;
    and a parameter's value does not depend on the rest of the model (its own stream by name)."""
    cfg = ModelConfig(**{**TINY, **VARIANTS[variant]})
    torch.manual_seed(123)
    a = dict(Transformer(cfg, seed=5).named_parameters())
    torch.manual_seed(456)
    b = dict(Transformer(cfg, seed=5).named_parameters())
    c = dict(Transformer(cfg, seed=6).named_parameters())
    assert all(torch.equal(a[n], b[n]) for n in a)
    random = [n for n in a if n.endswith(("qkv.weight", "tok.weight", "lm_head.weight"))]
    assert random and all(not torch.equal(a[n], c[n]) for n in random)
    wider_vocab = ModelConfig(**{**TINY, **VARIANTS[variant], "vocab_size": 40})
    other = dict(Transformer(wider_vocab, seed=5).named_parameters())
    assert torch.equal(other["layers.0.attn.qkv.weight"], a["layers.0.attn.qkv.weight"])
