"""Depth-routing statistics of the reads a forward pass makes, taken from the two-phase evaluation
itself (docs/spec.md section 2): phase 1's log-sum-exp `lse1` and phase 2's merge gate `sigmoid(s_p - lse1)`
give each source's exact weight, `a_i = exp(s_i - lse1) (1 - g)` for a completed source and `g` for
the open partial, so the statistics describe the softmax the model ran, not a re-derivation of it.

A `RoutingProbe` is attached to the `DepthRead` modules it observes (`attach_probe`); the shared
forward (`model.stack.forward_sublayers`, the head's final read) calls `record_read` after each read.
It computes under `torch.no_grad()` on detached tensors and never changes the forward's values,
gradients or random state. It keeps running sums per site (a few numbers per source), so a pipeline
rank reports scalars only for the sites it owns.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch import nn

from attnres_pp.kernels import rms_normalize
from attnres_pp.model.config import ModelConfig
from attnres_pp.model.depth import BlockReader, DepthRead, split_keys

PROBE_ATTRIBUTE = "routing_probe"


@dataclass
class SiteSums:
    """Running sums of one reading site over the tokens it has seen (float64, on the CPU)."""

    n_tokens: int = 0
    weight_sum_MN: torch.Tensor | None = None  # [streams, sources]
    entropy_sum_M: torch.Tensor | None = None
    effective_sum_M: torch.Tensor | None = None
    top1_sum_M: torch.Tensor | None = None
    gate_sum_M: torch.Tensor | None = None  # MSAR only
    input_rms_sum: float = 0.0
    output_rms_sum: float = 0.0
    has_output: bool = False
    source_names: list[str] = field(default_factory=list)


def _add(total: torch.Tensor | None, value: torch.Tensor) -> torch.Tensor:
    value = value.detach().to("cpu", torch.float64)
    return value if total is None else total + value


def _rms_sum(x_BTD: torch.Tensor) -> float:
    x = x_BTD.detach().double()
    return float(x.pow(2).mean(-1).sqrt().sum())


def read_weights(cfg: ModelConfig, read: DepthRead, reader: BlockReader, i: int, blocks: list[torch.Tensor],
                 partial_BTW: torch.Tensor | None, partial_index: int) -> tuple[list[torch.Tensor], list]:
    """Per stream, the weight of every source for each token, `[BT, sources]` (sources b_0 .. b_n, then
    the partial if open), from `reader`'s phase-1 lse and phase 2's merge; and per stream the read's
    (source views) `[sources, BT, d]` so a caller can form the streams' outputs."""
    weights, views = [], []
    msar = cfg.residual == "msar"
    convs = reader.sources.stream_convs
    _out_all, lse_all = reader.phase1_by_stream[0]  # lse [S, T], or per stream [m, S, T] under MSAR
    for s in range(cfg.n_streams if msar else 1):
        lse1_T = (lse_all[s, i] if msar else lse_all[i]).double()
        if msar:
            query_K = read.scoring_query()[s].double()
            values = [convs.streams(j, b)[s].reshape(-1, cfg.d_model) for j, b in enumerate(blocks)]
            keys = values
            if partial_BTW is not None:
                p = convs.streams(partial_index, partial_BTW)[s].reshape(-1, cfg.d_model)
                values, keys = values + [p], keys + [p]
        else:
            query_K = read.scoring_query().double() * cfg.logit_scale
            sources = blocks + ([partial_BTW] if partial_BTW is not None else [])
            split = [split_keys(cfg, b.reshape(-1, b.shape[-1])) for b in sources]
            values = [v for v, _k in split]
            keys = [v if k is None else k for v, k in split]
        scores_NT = torch.stack([rms_normalize(k.double(), cfg.norm_eps) @ query_K for k in keys])
        n_done = len(blocks)
        w_NT = torch.exp(scores_NT[:n_done] - lse1_T)  # phase 1: softmax over the completed sources
        if partial_BTW is not None:
            gate_T = torch.sigmoid(scores_NT[n_done] - lse1_T)  # phase 2's merge coefficient
            w_NT = torch.cat([w_NT * (1 - gate_T), gate_T.unsqueeze(0)])
        weights.append(w_NT.t())
        views.append(torch.stack([v.double() for v in values]))
    return weights, views


