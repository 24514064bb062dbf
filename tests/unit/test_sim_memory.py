"""`simulator.memory` and `attnres-pp simulate memory`: parameter, gradient and AdamW bytes exactly
as a rank's real modules and optimizer hold them; the activation units against saved-tensor-hook
counts of chunks they were not fitted on; the walk over the action order against hand counts."""

from __future__ import annotations

import json
import random
import statistics

import pytest
import torch

from attnres_lab.memory_units import COMMAND, VARIANTS, measure_case, random_case
from attnres_pp.cli import main
from attnres_pp.comm.partition import make_partition
from attnres_pp.comm.plan import plan_for_model
from attnres_pp.model.config import ModelConfig
from attnres_pp.pipeline.chunk import build_rank_model, rank_parameters
from attnres_pp.schedule.schedules import build_schedule
from attnres_pp.simulator.memory import (
    FEATURES,
    ChunkActivation,
    MemorySetup,
    load_units,
    predict_memory,
    rank_parameter_shapes,
    shard_numel,
    state_bytes,
    units_key,
    walk_rank,
)
from attnres_pp.simulator.metrics import peak_cache_tensors
from attnres_pp.train.config import TrainConfig
from attnres_pp.train.optim import build_optimizer


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


# The layer recipes (docs/spec.md section 11) the held bytes must follow: the checkpoints' legacy one,
# today's default, grouped kv heads with QK-norm, multi-query with tied embeddings.
RECIPES = {
    "legacy": {"positions": "learned", "mlp": "gelu"},
    "default": {},
    "gqa_qk_norm": {"n_kv_heads": 2, "qk_norm": True},
    "mqa_tied": {"n_kv_heads": 1, "tie_embeddings": True, "mlp": "gelu"},
}


# Tied embeddings: one matrix on rank 0 (V-shaped), or a copy on each of the first and last rank (loop).
PLACED_RECIPES = [(placement, recipe) for placement in ("loop", "vshape") for recipe in sorted(RECIPES)]


@pytest.mark.parametrize("residual,key_mode", VARIANTS)
@pytest.mark.parametrize("placement,recipe", PLACED_RECIPES)
@pytest.mark.parametrize("key_norm_gain", [False, True])
def test_state_bytes_equal_a_real_rank_and_adamw(residual, key_mode, placement, recipe, key_norm_gain):
    cfg = ModelConfig(vocab_size=40, n_layers=5, d_model=16, n_heads=4, seq_len=8, residual=residual,
                      block_size=3, key_mode=key_mode, key_rank=4, key_norm_gain=key_norm_gain, **RECIPES[recipe])
    partition = make_partition(cfg.n_layers, 2, 2, layer_counts=(2, 1, 1, 1), placement=placement)
    for pp_rank in range(2):
        model, chunks = build_rank_model(cfg, partition, pp_rank, seed=0)
        params = list(rank_parameters(chunks, model).values())
        shapes = rank_parameter_shapes(cfg, partition, pp_rank)
        assert [tuple(p.shape) for p in params] == shapes  # the modules' order, the tied matrix once
        optimizer = build_optimizer(rank_parameters(chunks, model).items(), TrainConfig())
        for p in params:
            p.grad = torch.ones_like(p)
        optimizer.step()
        # docs/spec.md section 8: the two moments (AdamW's 0-d `step` tensors are not optimizer_bytes)
        state = [t for per_param in optimizer.state.values() for key, t in per_param.items()
                 if key in ("exp_avg", "exp_avg_sq")]
        predicted = state_bytes(shapes, data_parallel=1, dp_shard="replicate")
        assert predicted == {"param_bytes": _tensor_bytes(params), "grad_bytes": _tensor_bytes(p.grad for p in params),
                             "optimizer_bytes": _tensor_bytes(state)}


def test_fsdp_shards_pad_dim0():
    assert shard_numel((10, 3), 4, "fsdp") == 3 * 3  # ceil(10 / 4) = 3 rows of 3
    assert shard_numel((10, 3), 4, "replicate") == 30
    assert shard_numel((), 4, "fsdp") == 1
    full = state_bytes([(8, 2), (5,)], data_parallel=1, dp_shard="fsdp")
    half = state_bytes([(8, 2), (5,)], data_parallel=2, dp_shard="fsdp")
    assert half["param_bytes"] == 4 * (8 + 3) and full["param_bytes"] == 4 * 21
    assert half["optimizer_bytes"] == 8 * 11  # two moments of the local shard
    # AdamW's moments follow the unpadded local shard: replica 1 holds 2 of the 5 rows of (5,).
    assert state_bytes([(8, 2), (5,)], data_parallel=2, dp_shard="fsdp", dp_rank=1)["optimizer_bytes"] == 8 * 10
    assert half["param_bytes"] == state_bytes([(8, 2), (5,)], data_parallel=2, dp_shard="fsdp",
                                              dp_rank=1)["param_bytes"]


def test_units_are_in_the_file_with_their_command():
    units = load_units()
    assert units["command"] == COMMAND  # how to make the file again: `attnres-lab fit-memory-units --out FILE`
    assert units["features"] == list(FEATURES)
    for residual, key_mode in VARIANTS:
        for dtype in ("fp32", "bf16"):
            cfg = ModelConfig(residual=residual, key_mode=key_mode)
            assert units_key(cfg, dtype) in units["units"]


