"""The key/value cache and the MSAR source history against their slow twin: incremental decoding
(a prompt in pieces, then one token per pass) gives the logits of one whole-sequence forward, for
every variant, in float64; and the context limit is refused with the limit in the message."""

from __future__ import annotations

import pytest
import torch

from attnres_pp.model import DecodeState
from attnres_pp.model.decode_state import ContextFull
from tests.pipeline_helpers import build_model, model_config
from tests.reference_model import VARIANTS

SEQ_LEN = 16


def _sequence(cfg, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("pieces", [(SEQ_LEN,), (5, 1, 1, 3, 1, 5), (1,) * SEQ_LEN, (7, 9)])
def test_incremental_logits_equal_the_whole_forward(variant, pieces):
    cfg = model_config(variant, n_layers=3, seq_len=SEQ_LEN)
    model = build_model(cfg, torch.float64)
    idx_BT = _sequence(cfg)
    with torch.no_grad():
        want_BTV = model(idx_BT)
        state, start, got = DecodeState(cfg), 0, []
        for n in pieces:
            got.append(model(idx_BT[:, start:start + n], decode=state.step(start, n)))
            start += n
    got_BTV = torch.cat(got, dim=1)
    assert got_BTV.shape == want_BTV.shape
    torch.testing.assert_close(got_BTV, want_BTV, rtol=1e-10, atol=1e-10)
    if pieces == (SEQ_LEN,):  # one whole-prompt pass runs the training forward's very ops
        assert torch.equal(got_BTV, want_BTV)


@pytest.mark.parametrize("variant", ["block", "msar"])
def test_moe_incremental_logits_equal_the_whole_forward(variant):
    """An MoE sublayer is per token: decoding one token at a time routes each as the whole forward did."""
    cfg = model_config(variant, n_layers=3, seq_len=SEQ_LEN, moe_experts=4, moe_top_k=2, moe_shared_experts=1,
                       moe_d_ff=8, moe_dense_layers=1)
    model = build_model(cfg, torch.float64)
    idx_BT = _sequence(cfg)
    with torch.no_grad():
        want_BTV = model(idx_BT)
        state = DecodeState(cfg)
        first = model(idx_BT[:, :5], decode=state.step(0, 5))
        rest = [model(idx_BT[:, t:t + 1], decode=state.step(t, 1)) for t in range(5, SEQ_LEN)]
    torch.testing.assert_close(torch.cat([first, *rest], dim=1), want_BTV, rtol=1e-10, atol=1e-10)


def test_msar_history_covers_the_longest_kernel():
    """A kernel longer than the pieces: history must reach several passes back."""
    cfg = model_config("msar", n_layers=2, seq_len=SEQ_LEN, stream_kernels=(2, 7))
    model = build_model(cfg, torch.float64)
    idx_BT = _sequence(cfg, batch=1)
    with torch.no_grad():
        want = model(idx_BT)
        state = DecodeState(cfg)
        got = torch.cat([model(idx_BT[:, t:t + 1], decode=state.step(t, 1)) for t in range(SEQ_LEN)], dim=1)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("variant", ["standard", "msar"])
def test_keep_rows_continues_the_kept_sequences(variant):
    """Drop a sequence mid-decode: the kept ones go on to the whole forward's logits (float64)."""
    cfg = model_config(variant, n_layers=3, seq_len=SEQ_LEN)
    model = build_model(cfg, torch.float64)
    idx_BT = torch.randint(0, cfg.vocab_size, (3, SEQ_LEN), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        want_BTV = model(idx_BT)[[2, 0]]
        state = DecodeState(cfg)
        first = model(idx_BT[:, :9], decode=state.step(0, 9))[[2, 0]]
        state.keep_rows([2, 0])
        rest = [model(idx_BT[[2, 0], t:t + 1], decode=state.step(t, 1)) for t in range(9, SEQ_LEN)]
    torch.testing.assert_close(torch.cat([first, *rest], dim=1), want_BTV, rtol=1e-10, atol=1e-10)


def test_a_pass_past_seq_len_is_refused_with_the_limit():
    """Learned positions end at seq_len (rotary ones go on: tests/parity/test_generate_window.py)."""
    cfg = model_config("block", n_layers=2, seq_len=SEQ_LEN, positions="learned")
    state = DecodeState(cfg)
    state.step(SEQ_LEN - 1, 1)
    with pytest.raises(ContextFull, match=f"seq_len={SEQ_LEN}"):
        state.step(SEQ_LEN - 2, 3)
