"""Generation past the trained length with the exported remote code: its config carries the attention
window `attnres-pp generate` slides (`sliding_window`, by default the trained seq_len), its cache
keeps that window (transformers' sliding-window cache layer) beside MSAR's convolution history, and
transformers' `generate` at temperature 0 gives exactly our generator's tokens for more new tokens
than seq_len. Without the window (sliding_window null) it gives the tokens of our generator with an
unbounded window instead, which differ: the window is what makes them agree."""

from __future__ import annotations

import json

import pytest
import torch

from attnres_pp.export.cli import write_folder
from attnres_pp.generate.config import GenerationConfig
from attnres_pp.generate.engines import SingleProcessGenerator
from attnres_pp.generate.loop import generate_batch
from attnres_pp.model import ModelConfig
from tests.export.export_helpers import hf_greedy, load_hf, randomized, tokens

SEQ_LEN, NEW_TOKENS, UNBOUNDED = 8, 20, 10_000
BASE = dict(vocab_size=64, n_layers=3, d_model=32, n_heads=4, seq_len=SEQ_LEN)
VARIANTS = {  # name: (model options, export window; None: the default, seq_len)
    "block": (dict(residual="attnres", block_size=3, n_kv_heads=2), None),
    "full": (dict(residual="attnres", block_size=1, qk_norm=True), None),
    "p_lr": (dict(residual="lr_attnres", key_mode="projected", key_rank=4, block_size=2), None),
    "s_lr": (dict(residual="lr_attnres", key_mode="sliced", key_rank=4, block_size=3), None),
    # the default kernels (4, 8, 12): the widest reads 11 positions back, past the 8 the window holds
    "msar": (dict(residual="msar", block_size=3), None),
    "msar_window_5": (dict(residual="msar", block_size=2, stream_kernels=(3, 6), n_kv_heads=1), 5),
}
# Passes over 20 positions, each at most seq_len long (as our prefill cuts them): past > 0 with several
# new positions across the window's edge, one new position, and a pass ending past seq_len.
EDGES = [0, 5, 11, 12, 17, 20]


def ours_greedy(cfg: ModelConfig, named: dict, prompts_BT: torch.Tensor, window: int | None) -> list[list[int]]:
    """`attnres-pp generate`'s tokens (one process, its decode loop and caches), prompts included."""
    generator = SingleProcessGenerator(cfg, named, window=window)
    results = generate_batch(generator, prompts_BT.tolist(), GenerationConfig(max_new_tokens=NEW_TOKENS,
                                                                              temperature=0))
    return [prompt + r.tokens for prompt, r in zip(prompts_BT.tolist(), results, strict=True)]


