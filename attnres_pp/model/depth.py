"""Depth attention: the per-site pseudo-query parameters and the two-phase block read
(SPEC sections 1.1-1.4 and 2) for every AttnRes variant.

Sources are stored packed as `[B, T, W]` with `W = d` (or `d + r` under projected keys: value
columns first, key columns last, the keys being sums of keys normalised when emitted, see
`emit_source`). `BlockReader` runs phase 1 once for a run of sublayers of one block (the queries of
that block that sit together, e.g. in one pipeline chunk) and phase 2 per sublayer with the partial
as it stands then.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from attnres_pp.kernels import phase1, phase2, rms_normalize
from attnres_pp.model.config import ModelConfig
from attnres_pp.model.decode_state import DecodeStep


class DepthRead(nn.Module):
    """The learned parameters of one reading site (a sublayer's input, or the final read).

    attnres: query [d]; lr_attnres: query [r]; msar: one query per stream [m, d] and the stream gate
    (weight [m*d, m] zero, alpha 1, bias 0, so every gate starts at 0.5). All queries start at zero.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.enabled = cfg.uses_depth_attention
        if not self.enabled:
            return
        if cfg.residual == "msar":
            m, d = cfg.n_streams, cfg.d_model
            self.query = nn.Parameter(torch.zeros(m, d))
            self.gate_weight = nn.Parameter(torch.zeros(m * d, m))
            self.gate_alpha = nn.Parameter(torch.ones(()))
            self.gate_bias = nn.Parameter(torch.zeros(m))
        else:
            self.query = nn.Parameter(torch.zeros(cfg.query_dim))
        # A learned gain g on the key RMSNorm (init 1): w . (g * RMSNorm(k)) = (w * g) . RMSNorm(k), so
        # the kernels, which normalise keys without a gain, are given the query w * g.
        self.key_gain = nn.Parameter(torch.ones_like(self.query)) if cfg.key_norm_gain else None

    def scoring_query(self) -> torch.Tensor:
        """The query the scores use ([k], or [m, d] per stream): `query`, times the key gain if any."""
        return self.query if self.key_gain is None else self.query * self.key_gain


class StreamConvs(nn.Module):
    """MSAR per-source causal depthwise convolutions: `weights[j][s-1]` is `[kappa_s, d]` for source j.

    Initialised as causal moving averages (1 / kappa on every tap) so the streams differ from step 0.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.kernel_sizes = cfg.stream_kernels
        self.weights = nn.ModuleList(
            nn.ParameterList(nn.Parameter(torch.full((k, cfg.d_model), 1.0 / k)) for k in cfg.stream_kernels)
            for _source in range(cfg.n_blocks + 1)
        )

    def streams(self, source_index: int, v_BTD: torch.Tensor) -> list[torch.Tensor]:
        """[v, conv_1(v), ..., conv_{m-1}(v)], each [B, T, d]; v[t < 0] = 0."""
        out = [v_BTD]
        x_BDT = v_BTD.transpose(1, 2)
        for taps_KD in self.weights[source_index]:
            kappa, width = taps_KD.shape
            # conv1d correlates: tap k of the flipped kernel meets x[t - (kappa - 1 - k)].
            kernel_D1K = taps_KD.flip(0).t().unsqueeze(1)
            y_BDT = F.conv1d(F.pad(x_BDT, (kappa - 1, 0)), kernel_D1K, groups=width)
            out.append(y_BDT.transpose(1, 2))
        return out


def emit_source(cfg: ModelConfig, out_BTW: torch.Tensor) -> torch.Tensor:
    """A sublayer's or the embedding's packed output `[B, T, W]` as it enters the block sums.

    Under projected keys the r key columns are RMS-normalised (no gain) here, before any summing,
    as the LR-AttnRes reference does (SPEC 1.3): each sublayer then weighs equally in its block's key
    whatever its raw scale. Values, and every other variant's output, pass through unchanged.
    """
    if not cfg.projected_key_rank:
        return out_BTW
    d = cfg.d_model
    return torch.cat([out_BTW[..., :d], rms_normalize(out_BTW[..., d:], cfg.norm_eps)], dim=-1)


class BlockReader:
    """Reads for consecutive sublayers of one block, all seeing the same completed sources.

    `blocks` are the completed sources b_0..b_n as `[B, T, W]`; `reads` the DepthRead of each
    sublayer in order. Phase 1 runs here, once per stream; `read(i, partial, partial_index)` runs
    phase 2 for the i-th of them. When decoding, `decode` is the pass's DecodeStep and `first_site`
    the global sublayer index of the first read (an open partial's history is kept per reading site).
    """

    def __init__(self, cfg: ModelConfig, reads: list[DepthRead], blocks: list[torch.Tensor],
                 stream_convs: StreamConvs | None, backend: str, decode: DecodeStep | None = None,
                 first_site: int = 0) -> None:
        self.cfg = cfg
        self.reads = reads
        self.stream_convs = stream_convs
        self.backend = backend
        # Incremental decoding: MSAR streams need earlier positions of each source (decode_state).
        self.decode, self.first_site = decode, first_site
        self.shape_BT = blocks[0].shape[:2]
        # Per stream: phase-1 output [S, BT, d] and lse [S, BT].
        self.phase1_by_stream: list[tuple[torch.Tensor, torch.Tensor]] = []
        if cfg.residual == "msar":
            per_source = [self._streams(("block", j), j, b) for j, b in enumerate(blocks)]
            for s in range(cfg.n_streams):
                values_NTD = torch.stack([self._flat(streams[s]) for streams in per_source])
                queries_SD = torch.stack([r.scoring_query()[s] for r in reads])
                self.phase1_by_stream.append(phase1(values_NTD, queries_SD, eps=cfg.norm_eps, backend=backend))
        else:
            packed_NTW = torch.stack([self._flat(b) for b in blocks])
            values_NTD, keys_NTK = self._split(packed_NTW)
            queries_SK = torch.stack([r.scoring_query() for r in reads]) * cfg.logit_scale
            self.phase1_by_stream.append(
                phase1(values_NTD, queries_SK, keys=keys_NTK, eps=cfg.norm_eps, backend=backend))

    def _streams(self, key: tuple[str, int], source_index: int, v_BTD: torch.Tensor) -> list[torch.Tensor]:
        """MSAR streams of source `v` at its T positions; when decoding, convolved over the source's
        stored earlier positions too, so they equal the streams of a whole-sequence forward."""
        if self.decode is None:
            return self.stream_convs.streams(source_index, v_BTD)
        v_BSD, n_prefix = self.decode.with_history(key, v_BTD)
        return [s_BSD[:, n_prefix:] for s_BSD in self.stream_convs.streams(source_index, v_BSD)]

    def _flat(self, x_BTW: torch.Tensor) -> torch.Tensor:
        return x_BTW.reshape(-1, x_BTW.shape[-1])

    def _split(self, packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Values and keys of packed sources; sliced keys are a view of the values' last r channels."""
        cfg = self.cfg
        d = cfg.d_model
        values = packed[..., :d]
        if cfg.residual != "lr_attnres":
            return values, None
        if cfg.key_mode == "projected":
            return values, packed[..., d:]
        return values, values[..., d - cfg.key_rank:]

    def read(self, i: int, partial_BTW: torch.Tensor | None, partial_index: int) -> torch.Tensor:
        """Input h [B, T, d] of the i-th sublayer given the open partial (None at a block's start)."""
        cfg = self.cfg
        read = self.reads[i]
        if cfg.residual != "msar":
            out1_TD, lse1_T = (t[i] for t in self.phase1_by_stream[0])
            if partial_BTW is not None:
                values_TD, keys_TK = self._split(self._flat(partial_BTW))
                out1_TD = phase2(out1_TD, lse1_T, values_TD, read.scoring_query() * cfg.logit_scale,
                                 partial_key=keys_TK, eps=cfg.norm_eps, backend=self.backend)
            return out1_TD.view(*self.shape_BT, cfg.d_model)
        partial_streams = (self._streams(("partial", self.first_site + i), partial_index, partial_BTW)
                           if partial_BTW is not None else None)
        z_by_stream = []
        for s, (out1_STD, lse1_ST) in enumerate(self.phase1_by_stream):
            z_TD = out1_STD[i]
            if partial_streams is not None:
                z_TD = phase2(z_TD, lse1_ST[i], self._flat(partial_streams[s]), read.scoring_query()[s],
                              eps=cfg.norm_eps, backend=self.backend)
            z_by_stream.append(z_TD)
        return mix_streams(read, z_by_stream, cfg.norm_eps).view(*self.shape_BT, cfg.d_model)


def mix_streams(read: DepthRead, z_by_stream: list[torch.Tensor], eps: float) -> torch.Tensor:
    """h = sum_s g[s] z^(s), g = sigmoid(alpha * RMSNorm(flatten(z)) W + b); z^(s) are [T, d]."""
    z_TMD = torch.stack(z_by_stream, dim=1)
    flat_TF = rms_normalize(z_TMD.flatten(1), eps)
    gate_TM = torch.sigmoid(read.gate_alpha * flat_TF @ read.gate_weight + read.gate_bias)
    return (gate_TM.unsqueeze(-1) * z_TMD).sum(dim=1)
