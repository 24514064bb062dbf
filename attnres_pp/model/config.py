"""ModelConfig: the frozen, validated description of one model of the family (docs/spec.md section 1).

Also owns the block bookkeeping every other part shares: which sources sublayer `l` reads, when a
block completes, how many sources the final read sees.
"""

from __future__ import annotations

import bisect
import functools
import math
from dataclasses import dataclass, field

from attnres_pp.config_tables import from_table, to_table

RESIDUALS = ("standard", "attnres", "lr_attnres", "msar")
KEY_MODES = ("projected", "sliced")
POSITIONS = ("rope", "learned")
MLPS = ("swiglu", "gelu")
MOE_ROUTERS = ("softmax", "sigmoid")
MOE_BALANCES = ("aux_free", "aux_loss", "none")
# The layer recipe of every checkpoint written before the recipe was configurable (docs/spec.md
# section 11): a saved [model] table without these keys was trained with these values, whatever
# today's defaults are (`train.checkpoint_meta.read_meta` fills them in).
LEGACY_RECIPE = {"positions": "learned", "mlp": "gelu", "n_kv_heads": 0, "qk_norm": False, "tie_embeddings": False}


def _fail(field_name: str, value, fix: str) -> None:
    raise ValueError(f"ModelConfig.{field_name}={value!r} is invalid: {fix}")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """One model of the family. `block_size` counts sublayers (two per transformer layer); `blocks` > 0
    names the number of blocks N instead (docs/spec.md section 1.2: block i ends after sublayer ceil(L i / N)) and then
    decides the boundaries alone. `key_norm_gain` adds a learned gain (init 1) to the key RMSNorm.

    The layer recipe (docs/spec.md section 11): `positions` rope (q and k rotated, base `rope_theta`)
    or learned (a position table); `mlp` swiglu or gelu; `n_kv_heads` key/value heads (0: as many as
    query heads); `qk_norm` a per-head RMSNorm on q and k; `tie_embeddings` the LM head reads the
    token embedding's matrix.

    Mixtures of experts (docs/spec.md section 12): with `moe_experts` E > 0 the MLP of every layer
    from `moe_dense_layers` on is an MoE sublayer of E routed SwiGLU experts of width `moe_d_ff`, of
    which each token reaches `moe_top_k`, plus `moe_shared_experts` that every token reaches;
    `moe_router` softmax or sigmoid affinities; `moe_balance` aux_free (a selection bias moved by
    `moe_bias_gamma` after each step), aux_loss (`moe_aux_loss_coef`) or none; `moe_seq_aux_coef` > 0
    adds the sequence-wise balance loss beside any of them; `moe_router_lr_scale` the routers'
    learning rate as a fraction of the run's."""

    vocab_size: int = 256
    n_layers: int = 4
    d_model: int = 64
    n_heads: int = 4
    d_ff: int = 0  # 0: 64 * ceil(8 d / 3 / 64) under swiglu, 4 * d_model under gelu
    seq_len: int = 64
    residual: str = "attnres"
    block_size: int = 2
    blocks: int = 0  # 0: blocks of block_size sublayers
    key_mode: str = "projected"
    key_rank: int = 8
    logit_scale: float = 1.0
    stream_kernels: tuple[int, ...] = field(default=(4, 8, 12))
    norm_eps: float = 1e-6
    init_std: float = 0.02
    key_norm_gain: bool = False
    positions: str = "rope"
    rope_theta: float = 10000.0
    mlp: str = "swiglu"
    n_kv_heads: int = 0  # 0: n_heads (multi-head attention)
    qk_norm: bool = False
    tie_embeddings: bool = False
    moe_experts: int = 0  # 0: every MLP dense
    moe_top_k: int = 2
    moe_shared_experts: int = 0
    moe_d_ff: int = 0  # 0: d_ff / 4 rounded up to 64 (fine-grained experts)
    moe_dense_layers: int = 0
    moe_router: str = "softmax"
    moe_balance: str = "aux_free"
    moe_aux_loss_coef: float = 1e-2
    moe_bias_gamma: float = 1e-3
    moe_seq_aux_coef: float = 0.0  # 0: no sequence-wise balance loss
    moe_router_lr_scale: float = 1.0  # the routers' learning rate as a fraction of the run's

    def __post_init__(self) -> None:
        positive = ("vocab_size", "n_layers", "d_model", "n_heads", "seq_len")
        for name in positive:
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                _fail(name, value, "must be an integer >= 1")
        if self.d_model % self.n_heads:
            _fail("n_heads", self.n_heads, f"must divide d_model={self.d_model} (e.g. a power of two)")
        if not _is_int(self.d_ff) or self.d_ff < 0:
            _fail("d_ff", self.d_ff, "must be >= 1, or 0 for the recipe's default (SwiGLU 8 d / 3 rounded up "
                  "to 64, GELU 4 d)")
        self._check_recipe()
        self._check_moe()
        if self.residual not in RESIDUALS:
            _fail("residual", self.residual, f"choose one of {', '.join(RESIDUALS)}")
        if not _is_int(self.block_size) or self.block_size < 1:
            _fail("block_size", self.block_size, "must be an integer >= 1 (1 = Full AttnRes)")
        if self.block_size > self.n_sublayers:
            _fail("block_size", self.block_size,
                  f"must be <= 2 * n_layers = {self.n_sublayers} (block_size counts sublayers)")
        if not _is_int(self.blocks) or not 0 <= self.blocks <= self.n_sublayers:
            _fail("blocks", self.blocks, f"must be an integer in 1..2 * n_layers = {self.n_sublayers} "
                  "(the number of blocks N), or 0 to use block_size")
        if not isinstance(self.key_norm_gain, bool):
            _fail("key_norm_gain", self.key_norm_gain, "must be true or false")
        if self.key_mode not in KEY_MODES:
            _fail("key_mode", self.key_mode, f"choose one of {', '.join(KEY_MODES)}")
        if not _is_int(self.key_rank) or self.key_rank < 1:
            _fail("key_rank", self.key_rank, "must be an integer >= 1 (the r of lr_attnres's low-rank keys)")
        if self.residual == "lr_attnres" and self.key_rank > self.d_model:
            _fail("key_rank", self.key_rank, f"must be in 1..d_model={self.d_model}")
        for name, example in (("logit_scale", "1.0"), ("norm_eps", "1e-6"), ("init_std", "0.02")):
            value = getattr(self, name)
            if not _is_real(value) or value <= 0:
                _fail(name, value, f"must be a finite number > 0, e.g. {example}")
        if not self.stream_kernels or any(not _is_int(k) or k < 1 for k in self.stream_kernels):
            _fail("stream_kernels", self.stream_kernels, "must be a non-empty tuple of integers >= 1")

    def _check_recipe(self) -> None:
        if self.positions not in POSITIONS:
            _fail("positions", self.positions, f"choose one of {', '.join(POSITIONS)}")
        if self.mlp not in MLPS:
            _fail("mlp", self.mlp, f"choose one of {', '.join(MLPS)}")
        if not _is_real(self.rope_theta) or self.rope_theta <= 0:
            _fail("rope_theta", self.rope_theta, "must be a finite number > 0, e.g. 10000 (--rope-theta)")
        if self.positions == "rope" and self.head_dim % 2:
            _fail("positions", self.positions, f"rotary positions need an even head dimension, and d_model / "
                  f"n_heads = {self.head_dim}: choose --d-model and --heads so it is even")
        if not _is_int(self.n_kv_heads) or self.n_kv_heads < 0 or (self.n_kv_heads and self.n_heads % self.n_kv_heads):
            _fail("n_kv_heads", self.n_kv_heads, f"must divide the {self.n_heads} query heads (--kv-heads: equal is "
                  "multi-head attention, 1 is multi-query), or 0 for as many as query heads")
        for name in ("qk_norm", "tie_embeddings"):
            if not isinstance(getattr(self, name), bool):
                _fail(name, getattr(self, name), "must be true or false")

    def _check_moe(self) -> None:
        e = self.moe_experts
        if not _is_int(e) or e < 0:
            _fail("moe_experts", e, "must be an integer >= 0 (--moe-experts: routed experts per MoE layer, 0 = dense)")
        if not e:
            return
        if not _is_int(self.moe_top_k) or not 1 <= self.moe_top_k <= e:
            _fail("moe_top_k", self.moe_top_k, f"must be in 1..{e}, the routed experts "
                  "(--moe-top-k K <= --moe-experts)")
        if not _is_int(self.moe_shared_experts) or self.moe_shared_experts < 0:
            _fail("moe_shared_experts", self.moe_shared_experts, "must be an integer >= 0 (--moe-shared-experts)")
        if not _is_int(self.moe_d_ff) or self.moe_d_ff < 0:
            _fail("moe_d_ff", self.moe_d_ff, "must be >= 1, or 0 for the default d_ff / 4 rounded up to 64 "
                  "(--moe-d-ff)")
        if not _is_int(self.moe_dense_layers) or not 0 <= self.moe_dense_layers < self.n_layers:
            _fail("moe_dense_layers", self.moe_dense_layers, f"must be in 0..{self.n_layers - 1}: the first N "
                  f"of the {self.n_layers} layers keep a dense MLP and at least one must be MoE "
                  "(--moe-dense-layers < --layers)")
        if self.moe_router not in MOE_ROUTERS:
            _fail("moe_router", self.moe_router, f"choose one of {', '.join(MOE_ROUTERS)} (--moe-router)")
        if self.moe_balance not in MOE_BALANCES:
            _fail("moe_balance", self.moe_balance, f"choose one of {', '.join(MOE_BALANCES)} (--moe-balance)")
        for name, flag in (("moe_aux_loss_coef", "--moe-aux-loss-coef"), ("moe_bias_gamma", "--moe-bias-gamma"),
                           ("moe_seq_aux_coef", "--moe-seq-aux-coef")):
            value = getattr(self, name)
            if not _is_real(value) or value < 0:
                _fail(name, value, f"must be a finite number >= 0 ({flag})")
        if not _is_real(self.moe_router_lr_scale) or not 0 < self.moe_router_lr_scale <= 1:
            _fail("moe_router_lr_scale", self.moe_router_lr_scale, "must be in (0, 1]: the routers' learning rate "
                  "as a fraction of --lr (--moe-router-lr-scale)")

    @classmethod
    def from_dict(cls, values: dict) -> ModelConfig:
        return from_table(cls, values, table="model")

    def to_dict(self) -> dict:
        return to_table(self, list_fields=("stream_kernels",))

    def check_tensor_split(self, tensor_parallel: int, *, sequence_parallel: bool, whose: str = "") -> None:
        """ValueError naming the first rule of docs/spec.md section 10 that `tensor_parallel` = T
        ranks per layer break: each takes 1/T of the heads and of the MLP's hidden units, and under
        sequence parallelism 1/T of every sequence, with at least MSAR's halo in each shard. The one
        check of the split for training, generation, the runtime and the simulator; `whose` names
        the model in the message ("the checkpoint's ")."""
        t = tensor_parallel
        if t == 1:
            return
        if self.n_heads % t:
            raise ValueError(f"--tensor-parallel {t} does not divide {whose or 'the '}{self.n_heads} heads (--heads): "
                             "each tp rank runs 1/T of the heads; choose T dividing the head count")
        if self.kv_heads % t:
            raise ValueError(f"--tensor-parallel {t} does not divide {whose or 'the '}{self.kv_heads} key/value heads "
                             "(--kv-heads): each tp rank holds 1/T of them with the query heads that read them; "
                             "choose T dividing the kv head count")
        if self.ff_dim % t:
            raise ValueError(f"--tensor-parallel {t} does not divide d_ff = {self.ff_dim} ([model] d_ff, the "
                             "recipe's default when 0): each tp rank holds 1/T of the MLP's hidden units; choose T "
                             "dividing d_ff")
        if sequence_parallel and self.seq_len % t:
            raise ValueError(f"--tensor-parallel {t} does not divide --seq-len {self.seq_len}: sequence parallelism "
                             "gives each tp rank 1/T of every sequence; choose T dividing it, or give "
                             "--no-sequence-parallel")
        halo = max(self.stream_kernels) - 1 if self.residual == "msar" else 0
        if sequence_parallel and self.seq_len // t < halo:
            raise ValueError(f"--tensor-parallel {t} splits --seq-len {self.seq_len} into shards of "
                             f"{self.seq_len // t} tokens, fewer than the {halo} that MSAR's widest causal "
                             "convolution reads before each (kappa_max - 1, from the previous tp rank): give a "
                             "longer --seq-len, a smaller T, or --no-sequence-parallel")

    # ---- derived sizes ----
    @property
    def ff_dim(self) -> int:
        if self.d_ff:
            return self.d_ff
        if self.mlp == "swiglu":  # 8 d / 3 keeps SwiGLU's three matrices at GELU's two's parameters
            return 64 * -(-8 * self.d_model // (3 * 64))
        return 4 * self.d_model

    @property
    def expert_dim(self) -> int:
        """Hidden width of one routed or shared expert (SwiGLU)."""
        if self.moe_d_ff:
            return self.moe_d_ff
        return 64 * -(-self.ff_dim // (4 * 64))

    @property
    def moe(self) -> bool:
        return self.moe_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        """Whether transformer layer `layer`'s MLP sublayer is an MoE sublayer."""
        return self.moe and layer >= self.moe_dense_layers

    @property
    def n_moe_layers(self) -> int:
        return self.n_layers - self.moe_dense_layers if self.moe else 0

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        """Key/value heads: query head h reads kv head h // (n_heads / kv_heads)."""
        return self.n_kv_heads or self.n_heads

    @property
    def qkv_parts(self) -> int:
        """Row blocks of the fused qkv projection (`layers.Attention`): n_heads / kv_heads query
        blocks, then k and v, each of kv_heads heads."""
        return self.n_heads // self.kv_heads + 2

    @property
    def n_sublayers(self) -> int:
        return 2 * self.n_layers

    @property
    def uses_depth_attention(self) -> bool:
        return self.residual != "standard"

    @property
    def projected_key_rank(self) -> int:
        """Extra width each source carries: r under projected low-rank keys, else 0."""
        if self.residual == "lr_attnres" and self.key_mode == "projected":
            return self.key_rank
        return 0

    @property
    def source_width(self) -> int:
        """Numbers per token of one source tensor as stored and sent (d, or d + r)."""
        return self.d_model + self.projected_key_rank

    @property
    def query_dim(self) -> int:
        return self.key_rank if self.residual == "lr_attnres" else self.d_model

    @property
    def n_streams(self) -> int:
        return 1 + len(self.stream_kernels) if self.residual == "msar" else 1

    @property
    def block_ends(self) -> tuple[int, ...]:
        """Where each block b_1..b_N ends: block j holds sublayers block_ends[j-2] .. block_ends[j-1] - 1
        (from 0 for j = 1); the last entry is L (a short trailing block counts)."""
        return block_ends_of(self.n_sublayers, block_size=self.block_size, blocks=self.blocks)

    @property
    def n_blocks(self) -> int:
        """Completed blocks after the last sublayer (a short trailing block counts)."""
        return len(self.block_ends)


@functools.cache  # a few distinct shapes, asked for by every feature of the planner's memory model
def block_ends_of(n_sublayers: int, *, block_size: int = 1, blocks: int = 0) -> tuple[int, ...]:
    """Block boundaries of docs/spec.md section 1.2: with `blocks` = N > 0, block i (1-based) ends after sublayer
    ceil(L i / N), spreading the remainder; otherwise every `block_size` sublayers, the last block short."""
    if blocks:
        return tuple(-(-n_sublayers * i // blocks) for i in range(1, blocks + 1))
    return tuple(min(end, n_sublayers) for end in range(block_size, n_sublayers + block_size, block_size))


def completed_blocks(sublayers_done: int, block_ends: tuple[int, ...]) -> int:
    """Blocks b_1..b_n complete once the first `sublayers_done` sublayers have run."""
    return bisect.bisect_right(block_ends, sublayers_done)


def block_of(sublayer: int, block_ends: tuple[int, ...]) -> int:
    """1-based source index of the block that sublayer `sublayer` contributes to."""
    return completed_blocks(sublayer, block_ends) + 1


def block_stop(sublayer: int, block_ends: tuple[int, ...]) -> int:
    """One past the last sublayer of the block that `sublayer` belongs to."""
    return block_ends[block_of(sublayer, block_ends) - 1]


def completes_block(sublayer: int, block_ends: tuple[int, ...]) -> bool:
    """True if `sublayer` is the last of its block (the model's last sublayer always is)."""
    return block_stop(sublayer, block_ends) == sublayer + 1


def has_partial_before(sublayer: int, block_ends: tuple[int, ...]) -> bool:
    """True if sublayer `sublayer` reads an open partial (it is not its block's first)."""
    return sublayer != 0 and sublayer not in block_ends
