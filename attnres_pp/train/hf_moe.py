"""The map between a standard-residual mixture-of-experts model of the Llama recipe (docs/spec.md
sections 11 and 12) and transformers' own MoE classes: `MixtralForCausalLM` (no QK-norm, every MLP
an MoE sublayer) and `Qwen3MoeForCausalLM` (QK-norm; dense first layers as `mlp_only_layers`).

Both route as ours does exactly when the router is a softmax, no shared experts are added and the
selection bias is zero (they have none): the top K of the affinities, their gate weights renormalised
over the chosen (Mixtral always, Qwen3-MoE with `norm_topk_prob`). Every other MoE model (a sigmoid
router, shared experts, a nonzero bias, dense layers Mixtral cannot hold, any AttnRes variant) goes
through the exported remote code. Qwen2-MoE is not a target: its shared expert is gated, ours is not.

Experts are written as the checkpoints transformers publishes and `save_pretrained` writes them, one
tensor per expert (Mixtral `block_sparse_moe.experts.{j}.w1 | w3 | w2` for gate, up, down; Qwen3-MoE
`mlp.experts.{j}.gate_proj | up_proj | down_proj`): transformers 5 fuses them into its 3-D
`gate_up_proj` `[E, 2F, d]` and `down_proj` `[E, d, F]` as it loads, transformers 4 reads them as
they are. Pure torch: no transformers import.
"""

from __future__ import annotations

import torch

from attnres_pp.model.config import ModelConfig
from attnres_pp.train.hf_llama import (
    MIXTRAL,
    QWEN3_MOE,
    from_llama,
    llama_config,
    llama_recipe,
    llama_type,
    model_fields,
    run_fields,
    to_llama,
)

MOE_TYPES = (MIXTRAL, QWEN3_MOE)


def moe_type(cfg: ModelConfig) -> str | None:
    """"mixtral" or "qwen3_moe" when the MoE model's options are that class's (its selection bias
    still to check: `hf_type`), else None."""
    if not cfg.moe or not llama_recipe(cfg) or cfg.moe_router != "softmax" or cfg.moe_shared_experts:
        return None
    if cfg.qk_norm:
        return QWEN3_MOE
    return MIXTRAL if cfg.moe_dense_layers == 0 else None


def nonzero_bias_layers(named: dict[str, torch.Tensor], cfg: ModelConfig) -> list[int]:
    """The layers whose aux-free selection bias is not all zero (it changes which experts are chosen)."""
    return [i for i in range(cfg.n_layers)
            if cfg.is_moe_layer(i) and bool(named[f"layers.{i}.mlp.expert_bias"].any())]


def hf_type(cfg: ModelConfig, named: dict[str, torch.Tensor] | None = None) -> str | None:
    """The transformers model `cfg` with parameters `named` is exactly ("llama", "qwen3", "mixtral",
    "qwen3_moe"), or None (the remote code). Without `named` the selection bias counts as zero."""
    if not cfg.moe:
        return llama_type(cfg)
    kind = moe_type(cfg)
    if kind and named is not None and nonzero_bias_layers(named, cfg):
        return None
    return kind


def _expert_names(kind: str, layer: int) -> tuple[str, str, str, str]:
    """transformers' names of layer `layer`'s router and of expert `{j}`'s gate, up and down."""
    if kind == MIXTRAL:
        moe = f"model.layers.{layer}.block_sparse_moe."
        experts = moe + "experts.{j}."
        return moe + "gate.weight", experts + "w1.weight", experts + "w3.weight", experts + "w2.weight"
    moe = f"model.layers.{layer}.mlp."
    experts = moe + "experts.{j}."
    return moe + "gate.weight", experts + "gate_proj.weight", experts + "up_proj.weight", experts + "down_proj.weight"


def to_hf(named: dict[str, torch.Tensor], cfg: ModelConfig, kind: str) -> dict[str, torch.Tensor]:
    """Our parameters under the names of transformers' class `kind` (`hf_type`), each contiguous;
    the selection bias (zero: `hf_type`) is left out, the class has none."""
    out = to_llama(named, cfg)
    if kind not in MOE_TYPES:
        return out
    f = cfg.expert_dim
    for i in range(cfg.n_layers):
        if not cfg.is_moe_layer(i):
            continue
        router, gate, up, down = _expert_names(kind, i)
        ours = f"layers.{i}.mlp."
        out[router] = named[ours + "router.weight"]
        gate_up_E2FD, down_EDF = named[ours + "experts.gate_up"], named[ours + "experts.down"]
        for j in range(cfg.moe_experts):
            out[gate.format(j=j)], out[up.format(j=j)] = gate_up_E2FD[j, :f], gate_up_E2FD[j, f:]
            out[down.format(j=j)] = down_EDF[j]
    return {name: t.detach().contiguous() for name, t in out.items()}


