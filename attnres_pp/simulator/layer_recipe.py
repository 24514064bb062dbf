"""What the layer recipe (docs/spec.md section 11) puts in one transformer layer, as the simulator
prices it: the shapes of its parameters in the real modules' order (`model.layers`), the elements of
the matrices it multiplies with, and its forward FLOPs per token. One place for what every other
simulator module reads: the qkv projection `d -> (H + 2 G) E` (one fused matrix under multi-head
attention and grouped kv heads alike), SwiGLU's three `d x f` matrices (gate and up fused) or
GELU's two, QK-norm's per-head gains, rotary positions (no position table) and tied embeddings (the
LM head's matrix is the token embedding's). Pure Python: no torch."""

from __future__ import annotations

from attnres_pp.model.config import ModelConfig

# Elementwise FLOPs per element of q and k: rotary `x cos + rotate_half(x) sin` (two products, one
# sum); QK-norm's RMSNorm with a gain (square, mean, rsqrt, two products). The MLP's activation
# (GELU or SiLU and the gate product) is left out, as the sublayer norms are: a few FLOPs per hidden
# unit beside 2 d per matrix.
ROPE_FLOPS = 3
NORM_FLOPS = 5


def kv_width(cfg: ModelConfig) -> int:
    """Numbers per token of the keys (as many of the values): G kv heads of E."""
    return cfg.kv_heads * cfg.head_dim


def qkv_rows(cfg: ModelConfig) -> int:
    """Output width of the q, k and v projections together: (H + 2 G) E = d + 2 G E."""
    return cfg.d_model + 2 * kv_width(cfg)


