"""One pipeline chunk: a contiguous range of transformer layers cut out of the whole model, and the
rank-local model a pipeline rank builds.

A rank builds the whole `Transformer` on the meta device (no memory), then materialises only the
submodules its chunks use (`rank_module_names`) and initialises them by whole-model name
(`model.layers.init_weights`), so its parameters equal the single-process model's under the same
names while the other ranks' chunks cost it nothing. Chunks can also be cut from a whole,
materialised model (the in-process tests do).
"""

from __future__ import annotations

import torch
from torch import nn

from attnres_pp.comm.partition import Partition, tied_copy_ranks
from attnres_pp.comm.plan import RESIDUAL, Source
from attnres_pp.model.config import ModelConfig
from attnres_pp.model.decode_state import DecodeStep
from attnres_pp.model.layers import init_weights
from attnres_pp.model.moe import moe_sublayers
from attnres_pp.model.precision import compute_context
from attnres_pp.model.stack import DepthState, forward_sublayers
from attnres_pp.model.transformer import Transformer, embed_state, lm_loss
from attnres_pp.pipeline.activation_checkpoint import checkpointed
from attnres_pp.pipeline.config import AC_POLICIES
from attnres_pp.pipeline.expert_parallel import install_expert_slices
from attnres_pp.pipeline.memory_meter import ActivationMeter, optional_saving, storage_key


