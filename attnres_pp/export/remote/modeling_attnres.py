"""An exported attnres-pp model for transformers (`trust_remote_code=True`): the forward of the
attnres-pp model family written out plainly, with the parameter names of attnres_pp's Transformer so
its weights load as saved.

Every sublayer (PreNorm attention, then MLP) reads its input from the sources before it: under
`standard` the residual sum; otherwise by depth attention, a softmax over the sources of the
pseudo-query times RMSNorm(key) (no gain), weighing the values. The sources are the embedding, the
sum of each completed block's outputs and the open block's partial sum; low-rank keys (`lr_attnres`)
are the value's last r channels (sliced) or r extra output columns, RMS-normalised as each output is
emitted (projected); MSAR reads m streams, causal depthwise convolutions of each source along the
sequence with that source's taps, and gates them into one. A final read feeds the output norm.
With experts, the MLP of every layer from `moe_dense_layers` on is a mixture of experts (`MoE`).

Attention reads a sliding window of `sliding_window` positions (the token's own included; None:
every earlier position), as `attnres-pp generate` does, so that generation past the trained length
gives its tokens; rotary positions continue past `seq_len`. Depth attention is per token and reads
no window; MSAR's convolutions read their taps back across the window's edge.

Imports only torch and transformers. Generation keeps transformers' key/value cache (`DynamicCache`
built from the config: with `sliding_window` set, each layer keeps its last sliding_window - 1
positions, `DynamicSlidingWindowLayer`) and, under MSAR, each reading site's convolution history on
the same object (`cache_attnres`), so a new token runs through the model alone; with
`use_cache=False` every step runs the whole sequence again (the same tokens, under the same banded
mask). Sequences hold at most `seq_len` tokens under learned positions, and padding is not supported
(a batch holds sequences of one length).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import transformers
from torch import nn
from transformers import DynamicCache, GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .cache_attnres import ConvHistory, past_length, reorder, site_history, window_mask
from .configuration_attnres import AttnResConfig

# The output's cache field: `cache` in transformers 5's later releases, `past_key_values` before.
_CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
# A tied LM head reads the token embedding's matrix; transformers 5 names the pair, 4 the tied one.
_TIED = {"head.lm_head.weight": "embed.tok.weight"}


def rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) over the last axis, in at least fp32 (no gain)."""
    x = x.to(torch.promote_types(x.dtype, torch.float32))
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (rms(x, self.eps) * self.weight).to(x.dtype)


