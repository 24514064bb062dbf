"""The sublayers of one transformer layer (PreNorm attention and MLP) and the RMSNorm they use.

Each sublayer returns its output packed with its raw low-rank key when keys are projected:
`[B, T, d + r]`, so that block sums of values and keys are one addition (docs/spec.md section 1.3). The key
is normalised where it is emitted into the depth state (`depth.emit_source`), not here, so these
modules stay plain projections.
"""

from __future__ import annotations

import hashlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from attnres_pp.model.config import ModelConfig
from attnres_pp.model.decode_state import KVSlot
from attnres_pp.model.depth import DepthRead
from attnres_pp.model.moe import MoE, RoutedExperts
from attnres_pp.model.norm import RMSNorm
from attnres_pp.model.rotary import apply_rotary, rotary_cos_sin


class Attention(nn.Module):
    """Causal self-attention: d -> d (+ r key columns), with `n_heads` query heads reading
    `kv_heads` key/value heads (query head h reads kv head h // group, group = n_heads / kv_heads,
    transformers' `repeat_kv`), an optional per-head RMSNorm on q and k, then rotary positions
    (docs/spec.md section 11).

    One fused projection `qkv` of `group + 2` equal row blocks of `kv_heads` heads each:
    `[Q_0 | .. | Q_{group-1} | K | V]`, where block Q_j holds query head g group + j of every kv
    head g. A tensor-parallel split by heads over every block (`pipeline.tensor_parallel`) then
    gives rank t its kv heads and exactly the query heads that read them, in one matrix product and
    one collective; with as many kv heads as query heads it is the `[q | k | v]` of multi-head
    attention."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.n_heads = cfg.n_heads
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.qkv = nn.Linear(cfg.d_model, cfg.qkv_parts * cfg.kv_heads * cfg.head_dim, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
        self.proj = nn.Linear(cfg.d_model, cfg.source_width, bias=False)
        self.read = DepthRead(cfg)

    def forward(self, h_BTD: torch.Tensor, kv: KVSlot | None = None) -> torch.Tensor:
        """`kv` (incremental decoding): this layer's cache; the T tokens of h sit at its pass's positions.

        Split over tensor-parallel ranks the projection returns this rank's heads' q, k and v
        (n_heads / T query heads, kv_heads / T kv heads) and, under sequence parallelism, the whole
        sequence gathered from the rank's shard `h_BTD`: both are read off its output's shape."""
        batch = h_BTD.shape[0]
        q_BHTE, k_BGTE, v_BGTE = self._heads(self.qkv(self.norm(h_BTD)))
        heads, seq = q_BHTE.shape[1], q_BHTE.shape[2]
        if self.cfg.qk_norm:
            q_BHTE, k_BGTE = self.q_norm(q_BHTE), self.k_norm(k_BGTE)
        if self.cfg.positions == "rope":
            start = 0 if kv is None else kv.step.start
            positions_T = torch.arange(start, start + seq, device=h_BTD.device)
            cos_TE, sin_TE = rotary_cos_sin(positions_T, self.cfg.head_dim, self.cfg.rope_theta, q_BHTE.dtype)
            q_BHTE, k_BGTE = apply_rotary(q_BHTE, cos_TE, sin_TE), apply_rotary(k_BGTE, cos_TE, sin_TE)
        grouped = {"enable_gqa": True} if k_BGTE.shape[1] != heads else {}
        if kv is None:
            y_BHTE = F.scaled_dot_product_attention(q_BHTE, k_BGTE, v_BGTE, is_causal=True, **grouped)
        else:
            k_BGSE, v_BGSE = kv.append(k_BGTE, v_BGTE)
            y_BHTE = F.scaled_dot_product_attention(q_BHTE, k_BGSE, v_BGSE, **kv.sdpa_mask(h_BTD.device), **grouped)
        return self.proj(y_BHTE.transpose(1, 2).reshape(batch, seq, heads * self.cfg.head_dim))

    def _heads(self, qkv_BTC: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q `[B, H, T, E]` (query head g group + j at index g group + j), k and v `[B, G, T, E]`
        of the heads this rank holds."""
        batch, seq, width = qkv_BTC.shape
        parts, head_dim = self.cfg.qkv_parts, self.cfg.head_dim
        kv_heads = width // (parts * head_dim)
        qkv_BTPGE = qkv_BTC.view(batch, seq, parts, kv_heads, head_dim)
        # Grouped heads: a copy into head order, laid out [B, T, H, E] as a view of the projection
        # would be (attention's output then follows it, and the output projection reads a view).
        q_BTHE = qkv_BTPGE[:, :, :parts - 2].transpose(2, 3).reshape(batch, seq, kv_heads * (parts - 2), head_dim)
        q_BHTE = q_BTHE.transpose(1, 2)
        k_BGTE, v_BGTE = qkv_BTPGE[:, :, parts - 2].transpose(1, 2), qkv_BTPGE[:, :, parts - 1].transpose(1, 2)
        return q_BHTE, k_BGTE, v_BGTE


