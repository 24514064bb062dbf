"""The config of an exported attnres-pp model: the fields of attnres_pp's ModelConfig under their own
names (block boundaries and sizes resolved), beside the ones transformers reads."""

from __future__ import annotations

from transformers import PretrainedConfig


class AttnResConfig(PretrainedConfig):
    model_type = "attnres_pp"

    def __init__(self, vocab_size: int = 256, n_layers: int = 4, d_model: int = 64, n_heads: int = 4,
                 n_kv_heads: int = 0, ff_dim: int = 192, seq_len: int = 64, residual: str = "attnres",
                 block_ends: list | None = None, key_mode: str = "projected", key_rank: int = 8,
                 logit_scale: float = 1.0, stream_kernels: list | None = None, norm_eps: float = 1e-6,
                 key_norm_gain: bool = False, positions: str = "rope", rope_theta: float = 10000.0,
                 mlp: str = "swiglu", qk_norm: bool = False, tie_embeddings: bool = False, **kwargs) -> None:
        self.n_layers, self.d_model, self.n_heads, self.n_kv_heads = n_layers, d_model, n_heads, n_kv_heads
        self.ff_dim, self.seq_len, self.residual = ff_dim, seq_len, residual
        self.block_ends = list(block_ends or [2 * n_layers])
        self.key_mode, self.key_rank, self.logit_scale = key_mode, key_rank, logit_scale
        self.stream_kernels = list(stream_kernels or [4, 8, 12])
        self.norm_eps, self.key_norm_gain, self.positions = norm_eps, key_norm_gain, positions
        self.rope_theta, self.mlp, self.qk_norm, self.tie_embeddings = rope_theta, mlp, qk_norm, tie_embeddings
        # The names transformers itself reads (generation, size reports).
        self.vocab_size, self.hidden_size, self.num_hidden_layers = vocab_size, d_model, n_layers
        self.num_attention_heads, self.max_position_embeddings = n_heads, seq_len
        kwargs["tie_word_embeddings"] = tie_embeddings
        super().__init__(**kwargs)
