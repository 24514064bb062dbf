"""Depth attention: the per-site pseudo-query parameters and the two-phase block read
(docs/spec.md sections 1.1-1.4 and 2) for every AttnRes variant.

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

from attnres_pp.kernels import (
    phase1,
    phase1_normalized_torch,
    phase1_streams,
    phase1_streams_torch,
    phase2,
    phase2_streams_torch,
    resolve_backend,
    rms_normalize,
)
from attnres_pp.model.config import ModelConfig
from attnres_pp.model.decode_state import DecodeStep
from attnres_pp.model.sources import RowBuffer
from attnres_pp.model.stream_conv import shifted_streams


class DepthRead(nn.Module):
    """The learned parameters of one reading site (a sublayer's input, or the final read).

    attnres: query [d]; lr_attnres: query [r]; msar: one query per stream [m, d] and the stream gate
    (weight [m*d, m] zero, alpha 1, bias 0, so every gate starts at 0.5). All queries start at zero.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
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

    def forward(self, out1: torch.Tensor, lse1: torch.Tensor, partial: torch.Tensor | None,
                backend: str) -> torch.Tensor:
        """Phase 2 of this site's read (and under MSAR the stream mix): the input h [T, d].

        out1, lse1: this site's phase-1 rows, [T, d] and [T] (MSAR: [m, T, d] and [m, T]); partial:
        the open partial packed [T, W] (MSAR: its streams [m, T, d]), or None at a block's start.
        A module so that `--compile` compiles it with its sublayer (`Transformer(compile=True)`)."""
        cfg = self.cfg
        if cfg.residual != "msar":
            if partial is None:
                return out1
            values_TD, keys_TK = split_keys(cfg, partial)
            return phase2(out1, lse1, values_TD, self.scoring_query() * cfg.logit_scale, partial_key=keys_TK,
                          eps=cfg.norm_eps, backend=backend)
        z_MTD = out1
        if partial is not None:
            if backend == "torch":
                z_MTD = phase2_streams_torch(out1, lse1, partial, self.scoring_query(), cfg.norm_eps)
            else:
                queries_MD = self.scoring_query()
                z_MTD = torch.stack([phase2(o, lse, p, q, eps=cfg.norm_eps, backend=backend) for o, lse, p, q in
                                     zip(out1.unbind(0), lse1.unbind(0), partial.unbind(0), queries_MD.unbind(0),
                                         strict=True)])
        return mix_streams(self, z_MTD, cfg.norm_eps)


class StreamConvs(nn.Module):
    """MSAR per-source causal depthwise convolutions: `weights[j][s-1]` is `[kappa_s, d]` for source j.

    Initialised as causal moving averages (1 / kappa on every tap) so the streams differ from step 0.

    `halo`, when set (sequence parallelism, `pipeline.tensor_parallel.SequenceHalo`), maps the last
    kappa_max - 1 tokens of a rank's sequence shard `[N, B, kappa_max - 1, d]` to those before it (the
    previous tp rank's, zeros on the first), which the convolutions read in place of v[t < 0] = 0.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.halo = None
        self.kernel_sizes = cfg.stream_kernels
        self.weights = nn.ModuleList(
            nn.ParameterList(nn.Parameter(torch.full((k, cfg.d_model), 1.0 / k)) for k in cfg.stream_kernels)
            for _source in range(cfg.n_blocks + 1)
        )

    def kernel(self, source_index: int) -> torch.Tensor:
        """Source j's conv taps as `stream_stack` takes them: [m - 1, kappa_max, d], tap delta of
        stream s weighing v[t - delta], zero past the stream's kernel size."""
        return self.taps(source_index)

    def taps(self, source_index: int) -> torch.Tensor:
        """Source j's conv taps as the fused stream kernel takes them: [m - 1, kappa_max, d], tap delta
        of stream s weighing v[t - delta], zero past the stream's kernel size."""
        kappa_max = max(self.kernel_sizes)
        return torch.stack([F.pad(taps_KD, (0, 0, 0, kappa_max - taps_KD.shape[0]))
                            for taps_KD in self.weights[source_index]])

    def stream_stack(self, kernels: list[torch.Tensor], v_NBTD: torch.Tensor) -> torch.Tensor:
        """Streams [m, N, B, T, d] of N sources (stream 0 is v) with their `kernel`s ([m-1, kappa_max,
        d] each): stream s is sum over delta < kappa_s of taps[s-1, delta] * v[t - delta], v[t < 0] = 0.

        Shifted multiply-adds over a zero-padded v rather than a grouped conv1d: at these widths
        (d channels, 3 outputs per group, kernels <= 12) on CPU the depthwise conv and its backward
        cost more than the 24 channel-wise multiply-adds and their gradients, which run in place in
        one autograd function (`stream_conv.shifted_streams`; its slow twin `shifted_streams_twin`)."""
        n, _, seq, _ = v_NBTD.shape
        kappa_max = kernels[0].shape[1]
        taps_NSKD = kernels[0].unsqueeze(0) if n == 1 else torch.stack(kernels)
        reach = seq  # taps past the sequence's start meet only zeros
        if self.halo is None or kappa_max == 1:
            padded_NBPD = F.pad(v_NBTD, (0, 0, kappa_max - 1, 0))  # v[t < 0] = 0
        else:  # a sequence shard: the tokens before it come from the previous shard
            padded_NBPD = torch.cat([self.halo(v_NBTD[:, :, seq - (kappa_max - 1):]), v_NBTD], dim=2)
            reach = kappa_max
        return shifted_streams(v_NBTD, padded_NBPD, taps_NSKD, self.kernel_sizes, reach)

    def streams(self, source_index: int, v_BTD: torch.Tensor) -> list[torch.Tensor]:
        """[v, conv_1(v), ..., conv_{m-1}(v)], each [B, T, d]; v[t < 0] = 0."""
        return list(self.stream_stack([self.kernel(source_index)], v_BTD.unsqueeze(0))[:, 0].unbind(0))


def emit_source(cfg: ModelConfig, out_BTW: torch.Tensor) -> torch.Tensor:
    """A sublayer's or the embedding's packed output `[B, T, W]` as it enters the block sums.

    Under projected keys the r key columns are RMS-normalised (no gain) here, before any summing,
    as the LR-AttnRes reference does (docs/spec.md section 1.3): each sublayer then weighs equally in its block's key
    whatever its raw scale. Values, and every other variant's output, pass through unchanged.
    """
    if not cfg.projected_key_rank:
        return out_BTW
    d = cfg.d_model
    return torch.cat([out_BTW[..., :d], rms_normalize(out_BTW[..., d:], cfg.norm_eps)], dim=-1)


class DepthSources:
    """The completed sources b_0..b_n of one pass over a range of sublayers, as every read needs them.

    Each source enters once (`append`), when the pass starts (the sources it holds) or when its
    block completes: it is written into a preallocated buffer (`sources.RowBuffer`, capacity
    n_blocks + 1), its key normalised once (torch backend; the Triton kernels normalise on the fly)
    and, under MSAR, its m streams computed once, for every source appended together in one grouped
    convolution. Reads then see `[n, T, W]` views of the buffers: no copy and no recomputation per
    read, and each source's gradient (conv taps included) is formed once after all its reads.
    `blocks` keeps the tensors themselves (what a pipeline chunk hands on).
    """

    def __init__(self, cfg: ModelConfig, stream_convs: StreamConvs | None, backend: str, like_BTW: torch.Tensor,
                 decode: DecodeStep | None = None, capacity: int | None = None) -> None:
        self.cfg, self.stream_convs, self.decode = cfg, stream_convs, decode
        self.backend = resolve_backend(backend, like_BTW)
        self.shape_BT = tuple(like_BTW.shape[:2])
        # A model's pass holds at most n_blocks + 1 sources; a caller reading given sources (a probe
        # timing reads of N sources) may hold more.
        capacity = max(cfg.n_blocks + 1, capacity or 0)
        n_tokens, d = self.shape_BT[0] * self.shape_BT[1], cfg.d_model
        dtype, device = like_BTW.dtype, like_BTW.device
        # Normalised keys in the math dtype (fp32, fp64 for fp64), as the reads compute them.
        self.key_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        self.blocks: list[torch.Tensor] = []
        self.kernels: list[torch.Tensor] = []  # MSAR: each source's conv weight, built once per pass
        self.normalize_keys = self.backend == "torch"
        self.taps: RowBuffer | None = None  # MSAR under the fused kernel: [N, m-1, kappa_max, d]
        # The fused kernel convolves within the tokens it is given; a sequence shard's first tokens
        # also read the previous shard's (the halo), so under sequence parallelism the streams are
        # convolved here, halo included, and the Triton phase-1 kernel reads them as stored.
        if cfg.residual == "msar" and self.backend == "triton" and decode is None and stream_convs.halo is None:
            self.values = RowBuffer((capacity, n_tokens, d), dtype, device)
            self.khat = None
            taps_dtype = stream_convs.weights[0][0].dtype
            self.taps = RowBuffer((capacity, cfg.n_streams - 1, max(cfg.stream_kernels), d), taps_dtype, device)
        elif cfg.residual == "msar":
            shape = (cfg.n_streams, capacity, n_tokens, d)
            self.values = RowBuffer(shape, dtype, device, row_axis=1)
            self.khat = RowBuffer(shape, self.key_dtype, device, row_axis=1) if self.normalize_keys else None
        else:
            self.values = RowBuffer((capacity, n_tokens, cfg.source_width), dtype, device)
            key_width = cfg.key_rank if cfg.residual == "lr_attnres" else d
            self.khat = (RowBuffer((capacity, n_tokens, key_width), self.key_dtype, device)
                         if self.normalize_keys else None)

    def __len__(self) -> int:
        return len(self.blocks)

    def append(self, blocks_BTW: list[torch.Tensor]) -> None:
        """Add completed sources (in source order) to the buffers."""
        if not blocks_BTW:
            return
        first = len(self.blocks)
        self.blocks.extend(blocks_BTW)
        n_tokens = self.shape_BT[0] * self.shape_BT[1]
        if self.cfg.residual != "msar":
            packed_NTW = (blocks_BTW[0].reshape(1, n_tokens, -1) if len(blocks_BTW) == 1
                          else torch.stack([b.reshape(n_tokens, -1) for b in blocks_BTW]))
            self.values.append(packed_NTW)
            if self.khat is not None:
                values_NTD, keys_NTK = split_keys(self.cfg, packed_NTW)
                self.khat.append(self.normalized_keys(values_NTD if keys_NTK is None else keys_NTK))
            return
        self.kernels.extend(self.stream_convs.kernel(j) for j in range(first, first + len(blocks_BTW)))
        if self.taps is not None:
            self.values.append(torch.stack([b.reshape(n_tokens, -1) for b in blocks_BTW]))
            self.taps.append(torch.stack([self.stream_convs.taps(j) for j in range(first, first + len(blocks_BTW))]))
            return
        if self.decode is None:
            streams_MNBTD = self.stream_convs.stream_stack(self.kernels[first:], torch.stack(blocks_BTW))
        else:
            streams_MNBTD = torch.cat([self._decode_streams(("block", first + i), first + i, b)
                                       for i, b in enumerate(blocks_BTW)], dim=1)
        streams_MNTD = streams_MNBTD.flatten(2, 3)
        self.values.append(streams_MNTD)
        if self.khat is not None:
            self.khat.append(self.normalized_keys(streams_MNTD))

    def normalized_keys(self, keys: torch.Tensor) -> torch.Tensor:
        """RMSNorm (no gain) of keys, in the math dtype: the one place a read's keys are normalised
        outside the kernels. (A learned key-norm gain folds into the queries: `read_queries`.)"""
        with torch.autocast(keys.device.type, enabled=False):
            return rms_normalize(keys.to(self.key_dtype), self.cfg.norm_eps)

    def partial_streams(self, site: int, source_index: int, partial_BTW: torch.Tensor) -> torch.Tensor:
        """MSAR streams of the open partial [m, T, d] (block `source_index`'s weights)."""
        if self.decode is not None:
            return self._decode_streams(("partial", site), source_index, partial_BTW)[:, 0].flatten(1, 2)
        kernel = self.kernels[source_index] if source_index < len(self.kernels) else \
            self.stream_convs.kernel(source_index)
        return self.stream_convs.stream_stack([kernel], partial_BTW.unsqueeze(0))[:, 0].flatten(1, 2)

    def _decode_streams(self, key: tuple[str, int], source_index: int, v_BTD: torch.Tensor) -> torch.Tensor:
        """Streams [m, 1, B, T, d] of a source at this pass's T positions, convolved over its stored
        earlier positions too, so they equal the streams of a whole-sequence forward."""
        v_BSD, n_prefix = self.decode.with_history(key, v_BTD)
        return self.stream_convs.stream_stack([self.stream_convs.kernel(source_index)], v_BSD.unsqueeze(0))[
            :, :, :, n_prefix:]


def split_keys(cfg: ModelConfig, packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Values and keys of packed sources `[..., W]`; sliced keys are a view of the values' last r
    channels, projected keys the last r columns; None: keys are the values."""
    d = cfg.d_model
    values = packed[..., :d]
    if cfg.residual != "lr_attnres":
        return values, None
    if cfg.key_mode == "projected":
        return values, packed[..., d:]
    return values, values[..., d - cfg.key_rank:]


def read_queries(cfg: ModelConfig, reads: list[DepthRead]) -> torch.Tensor:
    """The pseudo-queries of `reads` as the kernels take them: [S, k] (attnres, lr_attnres, logit
    scale applied) or [m, S, d] (msar), each times its site's learned key-norm gain if it has one."""
    if cfg.residual == "msar":
        return torch.stack([r.scoring_query() for r in reads], dim=1)
    return torch.stack([r.scoring_query() for r in reads]) * cfg.logit_scale


class BlockReader:
    """Reads for consecutive sublayers of one block, all seeing the same completed sources.

    `sources` are the completed sources b_0..b_n (a DepthSources, or a list of `[B, T, W]` tensors);
    `reads` the DepthRead of each sublayer in order. Phase 1 runs here once for all of them (under
    MSAR for every stream at once); `read(i, partial, partial_index)` runs phase 2 for the i-th.
    When decoding, `decode` is the pass's DecodeStep and `first_site` the global sublayer index of the
    first read (an open partial's history is kept per reading site).
    """

    def __init__(self, cfg: ModelConfig, reads: list[DepthRead], sources: DepthSources | list[torch.Tensor],
                 stream_convs: StreamConvs | None, backend: str, decode: DecodeStep | None = None,
                 first_site: int = 0) -> None:
        if not isinstance(sources, DepthSources):
            held = DepthSources(cfg, stream_convs, backend, sources[0], decode, capacity=len(sources))
            held.append(list(sources))
            sources = held
        self.cfg, self.reads, self.sources, self.first_site = cfg, reads, sources, first_site
        self.backend = sources.backend
        self.shape_BT = sources.shape_BT
        queries = read_queries(cfg, reads)
        values = sources.values.rows()
        khat = None if sources.khat is None else sources.khat.rows()
        # One entry: (out [S, T, d], lse [S, T]), or under MSAR (out [m, S, T, d], lse [m, S, T]).
        self.phase1_by_stream: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._per_site: tuple | None = None
        if cfg.residual == "msar":
            if sources.taps is not None:
                self.phase1_by_stream.append(phase1_streams(values, sources.taps.rows(), list(cfg.stream_kernels),
                                                            queries, self.shape_BT[1], eps=cfg.norm_eps,
                                                            backend=self.backend))
            elif khat is not None:
                self.phase1_by_stream.append(phase1_streams_torch(values, queries, khat))
            else:
                per_stream = [phase1(v, q, eps=cfg.norm_eps, backend=self.backend)
                              for v, q in zip(values.unbind(0), queries.unbind(0), strict=True)]
                self.phase1_by_stream.append(tuple(torch.stack(t) for t in zip(*per_stream, strict=True)))
            return
        values_NTD, keys_NTK = split_keys(cfg, values)
        if khat is not None:
            self.phase1_by_stream.append(phase1_normalized_torch(values_NTD, queries, khat))
        else:
            self.phase1_by_stream.append(phase1(values_NTD, queries, keys=keys_NTK, eps=cfg.norm_eps,
                                                backend=self.backend))

    @property
    def stream_convs(self) -> StreamConvs | None:
        """MSAR's per-source convolutions the sources were expanded with (None for the other variants)."""
        return self.sources.stream_convs

    def read(self, i: int, partial_BTW: torch.Tensor | None, partial_index: int) -> torch.Tensor:
        """Input h [B, T, d] of the i-th sublayer given the open partial (None at a block's start)."""
        cfg = self.cfg
        read = self.reads[i]
        if self._per_site is None or self._per_site[0] is not self.phase1_by_stream[0]:
            # One unbind for all sites: indexing per site would make each site's backward fill a
            # zero gradient of the whole phase-1 output (O(S^2) per block).
            axis = 1 if cfg.residual == "msar" else 0
            out_all, lse_all = self.phase1_by_stream[0]
            self._per_site = (self.phase1_by_stream[0], out_all.unbind(axis), lse_all.unbind(axis))
        out1, lse1 = self._per_site[1][i], self._per_site[2][i]
        partial = None
        if partial_BTW is not None:
            partial = (self.sources.partial_streams(self.first_site + i, partial_index, partial_BTW)
                       if cfg.residual == "msar" else partial_BTW.reshape(-1, partial_BTW.shape[-1]))
        return read(out1, lse1, partial, self.backend).view(*self.shape_BT, cfg.d_model)


def mix_streams(read: DepthRead, z_MTD: torch.Tensor, eps: float) -> torch.Tensor:
    """h = sum_s g[s] z^(s), g = sigmoid(alpha * RMSNorm(flatten(z)) W + b); z is [m, T, d].

    RMSNorm(flatten(z)) W = rstd * sum_s z^(s) W_s with W_s the rows of stream s: one bmm on the
    stream-major z, no [T, m*d] copy."""
    m, _, d = z_MTD.shape
    norm_T = torch.linalg.vector_norm(z_MTD, dim=(0, 2), dtype=torch.promote_types(z_MTD.dtype, torch.float32))
    rstd_T1 = torch.rsqrt(norm_T.square() / (m * d) + eps).unsqueeze(-1)
    logits_TM = torch.bmm(z_MTD, read.gate_weight.view(m, d, m)).sum(dim=0)
    gate_TM = torch.sigmoid(read.gate_alpha * (rstd_T1 * logits_TM) + read.gate_bias)
    return (gate_TM.t().unsqueeze(-1) * z_MTD).sum(dim=0)
