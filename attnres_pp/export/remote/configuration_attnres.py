"""The config of an exported attnres-pp model: the fields of attnres_pp's ModelConfig under their own
names (block boundaries and sizes resolved), beside the ones transformers reads. `moe_experts` > 0:
the MLP of every layer from `moe_dense_layers` on is a mixture of experts of width `moe_d_ff`.
`sliding_window` W: a token attends to the keys of the last W positions, itself included (as
`attnres-pp generate --window W`; the export writes its window, by default the trained seq_len);
None attends to every earlier position. transformers' generate reads it too: its cache then keeps a
sliding window per layer (`DynamicSlidingWindowLayer`)."""

from __future__ import annotations

from transformers import PretrainedConfig


class AttnResConfig(PretrainedConfig):
    model_type = "attnres_pp"

    def __init__(self, vocab_size: int = 256, n_layers: int = 4, d_model: int = 64, n_heads: int = 4,
                 n_kv_heads: int = 0, ff_dim: int = 192, seq_len: int = 64, residual: str = "attnres",
                 block_ends: list | None = None, key_mode: str = "projected", key_rank: int = 8,
                 logit_scale: float = 1.0, stream_kernels: list | None = None, norm_eps: float = 1e-6,
                 key_norm_gain: bool = False, positions: str = "rope", rope_theta: float = 10000.0,
                 mlp: str = "swiglu", qk_norm: bool = False, tie_embeddings: bool = False, moe_experts: int = 0,
                 moe_top_k: int = 0, moe_shared_experts: int = 0, moe_d_ff: int = 0, moe_dense_layers: int = 0,
                 moe_router: str = "softmax", sliding_window: int | None = None, **kwargs) -> None:
        self.n_layers, self.d_model, self.n_heads, self.n_kv_heads = n_layers, d_model, n_heads, n_kv_heads
        self.ff_dim, self.seq_len, self.residual = ff_dim, seq_len, residual
        self.block_ends = list(block_ends or [2 * n_layers])
        self.key_mode, self.key_rank, self.logit_scale = key_mode, key_rank, logit_scale
        self.stream_kernels = list(stream_kernels or [4, 8, 12])
        self.norm_eps, self.key_norm_gain, self.positions = norm_eps, key_norm_gain, positions
        self.rope_theta, self.mlp, self.qk_norm, self.tie_embeddings = rope_theta, mlp, qk_norm, tie_embeddings
        self.moe_experts, self.moe_top_k, self.moe_shared_experts = moe_experts, moe_top_k, moe_shared_experts
        self.moe_d_ff, self.moe_dense_layers, self.moe_router = moe_d_ff, moe_dense_layers, moe_router
        if sliding_window is not None and (isinstance(sliding_window, bool) or not isinstance(sliding_window, int)
                                           or sliding_window < 1):
            raise ValueError(f"sliding_window must be an integer >= 1 or null, got {sliding_window!r}")
        self.sliding_window = sliding_window
        # The names transformers itself reads (generation, size reports).
        self.vocab_size, self.hidden_size, self.num_hidden_layers = vocab_size, d_model, n_layers
        self.num_attention_heads, self.max_position_embeddings = n_heads, seq_len
        kwargs["tie_word_embeddings"] = tie_embeddings
        super().__init__(**kwargs)
