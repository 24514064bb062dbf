"""The simulator knows the layer recipe (docs/spec.md section 11): its FLOPs count the real model's
matrix products (SwiGLU's three matrices, grouped kv heads' narrower k and v, the LM head whether
tied or not), its parameter counts are the real model's, and its commands take the recipe flags
and refuse a split that tied embeddings cannot run."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from attnres_pp.cli import main
from attnres_pp.comm.partition import make_partition
from attnres_pp.model.config import ModelConfig
from attnres_pp.model.transformer import Transformer, parameter_count
from attnres_pp.simulator.costs import chunk_forward_flops
from attnres_pp.simulator.layer_recipe import NORM_FLOPS, ROPE_FLOPS
from attnres_pp.simulator.plan import PlanRequest, candidates
from attnres_pp.simulator.project import rank_parameters

RECIPES = {
    "legacy": {"positions": "learned", "mlp": "gelu"},
    "default": {},
    "gqa_qk_norm": {"n_kv_heads": 2, "qk_norm": True},
    "mqa_tied": {"n_kv_heads": 1, "tie_embeddings": True},
    "gelu_gqa_d_ff": {"mlp": "gelu", "n_kv_heads": 2, "d_ff": 72},
}


def _cfg(recipe: str, **fields) -> ModelConfig:
    return ModelConfig(**{"vocab_size": 48, "n_layers": 3, "d_model": 32, "n_heads": 4, "seq_len": 16,
                          "residual": "standard", **RECIPES[recipe], **fields})


def _elementwise_and_scores(cfg: ModelConfig, tokens: int) -> float:
    """What `sublayer_forward_flops` adds to the matrix products per attention sublayer: the causal
    scores and weighted sum, QK-norm and the rotation of q and k."""
    rotated = cfg.d_model + cfg.kv_heads * cfg.head_dim
    per_token = 2 * cfg.seq_len * cfg.d_model + NORM_FLOPS * rotated * cfg.qk_norm
    per_token += ROPE_FLOPS * rotated * (cfg.positions == "rope")
    return tokens * per_token * cfg.n_layers


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_forward_flops_count_the_real_models_matrix_products(recipe):
    cfg = _cfg(recipe)
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        Transformer(cfg)(idx)
    counted = counter.get_flop_counts()["Global"]
    matmul = sum(v for op, v in counted.items() if "mm" in str(op))
    partition = make_partition(cfg.n_layers, 1, 1)
    tokens = idx.numel()
    assert chunk_forward_flops(cfg, partition, 0, tokens) - _elementwise_and_scores(cfg, tokens) == matmul


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_project_parameter_counts_are_the_models(recipe):
    cfg = _cfg(recipe, residual="attnres", block_size=2)
    model = Transformer(cfg)
    real = sum(p.numel() for p in model.parameters())  # a tied matrix is one parameter
    one_rank = rank_parameters(cfg, make_partition(cfg.n_layers, 1, 1))
    # `project` leaves out the final read's query (d numbers), as it always has
    assert one_rank == [real - cfg.d_model] and parameter_count(cfg) == real


def test_swiglu_and_grouped_heads_change_the_flops_as_their_shapes_say():
    partition = make_partition(4, 1, 1)
    base = dict(vocab_size=64, n_layers=4, d_model=64, n_heads=8, seq_len=32, residual="standard", d_ff=128)
    gelu = chunk_forward_flops(ModelConfig(**base, mlp="gelu", positions="learned"), partition, 0, 32)
    swiglu = chunk_forward_flops(ModelConfig(**base, positions="learned"), partition, 0, 32)
    assert swiglu - gelu == 4 * 2 * 32 * 64 * 128  # one more d x f matrix per layer
    mha = chunk_forward_flops(ModelConfig(**base, positions="learned"), partition, 0, 32)
    gqa = chunk_forward_flops(ModelConfig(**base, positions="learned", n_kv_heads=2), partition, 0, 32)
    assert mha - gqa == 4 * 2 * 32 * 64 * 2 * (64 - 16)  # k and v of 2 kv heads of 8 instead of 8


def _cli(capsys, *argv):
    try:
        code = main(list(argv))
    except SystemExit as exit_:
        code = exit_.code
    out = capsys.readouterr()
    return code, out.out, out.err


MEMORY = ["simulate", "memory", "--stages", "2", "--microbatches", "4", "--layers", "4", "--block-size", "2",
          "--d-model", "64", "--heads", "4", "--seq-len", "32", "--tokens", "64", "--json"]


def test_memory_counts_a_tied_matrix_once_on_one_rank_and_a_copy_on_each_of_two(capsys):
    untied = json.loads(_cli(capsys, *MEMORY, "--schedule", "1f1b")[1])
    tied = json.loads(_cli(capsys, *MEMORY, "--schedule", "1f1b", "--tie-embeddings")[1])
    # 1f1b: the embedding on rank 0, the head's copy of the matrix on rank 1, as untied
    assert [r["param_bytes"] for r in tied["memory_per_rank"]] == [r["param_bytes"] for r in untied["memory_per_rank"]]
    untied = json.loads(_cli(capsys, *MEMORY, "--schedule", "zbv", "--virtual", "2")[1])
    tied = json.loads(_cli(capsys, *MEMORY, "--schedule", "zbv", "--virtual", "2", "--tie-embeddings")[1])
    # zbv: rank 0 holds the embedding and the head, one [V, d] matrix fewer when tied
    shrink = [u["param_bytes"] - t["param_bytes"] for u, t in zip(untied["memory_per_rank"],
                                                                  tied["memory_per_rank"], strict=True)]
    assert shrink == [4 * 256 * 64, 0]


def test_plan_searches_tied_embeddings_on_every_placement():
    cfg = ModelConfig(vocab_size=256, n_layers=8, d_model=64, n_heads=4, seq_len=32, tie_embeddings=True)
    found = candidates(PlanRequest(model=cfg, global_batch=16, gpus=4, gpu_memory_gib=80))
    assert {c.schedule for c in found if c.n_stages > 1} >= {"zbv", "dualpipev", "v_half", "v_min"}
    assert any(c.n_stages > 1 and c.schedule in ("1f1b", "interleaved_1f1b") for c in found)


@pytest.mark.parametrize("command", [
    ["simulate", "project", "--layers", "8", "--d-model", "64", "--block-size", "4", "--tokens", "64",
     "--stages", "2", "--microbatches", "4", "--seq-len", "32"],
    ["simulate", "schedule", "--schedule", "1f1b", "--stages", "2", "--microbatches", "4", "--layers", "8",
     "--block-size", "4", "--d-model", "64", "--seq-len", "32", "--tokens", "64"],
])
def test_recipe_flags_in_the_other_commands(command, capsys):
    code, _out, err = _cli(capsys, *command, "--kv-heads", "2")
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error:") and "--heads" in lines[0]
    code, _out, err = _cli(capsys, *command, "--heads", "4", "--kv-heads", "3")
    assert code == 2 and "n_kv_heads" in err
    for flags in (["--heads", "4", "--kv-heads", "2", "--qk-norm"], ["--mlp", "gelu", "--positions", "learned"]):
        assert _cli(capsys, *command, *flags)[0] == 0