def assert_cached_passes(cfg: ModelConfig, named: dict, theirs, window: int) -> None:
    """The logits of every position of `EDGES`' passes over transformers' cache (built from the config,
    as `generate` builds it) equal our generator's over the same passes; the cache then holds each
    layer's last window - 1 positions and MSAR's history its widest kernel's reach."""
    from transformers import DynamicCache

    idx_BT = tokens(cfg.vocab_size, 2, EDGES[-1], seed=5)
    generator = SingleProcessGenerator(cfg, named, window=window)
    cache = DynamicCache(config=theirs.config)
    got, want = [], []
    with torch.no_grad():
        for a, b in zip(EDGES[:-1], EDGES[1:], strict=True):
            got.append(theirs(idx_BT[:, a:b], cache=cache).logits)
            want.append(generator.forward([(a, b - a)], idx_BT[:, a:b], all_logits=True))
    got, want = torch.cat(got, dim=1), torch.cat(want, dim=1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    assert cache.get_seq_length() == EDGES[-1]  # rotary positions count every token, not only those kept
    assert len(cache.layers) == cfg.n_layers
    assert all(layer.keys.shape[2] == window - 1 for layer in cache.layers), [l.keys.shape for l in cache.layers]
    history = getattr(cache, "attnres_conv_history", {})
    assert (cfg.residual == "msar") == bool(history)
    assert all(kept.shape[1] == max(cfg.stream_kernels) - 1 for kept in history.values())


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_generation_past_seq_len_gives_attnres_generate_tokens(variant, tmp_path):
    options, export_window = VARIANTS[variant]
    cfg = ModelConfig(**BASE, **options)
    named = randomized(cfg, seed=len(variant))
    write_folder(tmp_path, cfg, named, max_bytes=10**9, window=export_window)
    window = export_window or SEQ_LEN
    assert json.loads((tmp_path / "config.json").read_text())["sliding_window"] == window
    theirs = load_hf(tmp_path)
    prompts = tokens(cfg.vocab_size, 2, 5, seed=2)
    want = ours_greedy(cfg, named, prompts, export_window)
    assert len(want[0]) == 5 + NEW_TOKENS > 2 * SEQ_LEN
    assert hf_greedy(theirs, prompts, NEW_TOKENS) == want  # the sliding-window cache, a token a step
    assert hf_greedy(theirs, prompts, NEW_TOKENS, use_cache=False) == want  # whole sequences, banded mask
    long_prompt = tokens(cfg.vocab_size, 1, SEQ_LEN + 3, seed=4)  # our prefill: two passes; theirs: one
    assert hf_greedy(theirs, long_prompt, NEW_TOKENS) == ours_greedy(cfg, named, long_prompt, export_window)
    assert_cached_passes(cfg, named, theirs, window)
    if cfg.residual == "msar":  # beam search reorders the windowed keys and the convolution history alike
        beams = {"num_beams": 3, "num_return_sequences": 3}
        assert hf_greedy(theirs, prompts, NEW_TOKENS, **beams) == hf_greedy(theirs, prompts, NEW_TOKENS,
                                                                            use_cache=False, **beams)
    # Without the window both attend to every earlier position: equal again, and unlike the windowed run.
    unbounded = ours_greedy(cfg, named, prompts, UNBOUNDED)
    assert unbounded != want
    theirs.config.sliding_window = None
    assert hf_greedy(theirs, prompts, NEW_TOKENS) == unbounded


BUILT_IN = {  # name: (model options, transformers class); none of them keeps a window in our export
    "llama": (dict(residual="standard", n_kv_heads=2), "LlamaForCausalLM"),
    "qwen3": (dict(residual="standard", qk_norm=True), "Qwen3ForCausalLM"),
    "mixtral": (dict(residual="standard", moe_experts=4, moe_top_k=2, moe_d_ff=16), "MixtralForCausalLM"),
}


@pytest.mark.parametrize("name", sorted(BUILT_IN))
def test_a_built_in_class_attends_to_every_position_past_seq_len(name, tmp_path):
    """What docs/export.md says of the standard-residual exports: transformers' class has no window
    here, so past seq_len its tokens are those of `generate --window` at least the whole length,
    not of generate's default window (seq_len)."""
    options, cls = BUILT_IN[name]
    cfg = ModelConfig(**BASE, **options)
    named = randomized(cfg, seed=len(name))
    write_folder(tmp_path, cfg, named, max_bytes=10**9)
    theirs = load_hf(tmp_path)
    assert type(theirs).__name__ == cls
    prompts = tokens(cfg.vocab_size, 4, 5, seed=2)  # four: some row's tokens see the window's edge
    got = hf_greedy(theirs, prompts, NEW_TOKENS)
    assert got == ours_greedy(cfg, named, prompts, UNBOUNDED)
    assert got != ours_greedy(cfg, named, prompts, None)


def test_a_static_cache_is_refused_rather_than_misread(tmp_path):
    """A static cache returns its whole fixed-size buffer, not the last positions the window mask
    assumes: one clear error instead of attention over the wrong keys."""
    from transformers import StaticCache

    cfg = ModelConfig(**BASE, residual="attnres", block_size=2)
    write_folder(tmp_path, cfg, randomized(cfg, seed=0), max_bytes=10**9)
    theirs = load_hf(tmp_path)
    with pytest.raises(ValueError, match="static caches are not supported"):
        theirs(tokens(cfg.vocab_size, 1, 5), cache=StaticCache(config=theirs.config, max_cache_len=32))