def attention_matrix_shapes(cfg: ModelConfig, tensor_parallel: int = 1) -> list[tuple[int, int]]:
    """The attention's split matrices in module order: the fused qkv [d + 2GE, d] (every head count:
    `model.layers.Attention`), column-parallel by heads (dim 0 / T); the output projection [width, d / T]."""
    d, t = cfg.d_model, tensor_parallel
    return [(qkv_rows(cfg) // t, d), (cfg.source_width, d // t)]


def layer_ff(cfg: ModelConfig, layer: int | None = None) -> int:
    """The hidden width of layer `layer`'s dense MLP part: the model's d_ff, or in an MoE layer
    (docs/spec.md section 12) its S shared experts as one SwiGLU of width S F (`model.moe.SharedExperts`;
    0 without shared experts). `layer` None: a dense layer."""
    if layer is not None and cfg.is_moe_layer(layer):
        return cfg.moe_shared_experts * cfg.expert_dim
    return cfg.ff_dim


def mlp_matrix_shapes(cfg: ModelConfig, tensor_parallel: int = 1, layer: int | None = None) -> list[tuple[int, int]]:
    """The MLP's matrices in module order: SwiGLU's fused gate_up [2f / T, d] or GELU's up [f / T, d],
    then down [width, f / T]; in an MoE layer the shared experts' (SwiGLU of width S F, none if S = 0)."""
    d, f, t = cfg.d_model, cfg.ff_dim, tensor_parallel
    if layer is not None and cfg.moe and cfg.is_moe_layer(layer):
        f = layer_ff(cfg, layer)
        return [(2 * f // t, d), (cfg.source_width, f // t)] if f else []
    first = (2 * f // t, d) if cfg.mlp == "swiglu" else (f // t, d)
    return [first, (cfg.source_width, f // t)]


def routed_expert_shapes(cfg: ModelConfig, expert_parallel: int = 1) -> list[tuple[int, int, int]]:
    """The routed experts one rank holds of an MoE layer: `gate_up` [E / EP, 2F, d] and `down`
    [E / EP, width, F] (`model.moe.RoutedExperts`)."""
    local, f = cfg.moe_experts // expert_parallel, cfg.expert_dim
    return [(local, 2 * f, cfg.d_model), (local, cfg.source_width, f)]


def moe_parameter_shapes(cfg: ModelConfig, expert_parallel: int = 1) -> list[tuple[int, ...]]:
    """One MoE sublayer's parameters besides its depth read, in the module's order (`model.moe.MoE`):
    the aux-free selection bias [E] (a parameter without gradient or AdamW state: `frozen_shapes`), the
    norm's gain, the router [E, d], the routed experts (`routed_expert_shapes`, E / EP of them) and
    the shared experts' gate_up and down."""
    d, e = cfg.d_model, cfg.moe_experts
    return [(e,), (d,), (e, d), *routed_expert_shapes(cfg, expert_parallel),
            *mlp_matrix_shapes(cfg, 1, cfg.moe_dense_layers)]


def layer_parameter_shapes(cfg: ModelConfig, read: list[tuple[int, ...]], tensor_parallel: int = 1,
                           layer: int | None = None, expert_parallel: int = 1) -> list[tuple[int, ...]]:
    """One TransformerLayer's parameters in the modules' order (`named_parameters`), `read` the shapes
    of one reading site: attn.norm, qkv, q_norm and k_norm [E] (qk-norm), proj, attn.read,
    mlp.norm, gate_up | up, down, mlp.read. On one of T tp ranks the split matrices are its shards; the
    norms' gains (QK-norm's included) are whole on every rank. An MoE layer (`layer` given and
    `cfg.is_moe_layer(layer)`) has `moe_parameter_shapes` in place of the MLP's norm and matrices."""
    d = cfg.d_model
    qk_norm = [(cfg.head_dim,), (cfg.head_dim,)] if cfg.qk_norm else []
    *projections, out = attention_matrix_shapes(cfg, tensor_parallel)
    if layer is not None and cfg.is_moe_layer(layer):
        return [(d,), *projections, *qk_norm, out, *read, *moe_parameter_shapes(cfg, expert_parallel), *read]
    return [(d,), *projections, *qk_norm, out, *read, (d,), *mlp_matrix_shapes(cfg, tensor_parallel), *read]


def embedding_shapes(cfg: ModelConfig) -> list[tuple[int, int]]:
    """The embedding's parameters: tokens [V, d], the position table [seq, d] only under learned
    positions, the embedding key projection [r, d] under projected low-rank keys."""
    shapes = [(cfg.vocab_size, cfg.d_model)]
    if cfg.positions == "learned":
        shapes.append((cfg.seq_len, cfg.d_model))
    if cfg.projected_key_rank:
        shapes.append((cfg.projected_key_rank, cfg.d_model))
    return shapes


def head_shapes(cfg: ModelConfig, read: list[tuple[int, ...]], *, holds_embedding: bool) -> list[tuple[int, ...]]:
    """The head's parameters: its read, the output norm and the LM head [V, d], which under tied
    embeddings is the token embedding's matrix: one parameter, counted where the embedding is
    (`holds_embedding`: the same rank or chunk group also holds chunk 0)."""
    lm_head = [] if cfg.tie_embeddings and holds_embedding else [(cfg.vocab_size, cfg.d_model)]
    return [*read, (cfg.d_model,), *lm_head]


def layer_matmul_elements(cfg: ModelConfig, tensor_parallel: int = 1, layer: int | None = None) -> int:
    """Elements of one layer's matrices on one of T tp ranks (each a weight a token multiplies with);
    in an MoE layer the shared experts' (the router computes in fp32, the routed experts apart)."""
    shapes = attention_matrix_shapes(cfg, tensor_parallel) + mlp_matrix_shapes(cfg, tensor_parallel, layer)
    return sum(a * b for a, b in shapes)


def attention_flops_per_token(cfg: ModelConfig) -> float:
    """Forward FLOPs per token of one attention sublayer, without its depth read: the q, k, v and
    output projections, the causal scores and weighted sum over H query heads (T / 2 keys on average,
    whatever the kv heads), QK-norm and the rotation of q and k."""
    flops = 2 * (cfg.d_model * qkv_rows(cfg) + cfg.d_model * cfg.source_width) + 2 * cfg.seq_len * cfg.d_model
    rotated = cfg.d_model + kv_width(cfg)  # q and k numbers per token
    if cfg.qk_norm:
        flops += NORM_FLOPS * rotated
    if cfg.positions == "rope":
        flops += ROPE_FLOPS * rotated
    return float(flops)


def mlp_flops_per_token(cfg: ModelConfig, layer: int | None = None) -> float:
    """Forward FLOPs per token of one MLP sublayer, without its depth read: SwiGLU's gate, up and down
    products (GELU: up and down); of an MoE sublayer (`moe_flops_per_token`) where `layer` is one."""
    if layer is not None and cfg.moe and cfg.is_moe_layer(layer):
        return moe_flops_per_token(cfg)
    return float(2 * sum(a * b for a, b in mlp_matrix_shapes(cfg)))


def moe_flops_per_token(cfg: ModelConfig) -> float:
    """Forward FLOPs per token of one MoE sublayer (docs/spec.md section 12's cost): 2 x the multiply-adds
    of its K routed and S shared SwiGLU experts, (K + S)(2 d F + F width) (3 d F (K + S) when width =
    d), plus the router's d E. The softmax, the top-K and the gate-weighted sum are left out (a few
    FLOPs per expert, as the norms are)."""
    d, f = cfg.d_model, cfg.expert_dim
    expert = 2 * d * f + f * cfg.source_width
    return float(2 * ((cfg.moe_top_k + cfg.moe_shared_experts) * expert + d * cfg.moe_experts))


def describe_recipe(cfg: ModelConfig) -> str:
    """The recipe in a few words for a table's heading: heads (and kv heads), the MLP and its width,
    positions, QK-norm and tied embeddings where on."""
    heads = f"{cfg.n_heads} heads" + (f" / {cfg.kv_heads} kv" if cfg.kv_heads != cfg.n_heads else "")
    extras = [name for name, on in (("qk-norm", cfg.qk_norm), ("tied", cfg.tie_embeddings)) if on]
    if cfg.moe:
        extras.append(f"MoE E={cfg.moe_experts} K={cfg.moe_top_k} S={cfg.moe_shared_experts} "
                      f"F={cfg.expert_dim} from layer {cfg.moe_dense_layers}")
    return ", ".join([heads, f"{cfg.mlp} d_ff={cfg.ff_dim}", cfg.positions, *extras])
