"""Routing weights from the two-phase code (model.routing): per token they sum to 1, equal one direct
softmax over every source in float64, and reproduce the input the forward computed; the probe leaves
the forward's values and gradients unchanged."""

from __future__ import annotations

import math

import pytest
import torch

from attnres_pp.model import Transformer
from attnres_pp.model.routing import RoutingProbe, attach_probe, read_weights
from tests.pipeline_helpers import batch, build_model, model_config


def _rms(x, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class CheckingProbe(RoutingProbe):
    """Checks every read against a direct float64 softmax before summing it."""

    checked = 0

    def record(self, site, read, reader, i, blocks, partial_BTW, partial_index, h_BTD, out_BTW):
        if reader is not None:
            self._check(read, reader, i, blocks, partial_BTW, partial_index, h_BTD)
        super().record(site, read, reader, i, blocks, partial_BTW, partial_index, h_BTD, out_BTW)

    def _check(self, read, reader, i, blocks, partial_BTW, partial_index, h_BTD):
        cfg = self.cfg
        d = cfg.d_model
        weights, _views = read_weights(cfg, read, reader, i, blocks, partial_BTW, partial_index)
        sources = blocks + ([partial_BTW] if partial_BTW is not None else [])
        conv_ids = list(range(len(blocks))) + ([partial_index] if partial_BTW is not None else [])
        z_by_stream = []
        for s, w_TN in enumerate(weights):
            torch.testing.assert_close(w_TN.sum(-1), torch.ones_like(w_TN[:, 0]), rtol=0, atol=1e-12)
            if cfg.residual == "msar":
                values = [reader.stream_convs.streams(j, v)[s].reshape(-1, d) for j, v in zip(conv_ids, sources,
                                                                                               strict=True)]
                keys, query = values, read.scoring_query()[s]
            else:
                flat = [v.reshape(-1, v.shape[-1]) for v in sources]
                values = [v[:, :d] for v in flat]
                if cfg.residual == "lr_attnres":
                    keys = [v[:, d:] if cfg.key_mode == "projected" else v[:, d - cfg.key_rank:d] for v in flat]
                else:
                    keys = values
                query = read.scoring_query() * cfg.logit_scale
            scores_TN = torch.stack([_rms(k.double(), cfg.norm_eps) @ query.double() for k in keys], -1)
            torch.testing.assert_close(w_TN, torch.softmax(scores_TN, -1), rtol=0, atol=1e-12)
            z_by_stream.append(sum(w_TN[:, n:n + 1] * values[n].double() for n in range(len(values))))
        if cfg.residual != "msar":
            torch.testing.assert_close(z_by_stream[0], h_BTD.reshape(-1, d).double(), rtol=0, atol=1e-12)
        self.checked += 1


@pytest.mark.parametrize("variant", ["full", "block", "lr_projected", "lr_sliced", "msar"])
@pytest.mark.parametrize("extra", [{}, {"blocks": 3}, {"key_norm_gain": True}], ids=["size", "blocks", "gain"])
def test_weights_sum_to_one_and_equal_a_direct_softmax_float64(variant, extra):
    cfg = model_config(variant, 3, **({} if variant == "full" and "blocks" in extra else extra))
    model = build_model(cfg, torch.float64)
    if cfg.key_norm_gain:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("key_gain"):
                    p.uniform_(0.5, 2.0)
    inputs, targets = batch(1)
    plain_loss = model(inputs, targets)
    plain_loss.backward()
    plain_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    probe = CheckingProbe(cfg)
    with attach_probe(model, probe):
        loss = model(inputs, targets)
        loss.backward()
    assert probe.checked == cfg.n_sublayers + 1  # every sublayer's read and the final read
    assert torch.equal(loss, plain_loss)
    assert all(torch.equal(p.grad, plain_grads[n]) for n, p in model.named_parameters())
    rows = probe.summary()
    assert [r["site"] for r in rows] == list(range(cfg.n_sublayers + 1))
    for row in rows:
        per_stream = row["weights"] if cfg.residual == "msar" else [row["weights"]]
        for weights in per_stream:
            assert len(weights) == len(row["sources"]) and abs(sum(weights) - 1) < 1e-12
        assert -1e-12 <= row["entropy"] <= math.log(len(row["sources"])) + 1e-12
        assert 1 - 1e-12 <= row["effective_sources"] <= len(row["sources"]) + 1e-12
        assert row["embedding_weight"] == pytest.approx(sum(w[0] for w in per_stream) / len(per_stream))
        if cfg.residual == "msar":
            assert len(row["gate_means"]) == cfg.n_streams and all(0 < g < 1 for g in row["gate_means"])
    assert not any(hasattr(m, "routing_probe") for m in model.modules())


def test_zero_queries_read_a_plain_mean():
    """At initialisation every read is a plain mean: weight 1/n on each of n sources, entropy log n."""
    cfg = model_config("block", 3)
    model = Transformer(cfg, backend="torch").double()
    probe = RoutingProbe(cfg)
    with attach_probe(model, probe), torch.no_grad():
        model(batch(1)[0])
    for row in probe.summary():
        n = len(row["sources"])
        assert row["weights"] == pytest.approx([1 / n] * n, abs=1e-12)
        assert row["entropy"] == pytest.approx(math.log(n), abs=1e-12)
