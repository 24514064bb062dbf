"""The one-to-one map between a standard-residual model of the Llama recipe (rope, SwiGLU, RMSNorm;
docs/spec.md section 11) and transformers' `LlamaForCausalLM` (with QK-norm `Qwen3ForCausalLM`):
parameter names, the split of our fused projections, and the config fields that fix the shapes.

Both directions live here, beside training, because `attnres-pp train --init-from` reads such a
folder and `attnres-pp export` (a layer above) writes one: the same map, so a round trip is exact.
Mixture-of-experts models (Mixtral, Qwen3-MoE) share everything here but their MoE sublayers, which
`hf_moe` adds. Pure torch: no transformers import.
"""

from __future__ import annotations

import torch

from attnres_pp.model.config import ModelConfig
from attnres_pp.model.layers import fuse_qkv_rows, split_qkv_rows

LLAMA = "llama"
QWEN3 = "qwen3"
MIXTRAL = "mixtral"
QWEN3_MOE = "qwen3_moe"
ARCHITECTURES = {LLAMA: "LlamaForCausalLM", QWEN3: "Qwen3ForCausalLM", MIXTRAL: "MixtralForCausalLM",
                 QWEN3_MOE: "Qwen3MoeForCausalLM"}


def llama_recipe(cfg: ModelConfig) -> bool:
    """Standard residual, rope, SwiGLU: the recipe all four transformers classes share."""
    return cfg.residual == "standard" and cfg.positions == "rope" and cfg.mlp == "swiglu"


def llama_type(cfg: ModelConfig) -> str | None:
    """"llama" or "qwen3" when the dense `cfg` is exactly that transformers model, else None (an MoE
    model: `hf_moe.hf_type`; any other: remote code)."""
    if not llama_recipe(cfg) or cfg.moe:
        return None
    return QWEN3 if cfg.qk_norm else LLAMA


