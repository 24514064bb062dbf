"""Decoding past the trained length (docs/spec.md section 11): rotary positions continue and each
layer's key/value cache slides over the last `window` positions.

The oracle is a float64 training-style forward over the whole long sequence in which every
attention is an explicit softmax under a banded causal mask of width `window` (written here from
the definition, not with the model's attention), with the naive depth evaluation of
`tests.reference_model`: a windowed cache, token by token, must give exactly that (the keys of an
older token were computed once, from its own window, which is what the band gives them too). Then
the generators: single process, pipelined, batched and tensor-parallel agree token for token; the
cache's bytes do not grow with the generated length; a learned-position model keeps its limit.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

from attnres_pp.generate.config import GenerationConfig
from attnres_pp.generate.engines import SingleProcessGenerator, make_generator
from attnres_pp.generate.loop import generate, generate_batch
from attnres_pp.model import DecodeState
from attnres_pp.model.decode_state import ContextFull
from attnres_pp.model.layers import Attention
from attnres_pp.pipeline.config import PipelineConfig
from tests.pipeline_helpers import build_model, model_config
from tests.reference_model import VARIANTS, reference_logits

SEQ_LEN = 8  # the trained length; the sequences below run to several times it
LONG = 29


def _rope(x_BHTE: torch.Tensor, theta: float) -> torch.Tensor:
    """Half-split rotary positions 0 .. T - 1, from the formula: x cos + rotate_half(x) sin."""
    head_dim, seq = x_BHTE.shape[-1], x_BHTE.shape[-2]
    inv_freq = torch.tensor([theta ** (-2 * i / head_dim) for i in range(head_dim // 2)], dtype=torch.float64)
    angles = torch.arange(seq, dtype=torch.float64)[:, None] * inv_freq[None, :]
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    half = head_dim // 2
    return x_BHTE * cos + torch.cat([-x_BHTE[..., half:], x_BHTE[..., :half]], -1) * sin


def banded_attention(attn: Attention, h_BTD: torch.Tensor, window: int) -> torch.Tensor:
    """Attention's output over a whole sequence, each query reading the keys of the last `window`
    positions (itself included): projections by their documented row layout, an explicit softmax."""
    cfg, (batch, seq, _d) = attn.cfg, h_BTD.shape
    heads, groups, head_dim = cfg.n_heads, cfg.kv_heads, cfg.head_dim
    x_BTD = attn.norm(h_BTD)
    per_group = heads // groups  # query head h reads kv head h // per_group
    # the fused rows: blocks Q_0 .. Q_{per_group - 1}, K, V of `groups` heads; Q_j holds head g per_group + j
    blocks = (x_BTD @ attn.qkv.weight.T).view(batch, seq, per_group + 2, groups, head_dim)
    q_BHTE = torch.stack([blocks[:, :, h % per_group, h // per_group] for h in range(heads)], 1)
    k_BGTE, v_BGTE = blocks[:, :, per_group].transpose(1, 2), blocks[:, :, per_group + 1].transpose(1, 2)
    if cfg.qk_norm:
        q_BHTE, k_BGTE = attn.q_norm(q_BHTE), attn.k_norm(k_BGTE)
    if cfg.positions == "rope":  # learned positions entered with the embedding
        q_BHTE, k_BGTE = _rope(q_BHTE, cfg.rope_theta), _rope(k_BGTE, cfg.rope_theta)
    k_BHTE, v_BHTE = k_BGTE.repeat_interleave(per_group, 1), v_BGTE.repeat_interleave(per_group, 1)
    scores = q_BHTE @ k_BHTE.transpose(-1, -2) / math.sqrt(head_dim)
    query, key = torch.arange(seq)[:, None], torch.arange(seq)[None, :]
    scores = scores.masked_fill(~((key <= query) & (key > query - window)), float("-inf"))
    y_BHTE = torch.softmax(scores, -1) @ v_BHTE
    return attn.proj(y_BHTE.transpose(1, 2).reshape(batch, seq, heads * head_dim))


def banded_reference(model, idx_BT: torch.Tensor, window: int, monkeypatch) -> torch.Tensor:
    """Float64 logits of a whole-sequence forward whose every attention is `banded_attention`."""
    with monkeypatch.context() as patch:
        patch.setattr(Attention, "forward", lambda self, h_BTD, kv=None: banded_attention(self, h_BTD, window))
        return reference_logits(model, idx_BT)


def _cfg(variant: str, **overrides):
    return model_config(variant, n_layers=3, seq_len=SEQ_LEN, **overrides)


def _long(cfg, batch: int = 2, length: int = LONG, seed: int = 5) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))


def _decode(model, idx_BT: torch.Tensor, pieces, window: int | None) -> torch.Tensor:
    state, start, got = DecodeState(model.cfg, window=window), 0, []
    for n in pieces:
        got.append(model(idx_BT[:, start:start + n], decode=state.step(start, n)))
        start += n
    assert start == idx_BT.shape[1]
    return torch.cat(got, dim=1)


@pytest.mark.parametrize("window", [SEQ_LEN, 5])
def test_the_banded_reference_is_the_model_inside_its_window_and_differs_past_it(window, monkeypatch):
    """The oracle's own check: with the band wider than the sequence it is the model's plain
    forward; with the band narrower it is not (so the band is what the comparisons below test)."""
    cfg = _cfg("block", n_kv_heads=1, qk_norm=True)
    model = build_model(cfg, torch.float64)
    with torch.no_grad():
        short_BT = _long(cfg, length=window)
        torch.testing.assert_close(banded_reference(model, short_BT, window, monkeypatch), model(short_BT),
                                   rtol=1e-10, atol=1e-10)
        long_BT = _long(cfg)  # longer than the model's forward takes: the naive reference's own causal one
        whole = banded_reference(model, long_BT, LONG, monkeypatch)
        torch.testing.assert_close(whole, reference_logits(model, long_BT), rtol=1e-10, atol=1e-10)
        banded = banded_reference(model, long_BT, window, monkeypatch)
    assert (banded[:, window:] - whole[:, window:]).abs().max() > 1e-3
    torch.testing.assert_close(banded[:, :window], whole[:, :window], rtol=1e-10, atol=1e-10)


RECIPES = {"mha": {}, "grouped_qknorm": dict(n_kv_heads=1, qk_norm=True, n_heads=2)}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("recipe", sorted(RECIPES))
# A pass holds at most SEQ_LEN tokens (`loop.prefill_pieces`); the window may be shorter or longer.
@pytest.mark.parametrize(("window", "pieces"), [
    (None, (8, 8, 8, 5)),  # a prefill three times the window, in passes of the whole window
    (None, (1,) * LONG),  # every token its own pass, the ring wrapping three times
    (5, (6, 1, 1, 8, 1, 8, 4)),  # pieces longer than the window, and single tokens across its edge
    (3, (2, 5, 1, 1, 1, 8, 8, 3)),
    (12, (8, 1, 1, 8, 1, 1, 1, 8)),  # a window past the trained length
])
def test_a_windowed_cache_equals_the_banded_forward(variant, recipe, window, pieces, monkeypatch):
    cfg = _cfg(variant, **RECIPES[recipe])
    model = build_model(cfg, torch.float64)
    idx_BT = _long(cfg)
    with torch.no_grad():
        want_BTV = banded_reference(model, idx_BT, window or SEQ_LEN, monkeypatch)
        got_BTV = _decode(model, idx_BT, pieces, window)
    torch.testing.assert_close(got_BTV, want_BTV, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("window", [2, 4, 6])
def test_msar_taps_read_across_the_window_edge(window, monkeypatch):
    """Kernels longer than the window and than the pieces: a source's history (kappa - 1 = 6
    positions) is not the attention window, and reaches several passes back."""
    cfg = _cfg("msar", stream_kernels=(2, 7))
    model = build_model(cfg, torch.float64)
    idx_BT = _long(cfg, batch=1)
    with torch.no_grad():
        want = banded_reference(model, idx_BT, window, monkeypatch)
        for pieces in [(1,) * LONG, (3, 2, 1, 4, 1, 1, 8, 8, 1)]:
            torch.testing.assert_close(_decode(model, idx_BT, pieces, window), want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("variant", ["standard", "msar"])
def test_the_cache_does_not_grow_with_the_generated_length(variant):
    """After 50 and after 100 new positions (the window's ring wrapped 7 and 15 times) the state holds
    the same bytes: per layer a ring of
    `window` keys and values, and under MSAR a ring per source of a pass's seq_len positions and the
    kappa - 1 before them."""
    cfg = _cfg(variant, n_kv_heads=1, n_heads=2)
    model = build_model(cfg)
    window, batch = 6, 2
    state = DecodeState(cfg, window=window)
    tokens = _long(cfg, batch=batch, length=100, seed=9)
    held = {}
    with torch.no_grad():
        model(tokens[:, :SEQ_LEN], decode=state.step(0, SEQ_LEN))
        for t in range(SEQ_LEN, 100):
            model(tokens[:, t:t + 1], decode=state.step(t, 1))
            if t + 1 in (50, 100):
                held[t + 1] = state.nbytes
    ring_bytes = cfg.n_layers * 2 * batch * cfg.kv_heads * window * cfg.head_dim * 4
    history_bytes = sum(t.numel() * 4 for t, _held in state._sources.values())
    assert held[50] == held[100] == ring_bytes + history_bytes
    assert all(t.shape[1] == SEQ_LEN + state.history_len for t, _held in state._sources.values())
    assert (history_bytes > 0) == (variant == "msar")


@pytest.mark.parametrize("variant", ["standard", "msar"])
def test_a_learned_position_model_slides_within_its_context(variant, monkeypatch):
    cfg = _cfg(variant, positions="learned")
    model = build_model(cfg, torch.float64)
    idx_BT = _long(cfg, length=SEQ_LEN)
    with torch.no_grad():
        want = banded_reference(model, idx_BT, 3, monkeypatch)
        torch.testing.assert_close(_decode(model, idx_BT, (5, 1, 2), 3), want, rtol=1e-10, atol=1e-10)


def test_a_learned_position_model_keeps_its_context_limit():
    cfg = _cfg("block", positions="learned")
    state = DecodeState(cfg, window=3)
    state.step(SEQ_LEN - 1, 1)
    with pytest.raises(ContextFull, match=f"seq_len={SEQ_LEN}"):
        state.step(SEQ_LEN - 2, 3)
    generator = SingleProcessGenerator(cfg, None)
    with pytest.raises(ValueError, match=f"seq_len={SEQ_LEN} \\(no sliding window\\)"):
        generate(generator, [1, 2, 3], GenerationConfig(max_new_tokens=SEQ_LEN - 1, temperature=0))
    assert len(generate(generator, [1, 2, 3], GenerationConfig(max_new_tokens=SEQ_LEN - 2, temperature=0)).tokens) \
        == SEQ_LEN - 2


def test_a_source_read_further_back_than_a_pass_is_an_error_not_a_zero():
    """The history ring holds one pass of seq_len positions and kappa - 1 before it; a read beyond
    that (passes of a rank out of position order) fails rather than reading another position."""
    cfg = _cfg("msar", stream_kernels=(2, 3))
    state, v_BTD = DecodeState(cfg), torch.ones(1, SEQ_LEN, 4)
    for start in (0, SEQ_LEN, 2 * SEQ_LEN):
        got, n_prefix = state.step(start, SEQ_LEN).with_history(("block", 0), v_BTD * start)
        assert n_prefix == min(start, 2) and torch.equal(got[:, :n_prefix], (v_BTD * (start - SEQ_LEN))[:, :n_prefix])
    # the ring holds positions 2 * SEQ_LEN - 2 .. 3 * SEQ_LEN - 1: the last pass and two before it
    got, _ = state.step(2 * SEQ_LEN, 1).with_history(("block", 0), v_BTD[:, :1])  # a later chunk's first piece
    assert torch.equal(got[:, :2], (v_BTD * SEQ_LEN)[:, :2])
    with pytest.raises(RuntimeError, match="no longer held"):
        state.step(2 * SEQ_LEN - 1, 1).with_history(("block", 0), v_BTD[:, :1])


@pytest.mark.parametrize("window", [0, -1, 2.5, True])
def test_a_window_below_one_is_refused(window):
    with pytest.raises(ValueError, match="window"):
        GenerationConfig(window=window)
    with pytest.raises(ValueError, match="window must be an integer >= 1"):
        DecodeState(_cfg("standard"), window=window)


PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [7], [2, 7, 1, 8]]  # the first longer than the window
# Twice the trained length: each prompt's last position is past 2 x seq_len, window 5's ring wraps 3+ times.
GREEDY = GenerationConfig(max_new_tokens=2 * SEQ_LEN, prefill_chunk=3, temperature=0)


def _setup_named(cfg) -> dict:
    return {name: p.detach().clone() for name, p in build_model(cfg).named_parameters()}


def _setup(variant: str, **overrides):
    cfg = model_config(variant, n_layers=4, seq_len=SEQ_LEN, **overrides)
    return cfg, _setup_named(cfg)


@functools.lru_cache(maxsize=8)
def _single_tokens(cfg, window: int | None) -> list[list[int]]:
    """The single process's greedy tokens for PROMPTS (one at a time, then as a ragged batch, which
    must agree), once per model and window: several generators below compare against them."""
    single = SingleProcessGenerator(cfg, _setup_named(cfg), window=window)
    want = [generate(single, ids, GREEDY).tokens for ids in PROMPTS]
    assert all(len(t) == GREEDY.max_new_tokens for t in want) and len({tuple(t) for t in want}) == len(PROMPTS)
    assert [r.tokens for r in generate_batch(single, PROMPTS, GREEDY)] == want
    return want


def _assert_same_tokens(cfg, named, pipe: PipelineConfig, window: int | None) -> None:
    """One sequence and a ragged batch, past the trained length, as the single process gives them."""
    want = _single_tokens(cfg, window)
    generator = make_generator(cfg, pipe, named, window=window)
    try:
        assert generate(generator, PROMPTS[0], GREEDY).tokens == want[0]
        assert [r.tokens for r in generate_batch(generator, PROMPTS, GREEDY)] == want
    finally:
        generator.close()


# Every variant's decode state under the window; the default window (the trained length) on MSAR,
# whose history rings are the only state beside the key/value rings that the window sizes.
@pytest.mark.parametrize(("window", "variant"), [(5, "standard"), (5, "lr_projected"), (5, "msar"), (None, "msar")])
def test_pipelined_greedy_tokens_past_the_trained_length(variant, window):
    cfg, named = _setup(variant)
    _assert_same_tokens(cfg, named, PipelineConfig(stages=2, virtual=2, launcher="inprocess", timeout_s=60.0), window)


def test_greedy_tokens_past_the_trained_length_under_nccl_rules():
    """The in-process pipeline under the loopback that enforces NCCL's point-to-point rules."""
    cfg, named = _setup("msar")
    _assert_same_tokens(cfg, named, PipelineConfig(stages=2, virtual=2, launcher="inprocess", p2p_semantics="nccl",
                                                   timeout_s=60.0), 5)


# MSAR: the key/value rings split over the tp ranks' heads, and the history rings beside them (Block
# AttnRes at T = 2 without a window: tests/parity/test_generate_tensor_parallel.py). The window on
# rank processes over gloo, P = 2 and P = 2 x T = 2 past 2 x seq_len: `generate --launcher local` in
# tests/unit/test_cli_generate.py::test_generate_over_local_rank_processes.
@pytest.mark.parametrize("variant", ["msar"])
def test_tensor_parallel_greedy_tokens_past_the_trained_length(variant):
    cfg, named = _setup(variant, n_heads=2)
    _assert_same_tokens(cfg, named, PipelineConfig(stages=2, tensor_parallel=2, launcher="inprocess",
                                                   timeout_s=60.0), 5)


def test_the_window_changes_the_tokens_past_it():
    """A different window is a different model past it: the flag reaches the caches."""
    cfg, named = _setup("msar")
    tokens = {window: generate(SingleProcessGenerator(cfg, named, window=window), PROMPTS[0], GREEDY).tokens
              for window in (3, SEQ_LEN)}
    assert tokens[3] != tokens[SEQ_LEN]