def rotate(x: torch.Tensor, positions_T: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary positions, half-split (Llama's convention): x cos + [-x2, x1] sin."""
    half = x.shape[-1] // 2
    math = torch.promote_types(x.dtype, torch.float32)
    inv_freq = 1.0 / (theta ** (torch.arange(0, 2 * half, 2, device=x.device, dtype=torch.int64).to(math) / (2 * half)))
    angles = positions_T.to(math).unsqueeze(1) * inv_freq.unsqueeze(0)
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def width(cfg: AttnResConfig) -> int:
    """Numbers per token of a sublayer's output: d, plus r key columns under projected low-rank keys."""
    projected = cfg.residual == "lr_attnres" and cfg.key_mode == "projected"
    return cfg.d_model + (cfg.key_rank if projected else 0)


class DepthRead(nn.Module):
    """One reading site's pseudo-queries (and MSAR's stream gate)."""

    def __init__(self, cfg: AttnResConfig) -> None:
        super().__init__()
        self.cfg = cfg
        if cfg.residual == "msar":
            m, d = 1 + len(cfg.stream_kernels), cfg.d_model
            self.query = nn.Parameter(torch.zeros(m, d))
            self.gate_weight = nn.Parameter(torch.zeros(m * d, m))
            self.gate_alpha = nn.Parameter(torch.ones(()))
            self.gate_bias = nn.Parameter(torch.zeros(m))
        else:
            self.query = nn.Parameter(torch.zeros(cfg.key_rank if cfg.residual == "lr_attnres" else cfg.d_model))
        self.key_gain = nn.Parameter(torch.ones_like(self.query)) if cfg.key_norm_gain else None

    def scoring_query(self) -> torch.Tensor:
        return self.query if self.key_gain is None else self.query * self.key_gain

    def forward(self, sources: list[torch.Tensor], conv_ids: list[int], convs: nn.Module | None,
                history: ConvHistory | None = None) -> torch.Tensor:
        """h [B, T, d]: softmax over the sources (packed [B, T, W]) of q . RMSNorm(key), times the values.
        `history`: MSAR's earlier positions of each source at this site (generation with a cache)."""
        cfg, d = self.cfg, self.cfg.d_model
        if cfg.residual == "msar":
            return self._streams(sources, conv_ids, convs, history)
        values = [s[..., :d] for s in sources]
        if cfg.residual == "lr_attnres":
            keys = [s[..., d:] if cfg.key_mode == "projected" else s[..., d - cfg.key_rank:d] for s in sources]
        else:
            keys = values
        return self._attend(values, keys, self.scoring_query() * cfg.logit_scale)

    def _attend(self, values: list[torch.Tensor], keys: list[torch.Tensor], query: torch.Tensor) -> torch.Tensor:
        scores = torch.stack([rms(k, self.cfg.norm_eps) @ query.float() for k in keys], dim=-1)
        weights = torch.softmax(scores, dim=-1)
        return sum(weights[..., i:i + 1] * v.float() for i, v in enumerate(values)).to(values[0].dtype)

    def _streams(self, sources, conv_ids, convs, history) -> torch.Tensor:
        """MSAR: stream s reads causal-convolution views of the sources (over the kept positions too,
        then the new ones taken); a gate mixes the streams."""
        seq = sources[0].shape[1]
        full = sources if history is None else [history.extend(j, v) for v, j in zip(sources, conv_ids, strict=True)]
        queries, z = self.scoring_query(), []
        for s in range(queries.shape[0]):
            views = [v if s == 0 else convs.stream(j, s, f)[:, f.shape[1] - seq:]
                     for v, f, j in zip(sources, full, conv_ids, strict=True)]
            z.append(self._attend(views, views, queries[s]))
        flat = rms(torch.cat(z, dim=-1), self.cfg.norm_eps)
        gate = torch.sigmoid(self.gate_alpha * (flat @ self.gate_weight.float()) + self.gate_bias)
        return sum(gate[..., s:s + 1] * z_s.float() for s, z_s in enumerate(z)).to(z[0].dtype)


class StreamConvs(nn.Module):
    """MSAR's causal depthwise convolutions: weights[j][s-1] [kappa_s, d] for source j's stream s."""

    def __init__(self, cfg: AttnResConfig) -> None:
        super().__init__()
        self.weights = nn.ModuleList(
            nn.ParameterList(nn.Parameter(torch.full((k, cfg.d_model), 1.0 / k)) for k in cfg.stream_kernels)
            for _ in range(len(cfg.block_ends) + 1))

    def stream(self, source: int, s: int, v_BTD: torch.Tensor) -> torch.Tensor:
        """sum over delta < kappa of taps[delta] * v[t - delta], v[t < 0] = 0."""
        taps_KD, seq = self.weights[source][s - 1], v_BTD.shape[1]
        out = v_BTD * taps_KD[0]
        for delta in range(1, min(taps_KD.shape[0], seq)):
            out = out + F.pad(v_BTD[:, :seq - delta], (0, 0, delta, 0)) * taps_KD[delta]
        return out


class Attention(nn.Module):
    """One fused projection `qkv` of group + 2 equal row blocks of kv_heads heads each,
    [Q_0 | .. | Q_{group-1} | K | V], block Q_j holding query head g group + j of every kv head g
    (group = n_heads / kv_heads; query head h reads kv head h // group)."""

    def __init__(self, cfg: AttnResConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.head_dim, self.kv_heads = cfg.d_model // cfg.n_heads, cfg.n_kv_heads or cfg.n_heads
        self.group = cfg.n_heads // self.kv_heads
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.qkv = nn.Linear(cfg.d_model, (self.group + 2) * self.kv_heads * self.head_dim, bias=False)
        if cfg.qk_norm:
            self.q_norm, self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps), RMSNorm(self.head_dim, cfg.norm_eps)
        self.proj = nn.Linear(cfg.d_model, width(cfg), bias=False)
        if cfg.residual != "standard":
            self.read = DepthRead(cfg)

    def forward(self, h_BTD: torch.Tensor, cache=None, layer_idx: int = 0, past: int = 0) -> torch.Tensor:
        """`cache`: transformers' key/value cache, holding this layer's (`layer_idx`) positions before
        `past` (all, or a sliding window's last ones); the new positions attend to them and to each
        other causally, within the window (`window_mask`)."""
        cfg, (batch, seq, _), e, group = self.cfg, h_BTD.shape, self.head_dim, self.group
        blocks = self.qkv(self.norm(h_BTD)).view(batch, seq, group + 2, self.kv_heads, e)
        q = blocks[:, :, :group].permute(0, 3, 2, 1, 4).reshape(batch, cfg.n_heads, seq, e)
        k, v = blocks[:, :, group].transpose(1, 2), blocks[:, :, group + 1].transpose(1, 2)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if cfg.positions == "rope":
            positions = torch.arange(past, past + seq, device=h_BTD.device)
            q, k = rotate(q, positions, cfg.rope_theta), rotate(k, positions, cfg.rope_theta)
        if cache is not None:  # a sliding-window cache layer returns only its kept positions and these
            k, v = cache.update(k, v, layer_idx)
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, **window_mask(past, seq, k.shape[2], cfg.sliding_window, q.device))
        return self.proj(y.transpose(1, 2).reshape(batch, seq, cfg.d_model))


class MLP(nn.Module):
    """SwiGLU with one projection `gate_up` of rows [gate | up], or GELU with `up`."""

    def __init__(self, cfg: AttnResConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.swiglu = cfg.mlp == "swiglu"
        if self.swiglu:
            self.gate_up = nn.Linear(cfg.d_model, 2 * cfg.ff_dim, bias=False)
        else:
            self.up = nn.Linear(cfg.d_model, cfg.ff_dim, bias=False)
        self.down = nn.Linear(cfg.ff_dim, width(cfg), bias=False)
        if cfg.residual != "standard":
            self.read = DepthRead(cfg)

    def forward(self, h_BTD: torch.Tensor) -> torch.Tensor:
        x = self.norm(h_BTD)
        if not self.swiglu:
            return self.down(F.gelu(self.up(x)))
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


def swiglu(x: torch.Tensor, gate_up_2FD: torch.Tensor, down_WF: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(x, gate_up_2FD).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down_WF)


class Experts(nn.Module):
    """E SwiGLU experts stacked: `gate_up` [E, 2F, d] (rows [gate | up] of each), `down` [E, W, F]."""

    def __init__(self, cfg: AttnResConfig, experts: int) -> None:
        super().__init__()
        self.gate_up = nn.Parameter(torch.zeros(experts, 2 * cfg.moe_d_ff, cfg.d_model))
        self.down = nn.Parameter(torch.zeros(experts, width(cfg), cfg.moe_d_ff))


class MoE(nn.Module):
    """A mixture of experts in place of an MLP: the router's affinities a = softmax or sigmoid of
    x W_r (fp32) choose the top K experts of a + expert_bias, ties to the lower index (a stable
    sort; the bias only selects); the chosen affinities over their sum weight the chosen experts'
    outputs, summed in the order of choice, after the shared experts' (S experts as one SwiGLU of
    width S F, rows [gate | up]). Under projected low-rank keys every expert's down projection emits
    the r key columns too, combined with the same weights."""

    def __init__(self, cfg: AttnResConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.router = nn.Linear(cfg.d_model, cfg.moe_experts, bias=False)
        self.expert_bias = nn.Parameter(torch.zeros(cfg.moe_experts), requires_grad=False)
        self.experts = Experts(cfg, cfg.moe_experts)
        if cfg.moe_shared_experts:
            shared = cfg.moe_shared_experts * cfg.moe_d_ff
            self.shared = nn.Module()
            self.shared.gate_up = nn.Linear(cfg.d_model, 2 * shared, bias=False)
            self.shared.down = nn.Linear(shared, width(cfg), bias=False)
        if cfg.residual != "standard":
            self.read = DepthRead(cfg)

    def route(self, x_ND: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The chosen experts [N, K] and their gate weights [N, K] (at least fp32)."""
        math = torch.promote_types(x_ND.dtype, torch.float32)
        logits = F.linear(x_ND.to(math), self.router.weight.to(math))
        affinity = logits.softmax(-1) if self.cfg.moe_router == "softmax" else logits.sigmoid()
        score = affinity + self.expert_bias.to(math)
        expert_NK = torch.sort(score, dim=-1, descending=True, stable=True).indices[:, :self.cfg.moe_top_k]
        chosen = affinity.gather(1, expert_NK)
        return expert_NK, chosen / chosen.sum(-1, keepdim=True)

    def forward(self, h_BTD: torch.Tensor) -> torch.Tensor:
        x_ND = self.norm(h_BTD).reshape(-1, self.cfg.d_model)
        expert_NK, gate_NK = self.route(x_ND)
        y_NKW = x_ND.new_zeros(*expert_NK.shape, width(self.cfg))
        for e in range(self.cfg.moe_experts):  # each expert on the tokens that chose it
            token_M, slot_M = (expert_NK == e).nonzero(as_tuple=True)
            if len(token_M):
                y_NKW[token_M, slot_M] = swiglu(x_ND[token_M], self.experts.gate_up[e], self.experts.down[e])
        out_NW = (gate_NK.unsqueeze(-1).to(y_NKW.dtype) * y_NKW).sum(1)
        if self.cfg.moe_shared_experts:
            out_NW = swiglu(x_ND, self.shared.gate_up.weight, self.shared.down.weight) + out_NW
        return out_NW.view(*h_BTD.shape[:-1], -1)


class Layer(nn.Module):
    def __init__(self, cfg: AttnResConfig, index: int) -> None:
        super().__init__()
        moe = cfg.moe_experts > 0 and index >= cfg.moe_dense_layers
        self.attn, self.mlp = Attention(cfg), MoE(cfg) if moe else MLP(cfg)


class Embedding(nn.Module):
    def __init__(self, cfg: AttnResConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        if cfg.positions == "learned":
            self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        if width(cfg) > cfg.d_model:
            self.key_proj = nn.Linear(cfg.d_model, width(cfg) - cfg.d_model, bias=False)


class Head(nn.Module):
    def __init__(self, cfg: AttnResConfig) -> None:
        super().__init__()
        if cfg.residual != "standard":
            self.read = DepthRead(cfg)
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)


class AttnResForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = AttnResConfig
    base_model_prefix = "attnres"
    _no_split_modules = ["Layer"]
    _tied_weights_keys = _TIED if int(transformers.__version__.split(".")[0]) >= 5 else list(_TIED)

    def __init__(self, config: AttnResConfig) -> None:
        super().__init__(config)
        self.embed = Embedding(config)
        self.layers = nn.ModuleList(Layer(config, i) for i in range(config.n_layers))
        self.head = Head(config)
        self.stream_convs = StreamConvs(config) if config.residual == "msar" else None
        if config.tie_embeddings:
            self.head.lm_head.weight = self.embed.tok.weight
        self.post_init()

    def _reorder_cache(self, cache, beam_idx: torch.LongTensor):
        """Beam search's row order applied to the keys, values and MSAR's convolution history."""
        return reorder(cache, beam_idx)

    def _init_weights(self, module: nn.Module) -> None:
        """Nothing: every parameter comes from the exported weights."""

    def get_input_embeddings(self) -> nn.Module:
        return self.embed.tok

    def get_output_embeddings(self) -> nn.Module:
        return self.head.lm_head

    def hidden(self, idx_BT: torch.Tensor, cache=None) -> torch.Tensor:
        """The hidden state that enters the output norm, [B, T, d]; `cache` (generation) holds the
        sequence's earlier positions, `idx_BT` its next ones."""
        cfg, d, past = self.config, self.config.d_model, past_length(cache)
        if cfg.positions == "learned" and past + idx_BT.shape[1] > cfg.seq_len:
            raise ValueError(f"{past + idx_BT.shape[1]} tokens exceed the {cfg.seq_len} positions this model learned")
        o_emb = self.embed.tok(idx_BT)
        if cfg.positions == "learned":
            o_emb = o_emb + self.embed.pos(torch.arange(past, past + idx_BT.shape[1], device=idx_BT.device))
        sublayers = [getattr(layer, part) for layer in self.layers for part in ("attn", "mlp")]

        def run(l: int, h: torch.Tensor) -> torch.Tensor:  # attention sublayers read and extend the cache
            return sublayers[l](h, cache, l // 2, past) if l % 2 == 0 else sublayers[l](h)

        if cfg.residual == "standard":
            h = o_emb
            for l in range(len(sublayers)):
                h = h + run(l, h)
            return h
        keep = max(cfg.stream_kernels) - 1 if cfg.residual == "msar" else 0
        emit = width(cfg) > d  # projected keys are RMS-normalised as they are emitted, before block sums
        if emit:
            o_emb = torch.cat([o_emb, rms(self.embed.key_proj(o_emb), cfg.norm_eps).to(o_emb.dtype)], dim=-1)
        blocks, partial = [o_emb], None
        for l, sublayer in enumerate(sublayers):
            sources = blocks + ([] if partial is None else [partial])
            read = sublayer.read(sources, list(range(len(sources))), self.stream_convs, site_history(cache, l, keep))
            out = run(l, read)
            if emit:
                out = torch.cat([out[..., :d], rms(out[..., d:], cfg.norm_eps).to(out.dtype)], dim=-1)
            partial = out if partial is None else partial + out
            if l + 1 in cfg.block_ends:
                blocks, partial = blocks + [partial], None
        return self.head.read(blocks, list(range(len(blocks))), self.stream_convs,
                              site_history(cache, len(sublayers), keep))

    def forward(self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None,
                labels: torch.LongTensor | None = None, cache=None, past_key_values=None, use_cache: bool | None = None,
                **kwargs) -> CausalLMOutputWithPast:
        """Logits of `input_ids`' positions, and with `labels` the mean next-token loss (labels shifted
        inside, -100 ignored). `cache` (transformers 5; `past_key_values` before): the earlier positions'
        keys, values and convolution history, extended by these; `use_cache` without one starts one."""
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("padded batches are not supported: give sequences of one length, unpadded")
        cache = cache if cache is not None else past_key_values
        if cache is None and use_cache:  # per layer a sliding window of `sliding_window` positions, if set
            cache = DynamicCache(config=self.config)
        logits = self.head.lm_head(self.head.norm(self.hidden(input_ids, cache)))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, **({_CACHE_FIELD: cache} if cache is not None else {}))