def from_hf(tensors: dict[str, torch.Tensor], cfg: ModelConfig, kind: str) -> dict[str, torch.Tensor]:
    """The inverse of `to_hf` (the selection bias zero); KeyError naming a missing tensor."""
    out = from_llama(tensors, cfg)
    if kind not in MOE_TYPES:
        return out
    for i in range(cfg.n_layers):
        if not cfg.is_moe_layer(i):
            continue
        router, gate, up, down = _expert_names(kind, i)
        ours = f"layers.{i}.mlp."
        out[ours + "router.weight"] = tensors[router]
        out[ours + "expert_bias"] = torch.zeros(cfg.moe_experts)
        out[ours + "experts.gate_up"] = torch.stack([torch.cat([tensors[gate.format(j=j)], tensors[up.format(j=j)]])
                                                     for j in range(cfg.moe_experts)])
        out[ours + "experts.down"] = torch.stack([tensors[down.format(j=j)] for j in range(cfg.moe_experts)])
    return out


def hf_config(cfg: ModelConfig, kind: str) -> dict:
    """config.json of transformers' class `kind` for `cfg`. Mixtral's `intermediate_size` is its
    experts' width (it has no dense MLP); Qwen3-MoE's is the dense first layers' (`mlp_only_layers`)."""
    table = llama_config(cfg, kind)
    if kind == MIXTRAL:
        table.update(intermediate_size=cfg.expert_dim, num_local_experts=cfg.moe_experts, sliding_window=None,
                     router_jitter_noise=0.0)
    elif kind == QWEN3_MOE:
        table.update(moe_intermediate_size=cfg.expert_dim, num_experts=cfg.moe_experts, norm_topk_prob=True,
                     decoder_sparse_step=1, mlp_only_layers=list(range(cfg.moe_dense_layers)))
    if kind in MOE_TYPES:
        table.update(num_experts_per_tok=cfg.moe_top_k, output_router_logits=False)
    return table


def folder_fields(hf: dict) -> dict:
    """The ModelConfig fields a Llama, Qwen3, Mixtral or Qwen3-MoE config.json fixes (`expert_dim`
    for `moe_d_ff`; `ff_dim` only where a dense MLP has it); ValueError naming a key to fix."""
    fields = {**model_fields(hf), "moe_experts": 0}
    kind = hf.get("model_type")
    if kind not in MOE_TYPES:
        return fields
    try:
        experts = int(hf["num_local_experts"] if kind == MIXTRAL else hf["num_experts"])
        top_k = int(hf["num_experts_per_tok"])
        expert_dim = int(hf["intermediate_size"] if kind == MIXTRAL else hf["moe_intermediate_size"])
        dense = [int(i) for i in hf.get("mlp_only_layers") or []] if kind == QWEN3_MOE else []
        sparse_step = int(hf.get("decoder_sparse_step", 1)) if kind == QWEN3_MOE else 1
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"config.json lacks a valid {error} for a {kind} model") from None
    if kind == QWEN3_MOE and not hf.get("norm_topk_prob"):
        raise ValueError("config.json's norm_topk_prob is false: its gate weights are not renormalised over the "
                         "chosen experts as this model's are")
    if kind == MIXTRAL and hf.get("sliding_window") is not None:
        raise ValueError("config.json asks for sliding-window attention, which this model has not")
    if sparse_step != 1 or sorted(dense) != list(range(len(dense))):
        raise ValueError("config.json's mlp_only_layers / decoder_sparse_step put dense MLPs elsewhere than the "
                         "first layers, which this model cannot (--moe-dense-layers N keeps the first N dense)")
    fields.update(moe_experts=experts, moe_top_k=top_k, expert_dim=expert_dim, moe_dense_layers=len(dense),
                  moe_shared_experts=0, moe_router="softmax")
    if not dense:
        fields.pop("ff_dim")  # no dense MLP: the width of one is not the folder's to fix
    return fields


def our_fields(cfg: ModelConfig) -> dict:
    """`folder_fields` of the run's side, to compare with a folder's."""
    fields = {**run_fields(cfg), "moe_experts": cfg.moe_experts}
    if cfg.moe:
        fields.update(moe_top_k=cfg.moe_top_k, expert_dim=cfg.expert_dim, moe_dense_layers=cfg.moe_dense_layers,
                      moe_shared_experts=cfg.moe_shared_experts, moe_router=cfg.moe_router)
        if not cfg.moe_dense_layers:
            fields.pop("ff_dim")
    return fields
