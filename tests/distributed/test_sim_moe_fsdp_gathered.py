"""`simulate memory`'s FSDP2 all-gathered parameters of a mixture of experts under expert parallelism
against counted runs (docs/spec.md sections 8 and 12). The runtime's meter counts a saved parameter
that is a copy (FSDP2's all-gather buffer) and not one that is the parameter itself; the same step
under replicate (thread ranks) and under fsdp (four local rank processes), with the same routing,
saves the same activations, so the activation peaks differ by exactly the all-gather buffers the
chunk's products save (`gathered_parameter_bytes`), P = 1.

D = 4, EP = 2: each expert slice (E / EP = 2 experts) is an FSDP2 unit over the D / EP = 2 "edp"
replicas that hold it, so its buffer is 2 rows (padded over edp), not 4 (padded over D, what
pricing it as any parameter gave). D = EP = 2: one holder, the slice stays whole: no buffer at all.
Held bytes (params, grads, AdamW) are compared for equality too."""

from __future__ import annotations

import json

import pytest

from attnres_pp.cli import main
from attnres_pp.comm.partition import make_partition
from attnres_pp.model.config import ModelConfig
from attnres_pp.simulator.memory import MemorySetup, gathered_parameter_bytes, predict_memory

pytestmark = pytest.mark.distributed

MODEL = dict(vocab_size=256, n_layers=2, d_model=32, n_heads=2, seq_len=16, residual="attnres", block_size=1,
             moe_experts=4, moe_top_k=2, moe_shared_experts=1, moe_d_ff=16, moe_dense_layers=1)
HELD = ("param_bytes", "grad_bytes", "optimizer_bytes")
MICROBATCHES, SEQUENCES_PER_MB = 2, 2


def train_argv(replicas: int, dp_shard: str, out) -> list[str]:
    m = MODEL
    return ["train", "--layers", str(m["n_layers"]), "--d-model", str(m["d_model"]), "--heads", str(m["n_heads"]),
            "--seq-len", str(m["seq_len"]), "--residual", "attnres", "--block-size", str(m["block_size"]),
            "--moe-experts", str(m["moe_experts"]), "--moe-top-k", str(m["moe_top_k"]),
            "--moe-shared-experts", str(m["moe_shared_experts"]), "--moe-d-ff", str(m["moe_d_ff"]),
            "--moe-dense-layers", str(m["moe_dense_layers"]), "--expert-parallel", "2",
            "--batch-size", str(replicas * MICROBATCHES * SEQUENCES_PER_MB), "--microbatches", str(MICROBATCHES),
            "--steps", "1", "--eval-every", "0", "--quiet", "--data-parallel", str(replicas), "--stages", "1",
            "--schedule", "1f1b", "--dp-shard", dp_shard,
            "--launcher", "local" if dp_shard == "fsdp" else "inprocess", "--out", str(out)]


def counted(replicas: int, dp_shard: str, out) -> list[dict]:
    assert main(train_argv(replicas, dp_shard, out)) == 0
    return json.loads((out / "summary.json").read_text())["memory_per_rank"]


@pytest.mark.parametrize("replicas", [4, 2])
def test_gathered_expert_slices_equal_a_counted_run(tmp_path, replicas):
    fsdp = counted(replicas, "fsdp", tmp_path / "fsdp")
    replicated = counted(replicas, "replicate", tmp_path / "replicate")
    cfg = ModelConfig(**MODEL)
    setup = MemorySetup(schedule="1f1b", n_stages=1, n_microbatches=MICROBATCHES,
                        tokens=SEQUENCES_PER_MB * MODEL["seq_len"], dtype="fp32", data_parallel=replicas,
                        dp_shard="fsdp", expert_parallel=2)
    predicted = predict_memory(cfg, setup)
    gathered = gathered_parameter_bytes(cfg, make_partition(cfg.n_layers, 1, 1), 0, data_parallel=replicas,
                                        dtype="fp32", expert_parallel=2)
    assert len(fsdp) == len(replicated) == len(predicted) == replicas
    for got, plain, want in zip(fsdp, replicated, predicted, strict=True):
        assert {k: got[k] for k in HELD} == {k: want.terms[k] for k in HELD}
        assert got["activation_peak_bytes"] - plain["activation_peak_bytes"] == gathered