class MLP(nn.Module):
    """SwiGLU (`down(silu(gate x) * up x)`) or GELU (`down(gelu(up x))`) MLP: d -> d_ff -> d (+ r key
    columns: under projected low-rank keys the down projection emits them, the LR-AttnRes paper's
    equation 12). SwiGLU's gate and up are one projection `gate_up` of rows `[gate | up]`, split
    over tensor-parallel ranks by hidden unit in both halves: one matrix product, one collective."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        if cfg.mlp == "swiglu":
            self.gate_up = nn.Linear(cfg.d_model, 2 * cfg.ff_dim, bias=False)
        else:
            self.up = nn.Linear(cfg.d_model, cfg.ff_dim, bias=False)
        self.down = nn.Linear(cfg.ff_dim, cfg.source_width, bias=False)
        self.read = DepthRead(cfg)
        self.swiglu = cfg.mlp == "swiglu"

    def forward(self, h_BTD: torch.Tensor) -> torch.Tensor:
        x_BTD = self.norm(h_BTD)
        if not self.swiglu:
            return self.down(F.gelu(self.up(x_BTD)))
        gate_BTF, up_BTF = self.gate_up(x_BTD).chunk(2, dim=-1)
        return self.down(F.silu(gate_BTF) * up_BTF)


class TransformerLayer(nn.Module):
    """Two sublayers; sublayer 2i is layer i's attention, 2i + 1 its MLP (an MoE sublayer from
    `moe_dense_layers` on when the model has experts, `model.moe`)."""

    def __init__(self, cfg: ModelConfig, index: int = 0) -> None:
        super().__init__()
        self.attn = Attention(cfg)
        self.mlp = MoE(cfg) if cfg.is_moe_layer(index) else MLP(cfg)

    def sublayer(self, which: int) -> Attention | MLP | MoE:
        return self.mlp if which else self.attn


class Embedding(nn.Module):
    """Token embedding (+ a learned position table under `positions = learned`; rotary positions
    enter in attention); under projected keys also the embedding key (d -> r)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model) if cfg.positions == "learned" else None
        self.key_proj = nn.Linear(cfg.d_model, cfg.projected_key_rank, bias=False) if cfg.projected_key_rank else None

    def forward(self, idx_BT: torch.Tensor, start: int = 0) -> torch.Tensor:
        """`start`: the position of the first token (incremental decoding)."""
        o_emb_BTD = self.tok(idx_BT)
        if self.pos is not None:
            o_emb_BTD = o_emb_BTD + self.pos(torch.arange(start, start + idx_BT.shape[1], device=idx_BT.device))
        if self.key_proj is None:
            return o_emb_BTD
        return torch.cat([o_emb_BTD, self.key_proj(o_emb_BTD)], dim=-1)


