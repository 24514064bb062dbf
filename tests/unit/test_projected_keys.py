"""Projected low-rank keys under blocks (docs/spec.md section 1.3): every emitted key is RMS-normalised before it is
summed, so a block's key is the sum of its sublayers' normalised keys and the partial's the sum so
far. Checked on the block summaries the model actually builds, against the sublayers' raw outputs."""

from __future__ import annotations

import pytest
import torch

from attnres_pp.model import ModelConfig, Transformer
from attnres_pp.model.stack import forward_sublayers
from attnres_pp.model.transformer import embed_state
from tests.reference_model import randomize_depth_params, reference_logits

TINY = dict(vocab_size=32, n_layers=3, d_model=16, n_heads=2, seq_len=12)
PROJECTED = dict(residual="lr_attnres", key_mode="projected", key_rank=4)


def _model(**overrides) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**{**TINY, **PROJECTED, **overrides}), backend="torch").double()
    randomize_depth_params(model, torch.Generator().manual_seed(1))
    return model


def _rms(x, eps):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _capture_raw_outputs(model):
    """Hooks recording the embedding's and each sublayer's raw packed output [B, T, d + r]."""
    raw = {}
    handles = [model.embed.register_forward_hook(lambda mod, args, out: raw.__setitem__("emb", out))]
    for l in range(model.cfg.n_sublayers):
        sub = model.layers[l // 2].sublayer(l % 2)
        handles.append(sub.register_forward_hook(lambda mod, args, out, l=l: raw.__setitem__(l, out)))
    return raw, handles


def _expected_source(cfg, raw_outputs):
    """Packed source from raw outputs: plain sum of values, sum of RMS-normalised keys."""
    d = cfg.d_model
    values = sum(out[..., :d] for out in raw_outputs)
    keys = sum(_rms(out[..., d:], cfg.norm_eps) for out in raw_outputs)
    return values, keys


@pytest.mark.parametrize("block_size", [2, 4])  # 4 leaves a short trailing block of 2 (L = 6)
def test_block_and_partial_keys_are_sums_of_normalised_sublayer_keys(block_size):
    model = _model(block_size=block_size)
    cfg, d = model.cfg, model.cfg.d_model
    idx = torch.randint(0, 32, (2, 12), generator=torch.Generator().manual_seed(2))
    raw, handles = _capture_raw_outputs(model)
    layers = dict(enumerate(model.layers))
    try:
        # Stopping after every sublayer, as a pipeline chunk boundary would, exposes each partial.
        for stop in range(1, cfg.n_sublayers + 1):
            state = forward_sublayers(cfg, layers, None, embed_state(cfg, model.embed, idx), range(stop), "torch")
            groups = [["emb"]] + [list(range(s, min(s + block_size, stop))) for s in range(0, stop, block_size)]
            open_block = stop % block_size != 0 and stop != cfg.n_sublayers
            sources = state.blocks + ([state.partial] if state.partial is not None else [])
            assert (state.partial is not None) == open_block
            assert len(sources) == len(groups)
            for group, source in zip(groups, sources, strict=True):
                values, keys = _expected_source(cfg, [raw[g] for g in group])
                torch.testing.assert_close(source[..., :d], values, rtol=1e-12, atol=1e-12)
                torch.testing.assert_close(source[..., d:], keys, rtol=1e-12, atol=1e-12)
    finally:
        for handle in handles:
            handle.remove()
    # Raw keys are far from unit RMS here, so summing them unnormalised could not pass the checks above.
    block_1 = [raw[l] for l in range(block_size)]
    assert not torch.allclose(sum(out[..., d:] for out in block_1), _expected_source(cfg, block_1)[1])


def test_whole_model_reads_the_blocks_built_from_normalised_keys():
    """The final read sees the same summaries: captured where the head receives them."""
    model = _model(block_size=4)
    cfg, d = model.cfg, model.cfg.d_model
    idx = torch.randint(0, 32, (2, 12), generator=torch.Generator().manual_seed(3))
    raw, handles = _capture_raw_outputs(model)
    seen = []
    handles.append(model.head.register_forward_pre_hook(lambda mod, args: seen.append(args[0])))
    try:
        model(idx)
    finally:
        for handle in handles:
            handle.remove()
    groups = [["emb"], [0, 1, 2, 3], [4, 5]]
    assert len(seen[0].blocks) == len(groups)
    for group, block in zip(groups, seen[0].blocks, strict=True):
        values, keys = _expected_source(cfg, [raw[g] for g in group])
        torch.testing.assert_close(block[..., :d], values, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(block[..., d:], keys, rtol=1e-12, atol=1e-12)


def test_full_attnres_equals_normalising_each_key_once():
    """block_size = 1: RMSNorm(RMSNorm(k)) = RMSNorm(k) up to eps, so with a negligible eps the model
    equals the oracle that sums raw keys and normalises only at the read. Under blocks it does not."""
    idx = torch.randint(0, 32, (2, 12), generator=torch.Generator().manual_seed(4))
    full = _model(block_size=1, norm_eps=1e-30)
    once = reference_logits(full, idx, normalize_emitted_keys=False)
    torch.testing.assert_close(full(idx), once, rtol=1e-10, atol=1e-10)
    blocks = _model(block_size=2, norm_eps=1e-30)
    assert not torch.allclose(blocks(idx), reference_logits(blocks, idx, normalize_emitted_keys=False),
                              rtol=1e-6, atol=1e-6)
