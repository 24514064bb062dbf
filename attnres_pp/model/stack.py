"""Running a contiguous range of sublayers over a `DepthState`: the one code path shared by the
single-process Transformer and every pipeline chunk, so their math is identical by construction.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from attnres_pp.model.config import ModelConfig, block_of, block_stop, completes_block
from attnres_pp.model.decode_state import DecodeStep
from attnres_pp.model.depth import BlockReader, DepthSources, StreamConvs, emit_source
from attnres_pp.model.layers import TransformerLayer
from attnres_pp.model.precision import to_activation
from attnres_pp.model.routing import record_read


@dataclass
class DepthState:
    """What flows between sublayers, per microbatch.

    blocks[j] is source b_j as `[B, T, W]` (b_0 = embedding); partial is the open block's running
    sum or None. Both are sums of emitted outputs (`emit_source`: projected keys normalised first).
    residual is the standard stream h (the `standard` variant only). `sources` is the pass's
    DepthSources holding `blocks` for reading (buffers, normalised keys, MSAR streams), so a later
    read in the same pass (the head's) reuses them; None until a pass builds it.
    """

    blocks: list[torch.Tensor] = field(default_factory=list)
    partial: torch.Tensor | None = None
    residual: torch.Tensor | None = None
    sources: DepthSources | None = None


def depth_sources(cfg: ModelConfig, state: DepthState, stream_convs: StreamConvs | None, backend: str,
                  decode: DecodeStep | None = None) -> DepthSources:
    """The state's DepthSources: its own if it holds every block, else one built from `blocks`."""
    if state.sources is not None and len(state.sources) == len(state.blocks):
        return state.sources
    sources = DepthSources(cfg, stream_convs, backend, state.blocks[0], decode)
    sources.append(list(state.blocks))
    return sources


def forward_sublayers(cfg: ModelConfig, layers: Mapping[int, TransformerLayer], stream_convs: StreamConvs | None,
                      state: DepthState, sublayers: range, backend: str = "auto",
                      decode: DecodeStep | None = None) -> DepthState:
    """Run sublayers `sublayers` (global indices) on `state`; returns the state after them.

    `layers[i]` must hold transformer layer i for every sublayer in range. A sublayer that completes a
    block (or is the model's last) moves the partial into `blocks`. Each output passes `emit_source`
    before it is summed, here and nowhere else, so pipeline chunks inherit the same rule; under
    bf16 autocast every stored tensor is bf16 (`precision.to_activation`).
    `decode`: incremental decoding, the state's tokens are one pass of a DecodeState (docs/spec.md section 7).
    """
    if cfg.residual == "standard":
        residual = state.residual
        for l in sublayers:
            out_BTD = _sublayer_output(layers, l, residual, decode)
            record_read(layers[l // 2].sublayer(l % 2).read, l, None, 0, [], None, 0, residual, out_BTD)
            residual = to_activation(residual + out_BTD)
        return DepthState(residual=residual)

    blocks, partial = list(state.blocks), state.partial
    sources = depth_sources(cfg, state, stream_convs, backend, decode)
    reader: BlockReader | None = None
    segment_start = sublayers.start
    block_ends = cfg.block_ends
    for l in sublayers:
        block_index = block_of(l, block_ends)
        if reader is None:
            # Phase 1 for this block's sublayers that lie in `sublayers` (one batched read).
            segment_stop = min(sublayers.stop, block_stop(l, block_ends))
            reads = [layers[j // 2].sublayer(j % 2).read for j in range(l, segment_stop)]
            reader = BlockReader(cfg, reads, sources, stream_convs, backend, decode, l)
            segment_start = l
        h_BTD = reader.read(l - segment_start, partial, block_index)
        out_BTW = to_activation(emit_source(cfg, _sublayer_output(layers, l, h_BTD, decode)))
        record_read(layers[l // 2].sublayer(l % 2).read, l, reader, l - segment_start, blocks, partial, block_index,
                    h_BTD, out_BTW)
        partial = out_BTW if partial is None else partial + out_BTW
        if completes_block(l, block_ends):
            blocks.append(partial)
            sources.append([partial])
            partial, reader = None, None
    return DepthState(blocks=blocks, partial=partial, sources=sources)


def _sublayer_output(layers: Mapping[int, TransformerLayer], l: int, h_BTD: torch.Tensor,
                     decode: DecodeStep | None) -> torch.Tensor:
    sublayer = layers[l // 2].sublayer(l % 2)
    if decode is None or l % 2:  # the MLP is per token: nothing to carry between passes
        return sublayer(h_BTD)
    return sublayer(h_BTD, decode.kv(l // 2))
