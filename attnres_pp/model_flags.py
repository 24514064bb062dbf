"""The model's command-line flags, declared once for every command that builds a ModelConfig from
them (`attnres-pp train`, `simulate memory`, `simulate plan`), so each flag has one name, default and
meaning everywhere.

Every flag is read as text and left None when not given: the value then comes from the layer below
(train's `--config` TOML or checkpoint, else ModelConfig's default), and a bad value is one
`error:` line naming the flag (`cli_flags.convert_flag`); ModelConfig checks the ranges. Pure
standard library: the simulator reads it where torch is missing.
"""

from __future__ import annotations

import argparse

from attnres_pp.cli_flags import convert_flag, layer_counts
from attnres_pp.model.config import KEY_MODES, MLPS, MOE_BALANCES, MOE_ROUTERS, POSITIONS, RESIDUALS, ModelConfig

# (flag, ModelConfig field, type, help)
MODEL_FLAGS = (
    ("--residual", "residual", str, f"residual variant: {' | '.join(RESIDUALS)}"),
    ("--block-size", "block_size", int, "sublayers per AttnRes block (1 = Full AttnRes)"),
    ("--blocks", "blocks", int, "number of AttnRes blocks N instead of --block-size: block i ends after "
     "sublayer ceil(L i / N), L = 2 x layers (0 = use --block-size)"),
    ("--key-mode", "key_mode", str, f"low-rank key mode: {' | '.join(KEY_MODES)}"),
    ("--key-rank", "key_rank", int, "low-rank key dimension r"),
    ("--layers", "n_layers", int, "transformer layers (two sublayers each)"),
    ("--d-model", "d_model", int, "model width d"),
    ("--heads", "n_heads", int, "attention heads"),
    ("--d-ff", "d_ff", int, "MLP width (0 = the recipe's default: SwiGLU 64 x ceil(8 d / 3 / 64), GELU 4 d)"),
    ("--seq-len", "seq_len", int, "tokens per sequence"),
    ("--vocab-size", "vocab_size", int, "vocabulary size (256 for byte corpora)"),
    ("--positions", "positions", str, f"positions: {' | '.join(POSITIONS)} (rotary, default; or a learned table)"),
    ("--rope-theta", "rope_theta", float, "rotary base theta (default 10000)"),
    ("--mlp", "mlp", str, f"MLP: {' | '.join(MLPS)} (default swiglu)"),
    ("--kv-heads", "n_kv_heads", int, "key/value heads, dividing --heads (equal: multi-head, 1: multi-query; "
     "default as many as --heads)"),
    ("--moe-experts", "moe_experts", int, "routed experts E per MoE layer (default 0: every MLP dense)"),
    ("--moe-top-k", "moe_top_k", int, "routed experts each token reaches, K <= E (default 2)"),
    ("--moe-shared-experts", "moe_shared_experts", int, "shared experts every token reaches (default 0)"),
    ("--moe-d-ff", "moe_d_ff", int, "hidden width of each expert, >= 1 (default: d_ff / 4 rounded up to 64)"),
    ("--moe-dense-layers", "moe_dense_layers", int, "the first N layers keep a dense MLP (default 0)"),
    ("--moe-router", "moe_router", str, f"router affinities: {' | '.join(MOE_ROUTERS)} (default softmax)"),
    ("--moe-balance", "moe_balance", str, f"load balancing: {' | '.join(MOE_BALANCES)} (default aux_free: a "
     "selection bias moved after each step)"),
    ("--moe-aux-loss-coef", "moe_aux_loss_coef", float, "the aux loss's coefficient under --moe-balance aux_loss "
     "(default 0.01)"),
    ("--moe-bias-gamma", "moe_bias_gamma", float, "the selection bias's step under --moe-balance aux_free "
     "(default 0.001)"),
    ("--moe-seq-aux-coef", "moe_seq_aux_coef", float, "the sequence-wise balance loss's coefficient, beside any "
     "--moe-balance (default 0: none)"),
    ("--moe-router-lr-scale", "moe_router_lr_scale", float, "the routers' learning rate as a fraction of --lr, "
     "in (0, 1] (default 1)"),
)
KEY_NORM_GAIN = "--key-norm-gain"
# Switches that turn a recipe part on (default off): flag -> (ModelConfig field, help).
SWITCHES = {
    "--qk-norm": ("qk_norm", "a per-head RMSNorm with a gain on q and k, before the rotation"),
    "--tie-embeddings": ("tie_embeddings", "the LM head reads the token embedding's matrix"),
}
LAYER_COUNTS = "--layer-counts"


def _dest(flag: str) -> str:
    return flag[2:].replace("-", "_")


def add_model_flags(parser: argparse.ArgumentParser, *, notes: dict[str, str] | None = None) -> None:
    """The flags of MODEL_FLAGS and --key-norm-gain; `notes` appends a command's own remark to a flag's
    help (what the flag means there, e.g. that a planner searches over it when it is left out)."""
    notes = notes or {}
    for flag, field, _kind, help_text in MODEL_FLAGS:
        parser.add_argument(flag, metavar=field.upper(), help=_noted(help_text, notes.get(flag)))
    parser.add_argument(KEY_NORM_GAIN, action="store_true", default=None,
                        help=_noted("a learned gain (init 1) on the depth-attention key RMSNorm (default off)",
                                    notes.get(KEY_NORM_GAIN)))
    for flag, (_field, help_text) in SWITCHES.items():
        parser.add_argument(flag, action="store_true", default=None,
                            help=_noted(f"{help_text} (default off)", notes.get(flag)))


def add_layer_counts_flag(parser: argparse.ArgumentParser, *, note: str | None = None) -> None:
    """--layer-counts N,N,..: transformer layers per chunk (a pipeline setting, read by `layer_counts`)."""
    parser.add_argument(LAYER_COUNTS, metavar="N,N,..",
                        help=_noted("transformer layers per chunk, comma separated", note))


def _noted(help_text: str, note: str | None) -> str:
    return f"{help_text}; {note}" if note else help_text


def model_overrides(args: argparse.Namespace) -> dict:
    """{ModelConfig field: value} of the model flags given; ValueError naming the flag to fix."""
    overrides = {}
    for flag, field, kind, _help in MODEL_FLAGS:
        raw = getattr(args, _dest(flag))
        if raw is not None:
            overrides[field] = convert_flag(flag, raw, kind)
    if getattr(args, _dest(KEY_NORM_GAIN)):
        overrides["key_norm_gain"] = True
    for flag, (field, _help) in SWITCHES.items():
        if getattr(args, _dest(flag), None):
            overrides[field] = True
    if overrides.get("moe_d_ff") == 0:
        raise ValueError("--moe-d-ff 0 is invalid: each expert needs a hidden width >= 1; leave the flag out for "
                         "the default (d_ff / 4 rounded up to 64)")
    if {"block_size", "blocks"} <= set(overrides):
        raise ValueError("give one of --block-size S (sublayers per block) and --blocks N (number of blocks)")
    return overrides


def model_from_flags(args: argparse.Namespace, base: dict | None = None, **fixed) -> ModelConfig:
    """ModelConfig of `base` (a [model] table) < the model flags < `fixed` fields, as `train` reads it
    without --config; ValueError naming what to fix."""
    return ModelConfig.from_dict({**(base or {}), **model_overrides(args), **fixed})


def layer_counts_flag(args: argparse.Namespace) -> tuple[int, ...] | None:
    return layer_counts(getattr(args, _dest(LAYER_COUNTS)))
