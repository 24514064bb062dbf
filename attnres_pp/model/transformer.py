"""The whole single-process Transformer: the ground truth every pipelined run must reproduce."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from attnres_pp.model.config import ModelConfig
from attnres_pp.model.decode_state import DecodeStep
from attnres_pp.model.depth import BlockReader, DepthRead, StreamConvs, emit_source
from attnres_pp.model.layers import Embedding, RMSNorm, TransformerLayer, init_weights
from attnres_pp.model.moe import MoE
from attnres_pp.model.precision import PRECISIONS, compute_context, to_activation
from attnres_pp.model.routing import record_read
from attnres_pp.model.stack import DepthState, depth_sources, forward_sublayers


class Head(nn.Module):
    """Final read over every block summary, output RMSNorm and the LM head."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.read = DepthRead(cfg)
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, state: DepthState, stream_convs: StreamConvs | None, backend: str,
                decode: DecodeStep | None = None) -> torch.Tensor:
        if self.cfg.residual == "standard":
            h_BTD = state.residual
            record_read(self.read, self.cfg.n_sublayers, None, 0, [], None, 0, h_BTD)
        else:
            # The last sublayer always completes a block, so no partial is open here.
            sources = depth_sources(self.cfg, state, stream_convs, backend, decode)
            reader = BlockReader(self.cfg, [self.read], sources, stream_convs, backend, decode, self.cfg.n_sublayers)
            h_BTD = reader.read(0, None, 0)
            record_read(self.read, self.cfg.n_sublayers, reader, 0, state.blocks, None, 0, h_BTD)
        return self.lm_head(self.norm(h_BTD))


def embed_state(cfg: ModelConfig, embedding: Embedding, idx_BT: torch.Tensor, start: int = 0) -> DepthState:
    o_emb = to_activation(embedding(idx_BT, start))
    if cfg.residual == "standard":
        return DepthState(residual=o_emb)
    return DepthState(blocks=[to_activation(emit_source(cfg, o_emb))])