class RoutingProbe:
    """Sums of routing statistics per reading site (global sublayer index; the final read is L)."""

    def __init__(self, cfg: ModelConfig) -> None:
        self.cfg = cfg
        self.sites: dict[int, SiteSums] = {}

    @torch.no_grad()
    def record(self, site: int, read: DepthRead, reader: BlockReader | None, i: int, blocks: list[torch.Tensor],
               partial_BTW: torch.Tensor | None, partial_index: int, h_BTD: torch.Tensor,
               out_BTW: torch.Tensor | None) -> None:
        cfg = self.cfg
        sums = self.sites.setdefault(site, SiteSums())
        n_tokens = h_BTD.shape[0] * h_BTD.shape[1]
        sums.n_tokens += n_tokens
        sums.input_rms_sum += _rms_sum(h_BTD)
        if out_BTW is not None:
            sums.has_output = True
            sums.output_rms_sum += _rms_sum(out_BTW[..., :cfg.d_model])
        if reader is None:  # the standard residual: no routing, only the magnitudes
            return
        weights, views = read_weights(cfg, read, reader, i, blocks, partial_BTW, partial_index)
        w_TMN = torch.stack(weights, dim=1)
        entropy_TM = -(w_TMN * torch.log(w_TMN.clamp_min(1e-300))).sum(-1)
        sums.weight_sum_MN = _add(sums.weight_sum_MN, w_TMN.sum(0))
        sums.entropy_sum_M = _add(sums.entropy_sum_M, entropy_TM.sum(0))
        sums.effective_sum_M = _add(sums.effective_sum_M, entropy_TM.exp().sum(0))
        sums.top1_sum_M = _add(sums.top1_sum_M, w_TMN.max(-1).values.sum(0))
        sums.source_names = [f"b{j}" for j in range(len(blocks))] + ([f"p{partial_index}"] if partial_BTW is not None
                                                                   else [])
        if cfg.residual == "msar":
            z_TMD = torch.stack([torch.einsum("tn,ntd->td", w, v) for w, v in zip(weights, views, strict=True)], 1)
            flat_TF = rms_normalize(z_TMD.flatten(1), cfg.norm_eps)
            gate_TM = torch.sigmoid(read.gate_alpha.double() * flat_TF @ read.gate_weight.double()
                                    + read.gate_bias.double())
            sums.gate_sum_M = _add(sums.gate_sum_M, gate_TM.sum(0))

    def summary(self) -> list[dict]:
        """One dict per site in site order: mean weights per source (per stream for MSAR), entropy,
        effective number of sources exp(H), top-1 mass, embedding weight, input and output RMS."""
        out = []
        L = self.cfg.n_sublayers
        for site in sorted(self.sites):
            sums = self.sites[site]
            n = sums.n_tokens
            row = {"site": site, "kind": "final" if site == L else ("attn" if site % 2 == 0 else "mlp"),
                   "layer": None if site == L else site // 2, "input_rms": sums.input_rms_sum / n,
                   "output_rms": sums.output_rms_sum / n if sums.has_output else None}
            if sums.weight_sum_MN is not None:
                weights = (sums.weight_sum_MN / n).tolist()
                per_stream = self.cfg.residual == "msar"
                row.update({
                    "sources": sums.source_names,
                    "weights": weights if per_stream else weights[0],
                    "entropy": float(sums.entropy_sum_M.mean() / n),
                    "effective_sources": float(sums.effective_sum_M.mean() / n),
                    "top1_mass": float(sums.top1_sum_M.mean() / n),
                    "embedding_weight": float(sums.weight_sum_MN[:, 0].mean() / n),
                })
                if per_stream:
                    row["entropy_per_stream"] = (sums.entropy_sum_M / n).tolist()
                    row["gate_means"] = (sums.gate_sum_M / n).tolist()
            out.append(row)
        return out

    def token_sums(self) -> dict[int, tuple[float, float, int]]:
        """Per routed site (entropy summed over tokens, embedding weight summed over tokens, tokens), each
        averaged over the streams: scalars a pipeline rank sends for the sites it owns (`routing_metrics`)."""
        return {site: (float(sums.entropy_sum_M.mean()), float(sums.weight_sum_MN[:, 0].mean()), sums.n_tokens)
                for site, sums in sorted(self.sites.items()) if sums.weight_sum_MN is not None}


def routing_metrics(token_sums: list[dict[int, tuple[float, float, int]]]) -> dict[str, list[float]]:
    """The metrics.jsonl keys of a step that logs routing, from every rank's `token_sums` (replicas of a
    site are summed, so the means are over the whole batch as in one process): per routed site in site
    order, "routing_entropy" (mean over tokens, nats) and "routing_embedding_weight" (mean weight on b_0)."""
    merged: dict[int, list[float]] = {}
    for sums in token_sums:
        for site, values in sums.items():
            total = merged.setdefault(int(site), [0.0, 0.0, 0])
            for k in range(3):
                total[k] += values[k]
    sites = sorted(merged)
    return {"routing_entropy": [merged[s][0] / merged[s][2] for s in sites],
            "routing_embedding_weight": [merged[s][1] / merged[s][2] for s in sites]}


def record_read(read: DepthRead, site: int, reader: BlockReader | None, i: int, blocks: list[torch.Tensor],
                partial_BTW: torch.Tensor | None, partial_index: int, h_BTD: torch.Tensor,
                out_BTW: torch.Tensor | None = None) -> None:
    """Hand a read to the probe attached to `read`, if any (the forward calls this after every read)."""
    probe = getattr(read, PROBE_ATTRIBUTE, None)
    if probe is not None:
        probe.record(site, read, reader, i, blocks, partial_BTW, partial_index, h_BTD, out_BTW)


def set_probe(module: nn.Module, probe: RoutingProbe | None) -> None:
    """Attach `probe` to every DepthRead under `module` (materialised or not), or detach with None."""
    for read in module.modules():
        if isinstance(read, DepthRead):
            if probe is not None:
                setattr(read, PROBE_ATTRIBUTE, probe)
            elif hasattr(read, PROBE_ATTRIBUTE):
                delattr(read, PROBE_ATTRIBUTE)


@contextlib.contextmanager
def attach_probe(module: nn.Module, probe: RoutingProbe):
    """`probe` attached to every DepthRead under `module` for the `with` block."""
    set_probe(module, probe)
    try:
        yield probe
    finally:
        set_probe(module, None)