class PipelineChunk(nn.Module):
    """Chunk `chunk_index` of `partition`. Holds the embedding on chunk 0 and the head on the last.

    `stream_convs` (MSAR) is one module per rank, shared by its chunks and replicated on every rank.
    `activation_checkpoint` ("none", "full", "selective"): how each transformer layer's forward is
    checkpointed in training (`pipeline.activation_checkpoint`).
    """

    def __init__(self, model: Transformer, partition: Partition, chunk_index: int,
                 stream_convs: nn.Module | None, activation_checkpoint: str = "none") -> None:
        super().__init__()
        if activation_checkpoint not in AC_POLICIES:
            raise ValueError(f"activation_checkpoint={activation_checkpoint!r} is invalid: choose one of "
                             f"{', '.join(AC_POLICIES)}")
        self.activation_checkpoint = activation_checkpoint
        self._meter: ActivationMeter | None = None  # set for the duration of one forward
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
        # The position of the first token the chunk's inputs hold: under sequence parallelism a tp
        # rank embeds its own shard of every sequence (docs/spec.md section 10), else 0.
        self.position_start = 0

    def forward(self, sources: dict[Source, torch.Tensor], idx_BT: torch.Tensor | None = None,
                targets_BT: torch.Tensor | None = None, *, meter: ActivationMeter | None = None
                ) -> tuple[dict[Source, torch.Tensor], torch.Tensor | None]:
        """sources: the chunk's inputs by name. Returns (sources this chunk produced, loss or None).
        `meter`: counts what the forward saves for backward (`memory_meter`)."""
        self._meter = meter
        try:
            with optional_saving(meter), compute_context(self.precision, _device_of(sources, idx_BT).type):
                produced, logits = self.run(sources, idx_BT)
                return produced, None if logits is None else lm_loss(logits, targets_BT)
        finally:
            self._meter = None

    def run(self, sources: dict[Source, torch.Tensor], idx_BT: torch.Tensor | None = None,
            decode: DecodeStep | None = None) -> tuple[dict[Source, torch.Tensor], torch.Tensor | None]:
        """The forward without the loss: (sources produced, logits [B, T, V] on the last chunk or None).
        `decode`: one pass of incremental decoding over this rank's DecodeState (generation). Runs in
        the model's precision (bf16 autocast under bf16, as `Transformer.forward` does)."""
        with compute_context(self.precision, _device_of(sources, idx_BT).type):
            return self._run(sources, idx_BT, decode)

    def _run(self, sources: dict[Source, torch.Tensor], idx_BT: torch.Tensor | None,
             decode: DecodeStep | None) -> tuple[dict[Source, torch.Tensor], torch.Tensor | None]:
        cfg, convs = self.cfg, self._stream_convs[0]
        if self.is_first:
            state = embed_state(cfg, self.embed, idx_BT, self.position_start if decode is None else decode.start)
        else:
            state = _state_from_sources(sources)
        n_before = len(state.blocks)
        layers = {int(k): v for k, v in self.layers.items()}
        if self.activation_checkpoint != "none" and decode is None and torch.is_grad_enabled():
            state = self._checkpointed_layers(layers, convs, state)
        else:
            state = forward_sublayers(cfg, layers, convs, state, self.sublayers, self.backend, decode)
        if self.is_last:
            return {}, self.head(state, convs, self.backend, decode)
        if cfg.residual == "standard":
            return {RESIDUAL: state.residual}, None
        first_new = 0 if self.is_first else n_before
        produced = {Source("block", j): state.blocks[j] for j in range(first_new, len(state.blocks))}
        if state.partial is not None:
            produced[Source("partial", len(state.blocks))] = state.partial
        return produced, None


    def _checkpointed_layers(self, layers: dict, convs, state: DepthState) -> DepthState:
        """The chunk's sublayers one transformer layer at a time, each under `checkpointed` (a layer
        boundary inside a block reads as a chunk boundary does: the same math)."""
        cfg = self.cfg
        keep = {storage_key(p) for p in self.parameters()}
        if convs is not None:
            keep |= {storage_key(p) for p in convs.parameters()}
        start = self.sublayers.start
        while start < self.sublayers.stop:
            stop = min(self.sublayers.stop, 2 * (start // 2) + 2)
            span = range(start, stop)

            def layer(*tensors, span=span):
                out = forward_sublayers(cfg, layers, convs, _unflatten(cfg, tensors), span, self.backend)
                return _flatten(out)

            state = _unflatten(cfg, checkpointed(layer, _flatten(state), policy=self.activation_checkpoint,
                                                 meter=self._meter, keep=keep, min_width=cfg.d_model))
            start = stop
        return state


def _flatten(state: DepthState) -> list:
    """A depth state as a flat argument list: [residual] or [blocks..., partial or None]."""
    if state.residual is not None:
        return [state.residual]
    return [*state.blocks, state.partial]


def _unflatten(cfg: ModelConfig, tensors) -> DepthState:
    if cfg.residual == "standard":
        return DepthState(residual=tensors[0])
    return DepthState(blocks=list(tensors[:-1]), partial=tensors[-1])


def _device_of(sources: dict[Source, torch.Tensor], idx_BT: torch.Tensor | None) -> torch.device:
    return (idx_BT if idx_BT is not None else next(iter(sources.values()))).device


def _state_from_sources(sources: dict[Source, torch.Tensor]) -> DepthState:
    if RESIDUAL in sources:
        return DepthState(residual=sources[RESIDUAL])
    n_blocks = sum(1 for s in sources if s.kind == "block")
    blocks = [sources[Source("block", j)] for j in range(n_blocks)]
    partial = next((t for s, t in sources.items() if s.kind == "partial"), None)
    return DepthState(blocks=blocks, partial=partial)


def rank_module_names(cfg: ModelConfig, partition: Partition, pp_rank: int) -> list[str]:
    """Whole-model names of the submodules rank `pp_rank` holds: its chunks' transformer layers, the
    embedding (chunk 0), the head (the last chunk) and, under MSAR, every source's stream convs.

    The convs are tied parameters replicated on every rank rather than only on the ranks that read
    each source: they are tiny ((blocks + 1) x d x sum(kappa) numbers), and one replica everywhere
    makes their gradient sum a single all-reduce over all ranks instead of one group per source."""
    names = [f"layers.{i}" for c in partition.chunks_of(pp_rank) for i in partition.layer_range(c)]
    if partition.rank_of(0) == pp_rank:
        names.insert(0, "embed")
    if partition.rank_of(partition.n_chunks - 1) == pp_rank:
        names.append("head")
    if cfg.residual == "msar":
        names.append("stream_convs")
    return names


def build_rank_model(cfg: ModelConfig, partition: Partition, pp_rank: int, *, seed: int, backend: str = "auto",
                     device: torch.device | str = "cpu", precision: str = "fp32",
                     activation_checkpoint: str = "none", expert_parallel: tuple[int, int] = (0, 1),
                     compile: bool = False) -> tuple[Transformer, dict[int, PipelineChunk]]:
    """The model skeleton of rank `pp_rank` (other ranks' parameters stay on the meta device, with no
    storage) and its chunks, whose parameters equal `Transformer(cfg, seed=seed)`'s; the chunks
    compute in `precision` (`model.precision`). `expert_parallel` = (ep_rank, EP): with EP > 1 each
    MoE sublayer holds the rank's slice of the routed experts (`pipeline.expert_parallel`).
    `compile`: the sublayers and depth reads `Transformer(compile=True)` compiles, compiled."""
    with torch.device("meta"):
        model = Transformer(cfg, backend=backend, seed=seed, precision=precision, compile=compile)
    ep_rank, ep_size = expert_parallel
    if ep_size > 1:
        install_expert_slices(model, ep_rank, ep_size)
    for name in rank_module_names(cfg, partition, pp_rank):
        model.get_submodule(name).to_empty(device=device)
    copy_ranks = tied_copy_ranks(cfg.tie_embeddings, partition)
    if not copy_ranks:  # to_empty gave the embedding a new matrix: the head reads that one
        model.tie_embeddings()
    init_weights(model, cfg, seed)
    if copy_ranks and pp_rank == copy_ranks[1]:  # the last rank's copy of a tied embedding
        init_tied_copy(model.head.lm_head, cfg, seed)
    for moe in moe_sublayers(model).values():  # to_empty left the load counters uninitialised memory
        moe.load_E.zero_()
    return model, build_rank_chunks(model, partition, pp_rank, activation_checkpoint=activation_checkpoint)


def init_tied_copy(lm_head: nn.Linear, cfg: ModelConfig, seed: int) -> None:
    """The LM head's copy of a tied embedding on a rank without the embedding: the embedding's own
    values, drawn from the embedding's stream (`init_weights` by the name `embed.tok.weight`), so
    the two ranks' copies start bit-equal."""
    holder = nn.Module()  # a stand-in whose only parameter carries the embedding's whole-model name
    holder.embed = nn.Module()
    holder.embed.tok = lm_head
    init_weights(holder, cfg, seed)


def build_rank_chunks(model: Transformer, partition: Partition, pp_rank: int, *,
                      activation_checkpoint: str = "none") -> dict[int, PipelineChunk]:
    """The chunks of rank `pp_rank`, keyed by global chunk index, sharing one set of stream convs."""
    return {c: PipelineChunk(model, partition, c, model.stream_convs, activation_checkpoint)
            for c in partition.chunks_of(pp_rank)}


def rank_parameters(chunks: dict[int, PipelineChunk], model: Transformer) -> dict[str, nn.Parameter]:
    """Every parameter a rank owns, under the whole model's names (tied stream convs included)."""
    owned = {id(p) for chunk in chunks.values() for p in chunk.parameters()}
    if model.stream_convs is not None:
        owned |= {id(p) for p in model.stream_convs.parameters()}
    params = {name: p for name, p in model.named_parameters() if id(p) in owned}
    unallocated = [name for name, p in params.items() if p.is_meta]
    if unallocated:
        raise RuntimeError(f"chunks use parameters that were never materialised: {unallocated[:5]}")
    return params
