"""`simulate memory`'s param/grad/optimizer bytes against a real run's `memory_per_rank`: MSAR (its
tied stream convolutions stay whole under FSDP2) under zbv and interleaved 1F1B at V = 2 and 1F1B,
replicated and FSDP2 over D = 2, one small run per case: FSDP2's on local rank processes (it needs a
process group per rank), the replicated ones on thread ranks (`--launcher inprocess`), which hold and
count what the rank processes do (the same StageWorker, the same partition; D = 2 x P = 2 at zbv
gives the local launcher's memory_per_rank entry for entry) without starting four processes."""

from __future__ import annotations

import json

import pytest

from attnres_pp.cli import main
from attnres_pp.model.config import ModelConfig
from attnres_pp.simulator.memory import MemorySetup, predict_memory

pytestmark = pytest.mark.distributed

MODEL = dict(vocab_size=256, n_layers=4, d_model=32, n_heads=2, seq_len=16, residual="msar", block_size=2)
HELD = ("param_bytes", "grad_bytes", "optimizer_bytes")


LAYOUTS = (("zbv", 2), ("interleaved_1f1b", 2), ("1f1b", 1))


def train_argv(schedule: str, virtual: int, dp_shard: str, out) -> list[str]:
    m = MODEL
    return ["train", "--layers", str(m["n_layers"]), "--d-model", str(m["d_model"]), "--heads", str(m["n_heads"]),
            "--seq-len", str(m["seq_len"]), "--residual", "msar", "--block-size", str(m["block_size"]),
            "--batch-size", "8", "--microbatches", "2", "--steps", "1", "--eval-every", "0", "--quiet",
            "--data-parallel", "2", "--stages", "2", "--virtual", str(virtual), "--schedule", schedule,
            "--dp-shard", dp_shard, "--launcher", "local" if dp_shard == "fsdp" else "inprocess", "--out", str(out)]


# Every layout replicated (thread ranks). Under FSDP2 (rank processes): ZB-V's and interleaved 1F1B's
# V = 2 placements are RECIPE_RUNS' fsdp runs, the same MSAR model, layout and shards, with MQA heads,
# QK-norm and GELU (ZB-V) or tied embeddings (interleaved: the plain layer's SwiGLU and full-head
# shapes) on top; the V = 1 placement with the untied LM head, and experts split over EP = 2 under
# FSDP2, are the expert run's of tests/distributed/test_expert_parallel_gloo.py (D = 2, P = 2, its
# first layer the plain dense one, --moe-dense-layers 1), checked against the same prediction.
REAL_RUNS = [(schedule, virtual, "replicate") for schedule, virtual in LAYOUTS]


@pytest.mark.parametrize("schedule,virtual,dp_shard", REAL_RUNS)
def test_predicted_held_bytes_equal_a_real_run(tmp_path, schedule, virtual, dp_shard):
    m = MODEL
    assert main(train_argv(schedule, virtual, dp_shard, tmp_path)) == 0
    got = json.loads((tmp_path / "summary.json").read_text())["memory_per_rank"]
    setup = MemorySetup(schedule=schedule, n_stages=2, n_virtual=virtual, n_microbatches=2, tokens=4 * m["seq_len"],
                        dtype="fp32", data_parallel=2, dp_shard=dp_shard)
    want = predict_memory(ModelConfig(**m), setup)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert {k: g[k] for k in HELD} == {k: w.terms[k] for k in HELD}


# The layer recipe (docs/spec.md section 11) in the held bytes: multi-query heads with QK-norm and
# tied embeddings (V-shaped: the embedding and the head on rank 0; interleaved: a copy on each of the
# first and the last rank, replicated and under FSDP2), and grouped heads under FSDP2.
RECIPE_RUNS = (("zbv", "replicate", ["--kv-heads", "1", "--qk-norm", "--tie-embeddings"],
                {"n_kv_heads": 1, "qk_norm": True, "tie_embeddings": True}),
               ("zbv", "fsdp", ["--kv-heads", "1", "--qk-norm", "--mlp", "gelu"],
                {"n_kv_heads": 1, "qk_norm": True, "mlp": "gelu"}),
               # tied on the loop placement: the last rank holds the LM head's copy of the matrix
               ("interleaved_1f1b", "fsdp", ["--tie-embeddings"], {"tie_embeddings": True}),
               ("interleaved_1f1b", "replicate", ["--tie-embeddings", "--kv-heads", "1"],
                {"tie_embeddings": True, "n_kv_heads": 1}))


@pytest.mark.parametrize("schedule,dp_shard,flags,recipe", RECIPE_RUNS)
def test_predicted_held_bytes_follow_the_recipe(tmp_path, schedule, dp_shard, flags, recipe):
    m = MODEL
    assert main([*train_argv(schedule, 2, dp_shard, tmp_path), *flags]) == 0
    got = json.loads((tmp_path / "summary.json").read_text())["memory_per_rank"]
    setup = MemorySetup(schedule=schedule, n_stages=2, n_virtual=2, n_microbatches=2, tokens=4 * m["seq_len"],
                        dtype="fp32", data_parallel=2, dp_shard=dp_shard)
    want = predict_memory(ModelConfig(**m, **recipe), setup)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert {k: g[k] for k in HELD} == {k: w.terms[k] for k in HELD}


# Mixtures of experts (docs/spec.md section 12): routed experts split over EP = 2 replicas, replicated
# here (thread ranks): EP > 1 out of sample; under FSDP2 (which leaves the expert slices and the selection
# bias whole) in the rank processes of tests/distributed/test_expert_parallel_gloo.py.
MOE_FLAGS = ["--moe-experts", "4", "--moe-top-k", "2", "--moe-shared-experts", "1", "--moe-d-ff", "16",
             "--moe-dense-layers", "1", "--expert-parallel", "2"]
MOE = {"moe_experts": 4, "moe_top_k": 2, "moe_shared_experts": 1, "moe_d_ff": 16, "moe_dense_layers": 1}


@pytest.mark.parametrize("dp_shard", ["replicate"])
def test_predicted_held_bytes_split_the_experts_over_expert_parallel_ranks(tmp_path, dp_shard):
    m = MODEL
    assert main([*train_argv("1f1b", 1, dp_shard, tmp_path), *MOE_FLAGS]) == 0
    got = json.loads((tmp_path / "summary.json").read_text())["memory_per_rank"]
    setup = MemorySetup(schedule="1f1b", n_stages=2, n_virtual=1, n_microbatches=2, tokens=2 * m["seq_len"],
                        dtype="fp32", data_parallel=2, dp_shard=dp_shard, expert_parallel=2)
    want = predict_memory(ModelConfig(**m, **MOE), setup)
    whole = predict_memory(ModelConfig(**m, **MOE), MemorySetup(
        schedule="1f1b", n_stages=2, n_virtual=1, n_microbatches=2, tokens=2 * m["seq_len"], dtype="fp32",
        data_parallel=2, dp_shard=dp_shard))
    assert len(got) == len(want)
    for g, w, w1 in zip(got, want, whole, strict=True):
        assert {k: g[k] for k in HELD} == {k: w.terms[k] for k in HELD}
        if dp_shard == "replicate":  # each rank holds half the routed experts (fsdp: half of each at EP = 1)
            assert w.terms["param_bytes"] < w1.terms["param_bytes"]