def to_llama(named: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our parameters (whole-model names) under transformers' names, each a contiguous tensor; a tied
    LM head is left out (transformers ties it to the embedding from `tie_word_embeddings`). MoE
    sublayers but their norm are left to `hf_moe`."""
    out = {"model.embed_tokens.weight": named["embed.tok.weight"], "model.norm.weight": named["head.norm.weight"]}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = named["head.lm_head.weight"]
    for i in range(cfg.n_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        q, k, v = split_qkv_rows(cfg, named[ours + "attn.qkv.weight"])
        attn = theirs + "self_attn."
        out.update({attn + "q_proj.weight": q, attn + "k_proj.weight": k, attn + "v_proj.weight": v,
                    attn + "o_proj.weight": named[ours + "attn.proj.weight"],
                    theirs + "input_layernorm.weight": named[ours + "attn.norm.weight"],
                    theirs + "post_attention_layernorm.weight": named[ours + "mlp.norm.weight"]})
        if not cfg.is_moe_layer(i):
            gate, up = named[ours + "mlp.gate_up.weight"].chunk(2)
            out.update({theirs + "mlp.gate_proj.weight": gate, theirs + "mlp.up_proj.weight": up,
                        theirs + "mlp.down_proj.weight": named[ours + "mlp.down.weight"]})
        if cfg.qk_norm:
            out[attn + "q_norm.weight"] = named[ours + "attn.q_norm.weight"]
            out[attn + "k_norm.weight"] = named[ours + "attn.k_norm.weight"]
    return {name: t.detach().contiguous() for name, t in out.items()}


def from_llama(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The inverse of `to_llama`: our parameter names (a tied model's LM head is its embedding).
    KeyError naming the first transformers tensor that is missing. MoE sublayers but their norm are
    left to `hf_moe`."""
    out = {"embed.tok.weight": tensors["model.embed_tokens.weight"], "head.norm.weight": tensors["model.norm.weight"]}
    out["head.lm_head.weight"] = out["embed.tok.weight"] if cfg.tie_embeddings else tensors["lm_head.weight"]
    for i in range(cfg.n_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        attn = theirs + "self_attn."
        q, k, v = (tensors[attn + f"{p}_proj.weight"] for p in "qkv")
        out[ours + "attn.qkv.weight"] = fuse_qkv_rows(cfg, q, k, v)
        out[ours + "attn.proj.weight"] = tensors[attn + "o_proj.weight"]
        out[ours + "attn.norm.weight"] = tensors[theirs + "input_layernorm.weight"]
        out[ours + "mlp.norm.weight"] = tensors[theirs + "post_attention_layernorm.weight"]
        if not cfg.is_moe_layer(i):
            out[ours + "mlp.gate_up.weight"] = torch.cat([tensors[theirs + "mlp.gate_proj.weight"],
                                                          tensors[theirs + "mlp.up_proj.weight"]])
            out[ours + "mlp.down.weight"] = tensors[theirs + "mlp.down_proj.weight"]
        if cfg.qk_norm:
            out[ours + "attn.q_norm.weight"] = tensors[attn + "q_norm.weight"]
            out[ours + "attn.k_norm.weight"] = tensors[attn + "k_norm.weight"]
    return out


def llama_config(cfg: ModelConfig, model_type: str | None = None) -> dict:
    """config.json of the transformers model `cfg` is (`llama_type`, or the MoE type `hf_moe` gives,
    which adds its own fields). Both spellings of the rotary base are written: `rope_theta`
    (transformers 4) and `rope_parameters` (transformers 5)."""
    model_type = model_type or llama_type(cfg)
    return {
        "architectures": [ARCHITECTURES[model_type]], "model_type": model_type,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "intermediate_size": cfg.ff_dim,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
        "max_position_embeddings": cfg.seq_len, "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False, "attention_dropout": 0.0,
        "mlp_bias": False, "use_cache": True, "torch_dtype": "float32", "initializer_range": cfg.init_std,
        **({"use_sliding_window": False, "sliding_window": None} if model_type in (QWEN3, QWEN3_MOE) else {}),
    }


def model_fields(hf: dict) -> dict:
    """The ModelConfig fields a Llama or Qwen3 config.json fixes (shapes and the function they compute),
    read as `ModelConfig` spells them (the experts of a Mixtral or Qwen3-MoE one: `hf_moe.folder_fields`);
    ValueError naming a missing or mistyped key."""
    try:
        rope = hf.get("rope_parameters") or {}
        theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        heads = int(hf["num_attention_heads"])
        fields = {"residual": "standard", "positions": "rope", "mlp": "swiglu", "vocab_size": int(hf["vocab_size"]),
                  "d_model": int(hf["hidden_size"]), "n_layers": int(hf["num_hidden_layers"]), "n_heads": heads,
                  "kv_heads": int(hf.get("num_key_value_heads") or heads), "ff_dim": int(hf["intermediate_size"]),
                  "head_dim": int(hf.get("head_dim") or int(hf["hidden_size"]) // heads),
                  "qk_norm": hf["model_type"] in (QWEN3, QWEN3_MOE),
                  "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
                  "norm_eps": float(hf.get("rms_norm_eps", 1e-6)), "rope_theta": float(theta)}
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise ValueError(f"config.json lacks a valid {error} for a {hf.get('model_type')} model") from None
    if hf.get("hidden_act", "silu") != "silu" or hf.get("attention_bias") or hf.get("mlp_bias"):
        raise ValueError("config.json asks for biases or an activation other than silu, which this model has not")
    if rope.get("rope_type", "default") != "default" or hf.get("rope_scaling") or hf.get("use_sliding_window"):
        raise ValueError("config.json asks for scaled rotary positions or sliding-window attention, which this "
                         "model has not (plain rope over the whole sequence)")
    return fields


def run_fields(cfg: ModelConfig) -> dict:
    """`model_fields` of our side, to compare with a folder's."""
    return {"residual": cfg.residual, "positions": cfg.positions, "mlp": cfg.mlp, "vocab_size": cfg.vocab_size,
            "d_model": cfg.d_model, "n_layers": cfg.n_layers, "n_heads": cfg.n_heads, "kv_heads": cfg.kv_heads,
            "ff_dim": cfg.ff_dim, "head_dim": cfg.head_dim, "qk_norm": cfg.qk_norm,
            "tie_embeddings": cfg.tie_embeddings, "norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta}