def parameter_seed(seed: int, name: str) -> int:
    """The random stream of parameter `name` (its whole-model name) in a run seeded with `seed`.

    A stable hash, not Python's salted `hash`, so every process and every rank agrees on it."""
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def _init_value(module_name: str, module: nn.Module, param_name: str, shape: torch.Size, cfg: ModelConfig,
                generator: torch.Generator, seed: int) -> torch.Tensor:
    """The initial float32 value of `module.<param_name>`; `module_name` is the module's whole-model name."""
    if isinstance(module, nn.Linear | nn.Embedding):
        std = cfg.init_std
        # GPT-2: output projections scaled by 1/sqrt(2 n_layers) so the sums of sublayer outputs stay O(1).
        if module_name.endswith(("attn.proj", "down")):
            std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
        return torch.empty(shape).normal_(0.0, std, generator=generator)
    if isinstance(module, RoutedExperts):
        # One stream per expert, by its global index: a rank holding a slice of the experts
        # (expert parallelism) draws exactly the single process's values for them.
        std = cfg.init_std / math.sqrt(2 * cfg.n_layers) if param_name == "down" else cfg.init_std
        return torch.stack([
            torch.empty(shape[1:]).normal_(0.0, std, generator=torch.Generator().manual_seed(
                parameter_seed(seed, f"{module_name}.{param_name}.{module.first_expert + e}")))
            for e in range(shape[0])])
    if isinstance(module, MoE):  # the aux-free selection bias
        return torch.zeros(shape)
    if isinstance(module, RMSNorm):
        return torch.ones(shape)
    if isinstance(module, DepthRead):
        # Zero queries make every read a plain mean at step 0; gates start at sigmoid(0) = 0.5.
        return torch.ones(shape) if param_name in ("gate_alpha", "key_gain") else torch.zeros(shape)
    if module_name.startswith("stream_convs."):
        return torch.full(shape, 1.0 / shape[0])  # causal moving average over kappa = shape[0] taps
    raise ValueError(f"no initialisation rule for parameter {module_name}.{param_name} "
                     f"({type(module).__name__}): add one to attnres_pp.model.layers.init_weights")


@torch.no_grad()
def init_weights(model: nn.Module, cfg: ModelConfig, seed: int) -> None:
    """Initialise every materialised parameter of `model` (a whole Transformer, possibly on the meta
    device in part) from its whole-model name and `seed` alone.

    Each parameter draws from its own generator, seeded by (seed, name): its value does not depend
    on which other parameters a process holds or in which order they are built, so a pipeline rank
    that materialises only its own chunks gets exactly the single-process model's values. Values are
    drawn in float32 on the CPU and then copied, so they do not depend on the device or dtype either.
    Parameters still on the meta device (other ranks' chunks) are skipped.
    """
    seen = set()  # a tied parameter (the LM head's, under tie_embeddings) by its first name only
    for module_name, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            if param.is_meta or id(param) in seen:
                continue
            seen.add(id(param))
            name = f"{module_name}.{param_name}" if module_name else param_name
            generator = torch.Generator().manual_seed(parameter_seed(seed, name))
            param.copy_(_init_value(module_name, module, param_name, param.shape, cfg, generator, seed))


def split_qkv_rows(cfg: ModelConfig, qkv_Rd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused qkv weight's query, key and value rows in head order (`[H E, d]`, `[G E, d]`,
    `[G E, d]`: transformers' q_proj, k_proj, v_proj), from its blocks `[Q_0 | .. | K | V]`."""
    parts, kv_heads, head_dim = cfg.qkv_parts, cfg.kv_heads, cfg.head_dim
    blocks_PGEd = qkv_Rd.reshape(parts, kv_heads, head_dim, -1)
    q_Rd = blocks_PGEd[:parts - 2].transpose(0, 1).reshape(cfg.n_heads * head_dim, -1)
    return q_Rd, blocks_PGEd[parts - 2].reshape(kv_heads * head_dim, -1), blocks_PGEd[parts - 1].reshape(
        kv_heads * head_dim, -1)


def fuse_qkv_rows(cfg: ModelConfig, q_Rd: torch.Tensor, k_Rd: torch.Tensor, v_Rd: torch.Tensor) -> torch.Tensor:
    """The inverse of `split_qkv_rows`."""
    group, kv_heads, head_dim = cfg.qkv_parts - 2, cfg.kv_heads, cfg.head_dim
    q_JGEd = q_Rd.reshape(kv_heads, group, head_dim, -1).transpose(0, 1)
    kv_2GEd = torch.stack([k_Rd.reshape(kv_heads, head_dim, -1), v_Rd.reshape(kv_heads, head_dim, -1)])
    return torch.cat([q_JGEd, kv_2GEd]).reshape(cfg.qkv_parts * kv_heads * head_dim, -1)
