"""One pipeline chunk: a contiguous range of transformer layers cut out of the whole model.

Chunks are built from a whole `Transformer` made with the run's seed, so every chunk's parameters
are exactly the same parameters of the single-process model, under the same names.
"""

from __future__ import annotations

import torch
from torch import nn

from attnres_pp.comm.partition import Partition
from attnres_pp.comm.plan import RESIDUAL, Source
from attnres_pp.model.precision import compute_context
from attnres_pp.model.stack import DepthState, forward_sublayers
from attnres_pp.model.transformer import Transformer, embed_state, lm_loss


class PipelineChunk(nn.Module):
    """Chunk `chunk_index` of `partition`. Holds the embedding on chunk 0 and the head on the last.

    `stream_convs` (MSAR) is one module per rank, shared by its chunks and replicated on every rank.
    """

    def __init__(self, model: Transformer, partition: Partition, chunk_index: int,
                 stream_convs: nn.Module | None) -> None:
        super().__init__()
        self.cfg = model.cfg
        self.backend = model.backend
        self.precision = model.precision
        self.chunk_index = chunk_index
        self.sublayers = partition.sublayer_range(chunk_index)
        self.is_first = chunk_index == 0
        self.is_last = chunk_index == partition.n_chunks - 1
        self.embed = model.embed if self.is_first else None
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in partition.layer_range(chunk_index)})
        self.head = model.head if self.is_last else None
        self._stream_convs = [stream_convs]  # a list so the module is not registered twice per rank

    def forward(self, sources: dict[Source, torch.Tensor], idx_BT: torch.Tensor | None = None,
                targets_BT: torch.Tensor | None = None) -> tuple[dict[Source, torch.Tensor], torch.Tensor | None]:
        """sources: the chunk's inputs by name. Returns (sources this chunk produced, loss or None)."""
        device = (idx_BT if idx_BT is not None else next(iter(sources.values()))).device
        with compute_context(self.precision, device.type):
            return self._forward(sources, idx_BT, targets_BT)

    def _forward(self, sources, idx_BT, targets_BT):
        cfg, convs = self.cfg, self._stream_convs[0]
        state = embed_state(cfg, self.embed, idx_BT) if self.is_first else _state_from_sources(sources)
        n_before = len(state.blocks)
        state = forward_sublayers(cfg, {int(k): v for k, v in self.layers.items()}, convs, state,
                                  self.sublayers, self.backend)
        if self.is_last:
            return {}, lm_loss(self.head(state, convs, self.backend), targets_BT)
        if cfg.residual == "standard":
            return {RESIDUAL: state.residual}, None
        first_new = 0 if self.is_first else n_before
        produced = {Source("block", j): state.blocks[j] for j in range(first_new, len(state.blocks))}
        if state.partial is not None:
            produced[Source("partial", len(state.blocks))] = state.partial
        return produced, None


def _state_from_sources(sources: dict[Source, torch.Tensor]) -> DepthState:
    if RESIDUAL in sources:
        return DepthState(residual=sources[RESIDUAL])
    n_blocks = sum(1 for s in sources if s.kind == "block")
    blocks = [sources[Source("block", j)] for j in range(n_blocks)]
    partial = next((t for s, t in sources.items() if s.kind == "partial"), None)
    return DepthState(blocks=blocks, partial=partial)


def build_rank_chunks(model: Transformer, partition: Partition, pp_rank: int) -> dict[int, PipelineChunk]:
    """The chunks of rank `pp_rank`, keyed by global chunk index, sharing one set of stream convs."""
    return {c: PipelineChunk(model, partition, c, model.stream_convs) for c in partition.chunks_of(pp_rank)}


def rank_parameters(chunks: dict[int, PipelineChunk], model: Transformer) -> dict[str, nn.Parameter]:
    """Every parameter a rank owns, under the whole model's names (tied stream convs included)."""
    owned = {id(p) for chunk in chunks.values() for p in chunk.parameters()}
    if model.stream_convs is not None:
        owned |= {id(p) for p in model.stream_convs.parameters()}
    return {name: p for name, p in model.named_parameters() if id(p) in owned}