def lm_loss(logits_BTV: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
    # At least fp32 (bf16 logits under autocast), float64 kept: a float64 model's loss is then exact
    # enough to compare sums of per-shard means (sequence parallelism) with the whole mean.
    math_dtype = torch.promote_types(logits_BTV.dtype, torch.float32)
    return F.cross_entropy(logits_BTV.to(math_dtype).flatten(0, 1), targets_BT.flatten())


class Transformer(nn.Module):
    """Decoder-only LM of docs/spec.md section 1. `model(idx)` -> logits; `model(idx, targets)` -> mean loss.
    `precision` "bf16" runs the forward under bf16 autocast (see `model.precision`).

    Parameters are initialised from `seed` and their whole-model names (`layers.init_weights`), not
    from torch's global generator. Built under `torch.device("meta")` the model allocates nothing:
    a pipeline rank then materialises and initialises only its own chunks (`pipeline.chunk`).
    `compile`: every sublayer and its depth read's merge (`DepthRead.forward`: phase 2 and MSAR's
    stream mix) run torch.compile'd, the Triton ops as custom ops inside the graphs; phase 1 (one
    batched read per block, its source count changing from block to block) and the block sums stay
    eager. Graphs are compiled on the first step and reused after (the same shapes every step);
    `compile_backend` is torch.compile's backend ("aot_eager" traces without generating code).
    """

    def __init__(self, cfg: ModelConfig, *, backend: str = "auto", seed: int = 0, precision: str = "fp32",
                 compile: bool = False, compile_backend: str = "inductor") -> None:
        super().__init__()
        if precision not in PRECISIONS:
            raise ValueError(f"precision={precision!r} is invalid: choose one of {', '.join(PRECISIONS)}")
        self.cfg = cfg
        self.backend = backend
        self.seed = seed
        self.precision = precision
        self.embed = Embedding(cfg)
        self.layers = nn.ModuleList(TransformerLayer(cfg, i) for i in range(cfg.n_layers))
        self.head = Head(cfg)
        self.stream_convs = StreamConvs(cfg) if cfg.residual == "msar" else None
        self.tie_embeddings()
        init_weights(self, cfg, seed)  # skips meta parameters: nothing to do on the meta device
        self.compiled = compile
        if compile:
            for layer in self.layers:
                # An MoE sublayer stays eager: its grouped shapes change with the routing every step.
                dense_mlp = () if isinstance(layer.mlp, MoE) else (layer.mlp,)
                for module in (layer.attn, *dense_mlp, layer.attn.read, layer.mlp.read):
                    module.compile(backend=compile_backend, dynamic=False)
            self.head.read.compile(backend=compile_backend, dynamic=False)

    def tie_embeddings(self) -> None:
        """Under `tie_embeddings` the LM head reads the token embedding's matrix (one parameter, named
        `embed.tok.weight`); again after the embedding is materialised (`pipeline.chunk`)."""
        if self.cfg.tie_embeddings:
            self.head.lm_head.weight = self.embed.tok.weight

    def forward(self, idx_BT: torch.Tensor, targets_BT: torch.Tensor | None = None, *,
                decode: DecodeStep | None = None) -> torch.Tensor:
        """`decode`: run idx as one pass of incremental decoding (its tokens at the pass's positions,
        attending to the cached earlier ones; see model.decode_state)."""
        if idx_BT.shape[1] > self.cfg.seq_len:
            raise ValueError(f"sequence of {idx_BT.shape[1]} tokens exceeds seq_len={self.cfg.seq_len}")
        with compute_context(self.precision, idx_BT.device.type):
            state = embed_state(self.cfg, self.embed, idx_BT, 0 if decode is None else decode.start)
            layers = dict(enumerate(self.layers))
            state = forward_sublayers(self.cfg, layers, self.stream_convs, state, range(self.cfg.n_sublayers),
                                      self.backend, decode)
            logits = self.head(state, self.stream_convs, self.backend, decode)
            return logits if targets_BT is None else lm_loss(logits, targets_BT)


def parameter_count(cfg: ModelConfig) -> int:
    """Closed-form parameter count (documented in docs/training.md; tests check it against the modules).

    embedding V d (+ seq d learned positions) (+ d r projected); per layer 2 d (norms)
    + d (d + 2 G E) (q, k, v with G kv heads of E) (+ 2 E qk-norm) + d (d + r_p) (out)
    + (2 under swiglu, else 1) d f + f (d + r_p); per reading site (L + 1 of them): attnres d,
    lr_attnres r, msar m d + m^2 d + 1 + m; head d (+ d V untied); msar convs (n_blocks + 1) d sum(kappa).
    An MoE sublayer replaces its layer's MLP: `moe_parameters`.
    """
    d, f, r_p = cfg.d_model, cfg.ff_dim, cfg.projected_key_rank
    count = cfg.vocab_size * d + d * r_p + (cfg.seq_len * d if cfg.positions == "learned" else 0)
    attention = d * (d + 2 * cfg.kv_heads * cfg.head_dim) + (2 * cfg.head_dim if cfg.qk_norm else 0) + d * (d + r_p)
    mlp = (2 if cfg.mlp == "swiglu" else 1) * d * f + f * (d + r_p)
    count += cfg.n_layers * (2 * d + attention) + (cfg.n_layers - cfg.n_moe_layers) * mlp
    count += cfg.n_moe_layers * moe_parameters(cfg, cfg.moe_experts)
    m = cfg.n_streams
    per_site = {"standard": 0, "attnres": d, "lr_attnres": cfg.key_rank, "msar": m * d + m * m * d + 1 + m}
    count += (cfg.n_sublayers + 1) * per_site[cfg.residual]
    count += d + (0 if cfg.tie_embeddings else d * cfg.vocab_size)
    if cfg.residual == "msar":
        count += (cfg.n_blocks + 1) * d * sum(cfg.stream_kernels)
    return count


def moe_parameters(cfg: ModelConfig, experts: int) -> int:
    """One MoE sublayer's parameters with `experts` routed experts counted (all E: the total; K: what
    one token uses, the active count): router d E and its bias E, and (experts + S) SwiGLU experts of
    width F, each 2 d F + F (d + r_p)."""
    d, f, r_p = cfg.d_model, cfg.expert_dim, cfg.projected_key_rank
    return d * cfg.moe_experts + cfg.moe_experts + (experts + cfg.moe_shared_experts) * (2 * d * f + f * (d + r_p))


def active_parameter_count(cfg: ModelConfig) -> int:
    """Parameters one token's forward uses: `parameter_count` with K of the E routed experts."""
    return parameter_count(cfg) - cfg.n_moe_layers * (moe_parameters(cfg, cfg.moe_experts)
                                                      - moe_parameters(cfg, cfg.moe_top_k))
