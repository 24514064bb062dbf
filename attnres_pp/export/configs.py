"""config.json and generation_config.json of an exported folder, and the code files an AttnRes folder
carries: a model of the Llama recipe is transformers' own class (`train.hf_llama`; a mixture of
experts Mixtral or Qwen3-MoE, `train.hf_moe`), every other one `AttnResForCausalLM` from `remote/`,
named in config.json's `auto_map`."""

from __future__ import annotations

import shutil
from pathlib import Path

from attnres_pp.model.config import ModelConfig
from attnres_pp.train.hf_moe import hf_config

REMOTE = Path(__file__).parent / "remote"
CODE_FILES = ("configuration_attnres.py", "cache_attnres.py", "modeling_attnres.py")
AUTO_MAP = {"AutoConfig": "configuration_attnres.AttnResConfig",
            "AutoModelForCausalLM": "modeling_attnres.AttnResForCausalLM"}


def remote_config(cfg: ModelConfig, window: int | None = None) -> dict:
    """config.json of `AttnResForCausalLM`: ModelConfig's fields as its config reads them (block
    boundaries and sizes resolved, so the code needs none of ModelConfig's rules), and the attention
    window `attnres-pp generate` slides (`--window`; None: the trained seq_len, its default) as
    `sliding_window`, so that transformers' generate gives its tokens past seq_len too."""
    return {
        "architectures": ["AttnResForCausalLM"], "model_type": "attnres_pp", "auto_map": dict(AUTO_MAP),
        "vocab_size": cfg.vocab_size, "n_layers": cfg.n_layers, "d_model": cfg.d_model, "n_heads": cfg.n_heads,
        "n_kv_heads": cfg.kv_heads, "ff_dim": cfg.ff_dim, "seq_len": cfg.seq_len, "residual": cfg.residual,
        "block_ends": list(cfg.block_ends), "key_mode": cfg.key_mode, "key_rank": cfg.key_rank,
        "logit_scale": cfg.logit_scale, "stream_kernels": list(cfg.stream_kernels), "norm_eps": cfg.norm_eps,
        "key_norm_gain": cfg.key_norm_gain, "positions": cfg.positions, "rope_theta": cfg.rope_theta,
        "mlp": cfg.mlp, "qk_norm": cfg.qk_norm, "tie_embeddings": cfg.tie_embeddings,
        "tie_word_embeddings": cfg.tie_embeddings, "use_cache": True, "torch_dtype": "float32",
        # Mixtures of experts (0 experts: every MLP dense); the experts' width resolved.
        "moe_experts": cfg.moe_experts, "moe_top_k": cfg.moe_top_k if cfg.moe else 0,
        "moe_shared_experts": cfg.moe_shared_experts, "moe_d_ff": cfg.expert_dim if cfg.moe else 0,
        "moe_dense_layers": cfg.moe_dense_layers, "moe_router": cfg.moe_router,
        "sliding_window": cfg.seq_len if window is None else window,
    }


def model_config(cfg: ModelConfig, kind: str | None, window: int | None = None) -> dict:
    """config.json: of transformers' class `kind` (`hf_moe.hf_type`; no window: docs/export.md), or
    of the remote code (None) with attention window `window`."""
    return hf_config(cfg, kind) if kind else remote_config(cfg, window)


def generation_config(eos_id: int | None, kind: str | None) -> dict:
    """Greedy by default as transformers' defaults are, with the key/value cache (the remote code's too)."""
    return {"eos_token_id": eos_id, "bos_token_id": None, "pad_token_id": eos_id, "use_cache": True}


def copy_code(out: Path) -> list[str]:
    for name in CODE_FILES:
        shutil.copyfile(REMOTE / name, out / name)
    return list(CODE_FILES)