@pytest.mark.parametrize("residual,key_mode", VARIANTS)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_activation_units_predict_unseen_chunks(residual, key_mode, dtype):
    """Held out: another seed and every size doubled (widths, sequence, vocabulary) beyond the fitted grid."""
    from attnres_pp.simulator.memory import activation_bytes

    torch.set_num_threads(1)
    rng = random.Random(f"held-out/{residual}/{key_mode}/{dtype}")
    errors = []
    for _ in range(4):
        case = random_case(rng, residual, key_mode, scale=2)
        _features, measured = measure_case(case, dtype)
        cfg = case["cfg"]
        partition = make_partition(cfg.n_layers, case["n_stages"], case["n_virtual"])
        predicted = activation_bytes(cfg, partition, case["chunk"], tokens=case["n_sequences"] * cfg.seq_len,
                                     dtype=dtype).saved
        errors.append(abs(predicted - measured) / measured)
    assert statistics.median(errors) <= 0.05 and max(errors) <= 0.10, errors


class _A:
    def __init__(self, text: str) -> None:
        from attnres_pp.schedule.ir import Action

        action = Action.parse(text)
        self.kind, self.chunk_index, self.microbatch_index = action.kind, action.chunk_index, action.microbatch_index


def test_walk_counts_in_flight_forwards_and_split_backward():
    saved = [ChunkActivation(saved=10), ChunkActivation(saved=100)]
    actions = [_A(a) for a in ("F0.0", "F0.1", "B0.0", "F0.2", "B0.1", "B0.2")]
    assert walk_rank(actions, saved_by_chunk=saved, plan=None, tensor_bytes=1) == (20, 0, 20, "F0.1")
    # Chunk 0's I has no inputs and frees nothing; its W is the whole backward.
    actions = [_A(a) for a in ("F0.0", "I0.0", "F0.1", "W0.0", "I0.1", "W0.1")]
    assert walk_rank(actions, saved_by_chunk=saved, plan=None, tensor_bytes=1)[:2] == (20, 0)
    # Another chunk's I frees what F saved and leaves the W store, which W frees.
    stored = [ChunkActivation(saved=10), ChunkActivation(saved=100, stored=30)]
    actions = [_A(a) for a in ("F1.0", "I1.0", "F1.1", "W1.0", "I1.1", "W1.1")]
    assert walk_rank(actions, saved_by_chunk=stored, plan=None, tensor_bytes=1)[:2] == (130, 0)


def test_cache_peak_within_the_entry_count_bound():
    """Values and deposits never outnumber docs/spec.md section 4's entries alive from put to collection."""
    cfg = ModelConfig(n_layers=16, d_model=32, n_heads=1, seq_len=16, block_size=4)
    for name, virtual in (("interleaved_1f1b", 2), ("interleaved_zb", 4), ("zbv", 2)):
        setup = MemorySetup(schedule=name, n_stages=4, n_virtual=virtual, n_microbatches=8, tokens=16, dtype="fp32")
        ranks = predict_memory(cfg, setup)
        schedule = build_schedule(name, 4, virtual, 8)
        partition = make_partition(16, 4, virtual, placement="vshape" if name == "zbv" else "loop")
        bound = peak_cache_tensors(schedule, plan_for_model(cfg, partition, True))
        tensor = 16 * 32 * 4
        for rank, entries in zip(ranks, bound, strict=False):
            assert 0 < rank.terms["cache_peak_bytes"] <= entries * tensor
    standard = predict_memory(ModelConfig(n_layers=4, residual="standard"),
                              MemorySetup(schedule="1f1b", n_stages=2, n_microbatches=4, tokens=64))
    assert all(r.terms["cache_peak_bytes"] == 0 for r in standard)


def test_cli_json_lists_global_ranks(capsys):
    argv = ["simulate", "memory", "--schedule", "1f1b", "--stages", "2", "--microbatches", "4", "--layers", "4",
            "--block-size", "2", "--d-model", "64", "--seq-len", "32", "--tokens", "64", "--vocab-size", "100",
            "--data-parallel", "2", "--dp-shard", "fsdp", "--json"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert len(report["memory_per_rank"]) == 4 == len(report["peak_action_per_rank"])
    first, other = report["memory_per_rank"][0], report["memory_per_rank"][2]  # same pp rank, other replica
    assert {k: v for k, v in first.items() if k != "optimizer_bytes"} == {
        k: v for k, v in other.items() if k != "optimizer_bytes"}
    assert first["optimizer_bytes"] >= other["optimizer_bytes"]
    assert set(report["memory_per_rank"][0]) == {"param_bytes", "grad_bytes", "optimizer_bytes",
                                                 "activation_peak_bytes", "cache_peak_bytes",
                                                 "transport_buffer_bytes"}
    assert report["peak_action_per_rank"][0].startswith("F0.")


@pytest.mark.parametrize("flag,value", [("--dp-shard", "zero3"), ("--activation-checkpoint", "some"),
                                        ("--stages", "0")])
def test_cli_bad_values_exit_2(flag, value, capsys):
    argv = ["simulate", "memory", "--schedule", "1f1b", "--stages", "2", "--microbatches", "4", "--layers", "4",
            "--block-size", "2", flag, value]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_cli_refuses_too_many_chunks(capsys):
    argv = ["simulate", "memory", "--schedule", "interleaved_1f1b", "--stages", "4", "--virtual", "2",
            "--microbatches", "4", "--layers", "4", "--block-size", "2"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error:" in err
