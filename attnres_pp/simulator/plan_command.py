"""The `attnres-pp train` command line of a planned configuration, and whether train runs it on the
plan's GPUs (`--device cuda`).

The command starts the plan's T x P x D GPUs as Ray actors, one per GPU (train's default launcher):
on one node in a private Ray instance; over several nodes in the `ray start` cluster (`--launcher ray
--address auto`), whose nodes the placement group spans (`--placement PACK`: the default STRICT_PACK
keeps every rank on one node). A configuration train refuses on GPUs keeps its command, and its row
says why (`runnable`, `not_runnable_reason`): train runs tensor parallelism on cpu gloo ranks so far
(`train.engines.check_tensor_parallel_runs`). tests/test_sim_plan.py puts every row's command through
train's parser and the checks train makes before it starts a rank, on a cluster of the request's
nodes, and holds `runnable` to what train accepts.
"""

from __future__ import annotations

from attnres_pp.model.config import ModelConfig
from attnres_pp.simulator.plan_request import Candidate, PlanRequest


def not_runnable_reason(request: PlanRequest, candidate: Candidate) -> str | None:
    """Why `attnres-pp train` refuses the candidate on the request's GPUs; None when it runs it."""
    if candidate.tensor_parallel > 1:
        return (f"train refuses --tensor-parallel {candidate.tensor_parallel} on --device cuda (it runs tensor "
                "parallelism on cpu gloo ranks so far)")
    return None


def command_fields(request: PlanRequest, candidate: Candidate) -> dict:
    """A row's `command`, `runnable` and `not_runnable_reason` (None where runnable)."""
    reason = not_runnable_reason(request, candidate)
    return {"command": train_command(request, candidate), "runnable": reason is None,
            "not_runnable_reason": reason}


# The layer recipe's fields (docs/spec.md section 11) and train's flags for them (`model_flags`).
_RECIPE_FLAGS = (("d_ff", "--d-ff"), ("positions", "--positions"), ("rope_theta", "--rope-theta"), ("mlp", "--mlp"),
                 ("n_kv_heads", "--kv-heads"), ("qk_norm", "--qk-norm"), ("tie_embeddings", "--tie-embeddings"))


# The mixture-of-experts fields (docs/spec.md section 12) and train's flags for them.
_MOE_FLAGS = (("moe_experts", "--moe-experts"), ("moe_top_k", "--moe-top-k"),
              ("moe_shared_experts", "--moe-shared-experts"), ("moe_d_ff", "--moe-d-ff"),
              ("moe_dense_layers", "--moe-dense-layers"), ("moe_router", "--moe-router"),
              ("moe_balance", "--moe-balance"), ("moe_aux_loss_coef", "--moe-aux-loss-coef"),
              ("moe_bias_gamma", "--moe-bias-gamma"))


def recipe_flags(cfg: ModelConfig) -> list[str]:
    """train's flags for the recipe fields where `cfg` differs from ModelConfig's defaults (what
    train builds without them), so the command trains the model the plan priced; with experts, the
    MoE flags too (E, K, S and the expert width always, the others where not the default)."""
    parts = []
    always = {"moe_experts", "moe_top_k", "moe_shared_experts", "moe_d_ff"} if cfg.moe else set()
    for field, flag in _RECIPE_FLAGS + (_MOE_FLAGS if cfg.moe else ()):
        if field == "moe_d_ff":  # the width the plan priced, also where it was the default
            parts.append(f"{flag} {cfg.expert_dim}")
            continue
        value, default = getattr(cfg, field), ModelConfig.__dataclass_fields__[field].default
        if field not in always and (value == default or (field == "rope_theta" and cfg.positions != "rope")):
            continue
        parts.append(flag if isinstance(value, bool) else f"{flag} {value:g}" if isinstance(value, float)
                     else f"{flag} {value}")
    return parts


def train_command(request: PlanRequest, candidate: Candidate) -> str:
    """The `attnres-pp train` command line of a candidate (one optimiser step per --steps)."""
    cfg = request.model
    parts = ["attnres-pp train", f"--layers {cfg.n_layers}", f"--d-model {cfg.d_model}", f"--heads {cfg.n_heads}",
             f"--seq-len {cfg.seq_len}", f"--vocab-size {cfg.vocab_size}", f"--residual {cfg.residual}"]
    if cfg.uses_depth_attention:
        parts.append(f"--blocks {cfg.blocks}" if cfg.blocks else f"--block-size {candidate.block_size}")
        if cfg.key_norm_gain:
            parts.append("--key-norm-gain")
    if cfg.residual == "lr_attnres":
        parts += [f"--key-mode {cfg.key_mode}", f"--key-rank {cfg.key_rank}"]
    parts += recipe_flags(cfg)
    parts += [f"--batch-size {request.global_batch}", f"--microbatches {candidate.n_microbatches}",
              f"--stages {candidate.n_stages}", f"--virtual {candidate.n_virtual}",
              f"--data-parallel {candidate.data_parallel}", f"--schedule {candidate.schedule}",
              f"--cache {'on' if candidate.cache else 'off'}",
              f"--dtype {request.dtype}", "--device cuda", f"--dp-shard {candidate.dp_shard}",
              f"--activation-checkpoint {candidate.activation_checkpoint}"]
    if candidate.dp_shard == "fsdp" and candidate.reshard_after_forward != "never":
        parts.append(f"--fsdp-reshard-after-forward {candidate.reshard_after_forward}")
    if candidate.expert_parallel > 1:  # docs/spec.md section 12
        parts.append(f"--expert-parallel {candidate.expert_parallel}")
    if candidate.tensor_parallel > 1:  # docs/spec.md section 10; `not_runnable_reason` says what train does with it
        parts.append(f"--tensor-parallel {candidate.tensor_parallel}"
                     + ("" if candidate.sp else " --no-sequence-parallel"))
    if request.gpus > request.gpus_per_node:
        parts += ["--launcher ray", "--address auto", "--placement PACK"]
    return " ".join(parts)
