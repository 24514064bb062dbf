"""A deliberately naive float64 evaluation of docs/spec.md section 1, written from the spec's formulas
(one explicit softmax over all sources per read, no two-phase split), used as the oracle for the
model's own forward."""

from __future__ import annotations

import torch


def _rms(x, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _conv(v_BTD, taps_KD):
    out = torch.zeros_like(v_BTD)
    for delta in range(taps_KD.shape[0]):
        shifted = torch.zeros_like(v_BTD)
        shifted[:, delta:] = v_BTD[:, : v_BTD.shape[1] - delta]
        out = out + taps_KD[delta] * shifted
    return out


def _emit(cfg, out, normalize_keys):
    """docs/spec.md section 1.3: a projected key is RMS-normalised (no gain) when emitted, before any block sum."""
    if not (normalize_keys and cfg.residual == "lr_attnres" and cfg.key_mode == "projected"):
        return out
    d = cfg.d_model
    return torch.cat([out[..., :d], _rms(out[..., d:], cfg.norm_eps)], -1)


def _read(cfg, read, sources, source_ids, convs):
    """sources: list of packed [B, T, W]; source_ids: conv index of each source (msar)."""
    d = cfg.d_model
    if cfg.residual == "msar":
        zs = []
        for s in range(cfg.n_streams):
            views = []
            for src, j in zip(sources, source_ids, strict=True):
                v = src[..., :d]
                views.append(v if s == 0 else _conv(v, convs.weights[j][s - 1].double()))
            scores = torch.stack([_rms(v, cfg.norm_eps) @ read.query[s].double() for v in views], -1)
            a = torch.softmax(scores, -1)
            zs.append(sum(a[..., i : i + 1] * views[i] for i in range(len(views))))
        flat = _rms(torch.cat(zs, -1), cfg.norm_eps)
        g = torch.sigmoid(read.gate_alpha.double() * flat @ read.gate_weight.double() + read.gate_bias.double())
        return sum(g[..., s : s + 1] * zs[s] for s in range(cfg.n_streams))
    values = [src[..., :d] for src in sources]
    if cfg.residual == "lr_attnres" and cfg.key_mode == "projected":
        keys = [src[..., d:] for src in sources]
    elif cfg.residual == "lr_attnres":
        keys = [v[..., d - cfg.key_rank :] for v in values]
    else:
        keys = values
    q = read.query.double() * cfg.logit_scale
    scores = torch.stack([_rms(k, cfg.norm_eps) @ q for k in keys], -1)
    a = torch.softmax(scores, -1)
    return sum(a[..., i : i + 1] * values[i] for i in range(len(values)))


def reference_logits(model, idx_BT, *, normalize_emitted_keys=True):
    """Float64 logits of `model` (a Transformer, converted to float64 by the caller).

    `normalize_emitted_keys=False` sums raw projected keys and normalises only at the read: the
    rule that docs/spec.md section 1.3 says the emitted-key rule reduces to when block_size = 1.
    """
    cfg = model.cfg
    o_emb = model.embed(idx_BT)
    if cfg.residual == "standard":
        h = o_emb
        for l in range(cfg.n_sublayers):
            h = h + model.layers[l // 2].sublayer(l % 2)(h)
        return model.head.lm_head(model.head.norm(h))
    blocks, partial = [_emit(cfg, o_emb, normalize_emitted_keys)], None
    for l in range(cfg.n_sublayers):
        sub = model.layers[l // 2].sublayer(l % 2)
        sources = blocks + ([partial] if partial is not None else [])
        ids = list(range(len(blocks))) + ([len(blocks)] if partial is not None else [])
        out = _emit(cfg, sub(_read(cfg, sub.read, sources, ids, model.stream_convs)), normalize_emitted_keys)
        partial = out if partial is None else partial + out
        if (l + 1) % cfg.block_size == 0 or l == cfg.n_sublayers - 1:
            blocks.append(partial)
            partial = None
    h = _read(cfg, model.head.read, blocks, list(range(len(blocks))), model.stream_convs)
    return model.head.lm_head(model.head.norm(h))


def randomize_depth_params(model, generator):
    """Give pseudo-queries and gates non-zero values so that reads are not plain means."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("read.query", "gate_weight", "gate_bias")):
                p.copy_(torch.randn(p.shape, generator=generator, dtype=p.dtype) * 0.5)


VARIANTS = {
    "standard": dict(residual="standard"),
    "full": dict(residual="attnres", block_size=1),
    "block": dict(residual="attnres", block_size=3),
    "lr_projected": dict(residual="lr_attnres", key_mode="projected", key_rank=4, block_size=2),
    "lr_sliced": dict(residual="lr_attnres", key_mode="sliced", key_rank=4, block_size=3),
    "msar": dict(residual="msar", block_size=3, stream_kernels=(2, 3)),
}
