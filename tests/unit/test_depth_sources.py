"""The completed sources of a pass (model.depth.DepthSources, model.sources.RowBuffer): every gradient
equals the float64 oracle's, MSAR's streams are computed once per source and pass (one stream
expansion per batch of sources), and reads see views of one buffer rather than stacked copies."""

from __future__ import annotations

import pytest
import torch

from attnres_pp.model import ModelConfig, Transformer
from attnres_pp.model import depth as depth_module
from attnres_pp.model.sources import RowBuffer
from attnres_pp.model.stack import DepthState, forward_sublayers
from tests.reference_model import VARIANTS, randomize_depth_params, reference_logits

TINY = dict(vocab_size=32, n_layers=3, d_model=16, n_heads=2, seq_len=12)


def _model(variant: str, **overrides) -> Transformer:
    cfg = ModelConfig(**{**TINY, **VARIANTS[variant], **overrides})
    return Transformer(cfg, backend="torch").double()


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_gradient_equals_the_float64_oracle(variant):
    model = _model(variant)
    randomize_depth_params(model, torch.Generator().manual_seed(1))
    idx = torch.randint(0, 32, (2, 12), generator=torch.Generator().manual_seed(2))
    weights = torch.randn(2, 12, 32, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    params = [p for _, p in model.named_parameters()]
    got = torch.autograd.grad((model(idx) * weights).sum(), params)
    want = torch.autograd.grad((reference_logits(model, idx) * weights).sum(), params, allow_unused=True)
    for (name, _), g, w in zip(model.named_parameters(), got, want, strict=True):
        torch.testing.assert_close(g, torch.zeros_like(g) if w is None else w, rtol=1e-9, atol=1e-11, msg=name)
    if variant == "msar":
        assert any(n.startswith("stream_convs.") and g.abs().sum() > 0 for (n, _), g in
                   zip(model.named_parameters(), got, strict=True)), "conv taps got no gradient"


def test_msar_convolves_each_source_once_per_pass(monkeypatch):
    """8 sublayers in blocks of 2: 5 sources (embedding + 4 blocks), 4 reads with an open partial.
    One stream expansion for the embedding, one per completed block, one per partial read: 9 (the
    old reader convolved every source again for every block that read it, one call per kernel:
    3 x 15 + 12), each computing every stream of its sources at once."""
    cfg = ModelConfig(**{**TINY, "n_layers": 4, "residual": "msar", "block_size": 2})
    model = Transformer(cfg, backend="torch")
    calls, stream_stack = [], depth_module.StreamConvs.stream_stack

    def counting(self, kernels, v_NBTD):
        calls.append([k.shape for k in kernels])
        streams = stream_stack(self, kernels, v_NBTD)
        assert streams.shape[:2] == (cfg.n_streams, v_NBTD.shape[0])
        return streams

    monkeypatch.setattr(depth_module.StreamConvs, "stream_stack", counting)
    model(torch.zeros(2, 12, dtype=torch.long), torch.zeros(2, 12, dtype=torch.long)).backward()
    assert len(calls) == 1 + cfg.n_blocks + cfg.n_sublayers // 2
    taps_shape = (cfg.n_streams - 1, max(cfg.stream_kernels), cfg.d_model)
    assert all(shape == taps_shape for call in calls for shape in call)


def test_a_pass_appends_sources_into_one_buffer_and_reads_views_of_it():
    cfg = ModelConfig(**{**TINY, **VARIANTS["full"]})
    model = Transformer(cfg, backend="torch")
    emb = torch.randn(2, 12, 16, requires_grad=True)
    state = forward_sublayers(cfg, dict(enumerate(model.layers)), None, DepthState(blocks=[emb]),
                              range(cfg.n_sublayers), "torch")
    sources = state.sources
    assert len(sources) == len(state.blocks) == cfg.n_blocks + 1
    rows = sources.values.rows()
    assert rows.data_ptr() == sources.values.storage.data_ptr()  # a view: no copy per read
    for j, block in enumerate(state.blocks):
        torch.testing.assert_close(rows[j], block.reshape(24, 16))
    # The head reuses the pass's sources rather than building them again.
    assert model.head.read is not None and state.sources is sources


def test_row_buffer_routes_each_rows_gradient_to_its_segment():
    a = torch.randn(1, 3, requires_grad=True)
    b = torch.randn(2, 3, requires_grad=True)
    buffer = RowBuffer((4, 3), torch.float32, torch.device("cpu"))
    buffer.append(a)
    first = buffer.rows()  # saved by the product below before the next append writes row 1..2
    loss_a = (first * 2).sum()
    buffer.append(b * 1.0)
    second = buffer.rows()
    assert second.shape == (3, 3)
    (loss_a + (second * torch.arange(3.0).unsqueeze(-1)).sum()).backward()
    torch.testing.assert_close(a.grad, torch.full((1, 3), 2.0))
    torch.testing.assert_close(b.grad, torch.tensor([[1.0] * 3, [2.0] * 3]))
    with pytest.raises(RuntimeError, match="source buffer full"):
        buffer.append(torch.zeros(2, 3))


def test_a_reader_of_given_sources_may_hold_more_than_the_model_has():
    """The unit probe times reads of up to max(PHASE1_SOURCES) sources on a model with fewer blocks:
    a BlockReader over a list sizes its buffer to the list (it raised "source buffer full")."""
    from attnres_lab.unit_probe import PHASE1_SOURCES, probe_units

    cfg = ModelConfig(vocab_size=64, n_layers=2, d_model=16, n_heads=2, seq_len=8, residual="attnres", block_size=2)
    assert max(PHASE1_SOURCES) > cfg.n_blocks + 1
    units = probe_units(cfg, 1, rounds=1, warmup=0)
    assert {row["sources"] for row in units["phase1"]} == set(PHASE1_SOURCES)
    assert all(row["fwd_s"] > 0 and row["bwd_s"] > 0 for row in units["phase1"])
