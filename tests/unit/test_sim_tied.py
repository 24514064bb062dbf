"""The embedding group's all-reduce in the simulator's step (docs/simulator.md): with tied embeddings
whose copies sit on two pipeline ranks, `simulate plan` (its estimate, its row and `--why`),
`simulate schedule --costs model` and `simulate project` add exactly one ring all-reduce over two
ranks of the fp32 V x d gradient (its FSDP2 shard under fsdp), 2 x bytes x (2 - 1) / 2 on the link
between the first and the last rank and two latencies; nothing at P = 1 or under the V-shaped
placement (zbv, dualpipev, v_half, v_min put the embedding and the head on rank 0)."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from attnres_pp.cli import main
from attnres_pp.model.config import ModelConfig
from attnres_pp.simulator.costs import PROFILES
from attnres_pp.simulator.plan import Planner, PlanRequest
from attnres_pp.simulator.plan_request import Candidate
from attnres_pp.simulator.project import Cluster, project

V, D_MODEL = 32000, 1024
UNTIED = ModelConfig(vocab_size=V, n_layers=8, d_model=D_MODEL, n_heads=8, seq_len=512, block_size=2)
TIED = dataclasses.replace(UNTIED, tie_embeddings=True)


def _expected_s(n_bytes: float, gbps: float, latency_us: float) -> float:
    """Ring all-reduce over n = 2 members: 2 x bytes x (n - 1) / n on the wire, n - 1 steps each way."""
    n = 2
    return 2 * n_bytes * (n - 1) / n / (gbps * 1e9 / 8) + 2 * (n - 1) * latency_us * 1e-6


def _prices(cfg: ModelConfig, candidate: Candidate, gpus_per_node: int) -> tuple[float, float, dict]:
    """(estimated step, the row's step, the row's --why time terms) of `candidate` for `cfg`."""
    gpus = candidate.n_stages * candidate.data_parallel
    planner = Planner(PlanRequest(model=cfg, global_batch=16, gpus=gpus, gpu_memory_gib=80.0,
                                  gpus_per_node=gpus_per_node))
    step, _peak = planner.estimate(candidate)
    why = planner.explain(candidate)
    assert sum(seconds for _label, seconds in why["time"]) == pytest.approx(why["row"]["step_time_s"], rel=1e-9)
    return step, why["row"]["step_time_s"], dict(why["time"])


@pytest.mark.parametrize(("stages", "data_parallel", "dp_shard", "gpus_per_node", "across"), [
    (4, 1, "replicate", 8, False),  # one node: the intra-node link
    (4, 1, "replicate", 2, True),   # ranks 0 and 3 on two nodes: the network
    (2, 2, "replicate", 8, False),
    (2, 2, "fsdp", 2, False),       # each replica's pair on a node of its own; the shard's bytes
    (3, 2, "fsdp", 4, True),        # replica 1's ranks 3..5 span nodes 0 and 1
])
def test_the_planned_step_grows_by_the_embedding_groups_all_reduce(stages, data_parallel, dp_shard,
                                                                   gpus_per_node, across):
    candidate = Candidate(schedule="1f1b", n_stages=stages, n_virtual=1, n_microbatches=4,
                          data_parallel=data_parallel, block_size=2, dp_shard=dp_shard, activation_checkpoint="none")
    untied = _prices(UNTIED, candidate, gpus_per_node)
    tied = _prices(TIED, candidate, gpus_per_node)
    rows = V if dp_shard == "replicate" else math.ceil(V / data_parallel)  # FSDP2's dim-0 shard
    request = PlanRequest(model=TIED, global_batch=16, gpus=1, gpu_memory_gib=1.0)
    gbps = request.inter_node_gbps if across else request.intra_node_gbps
    want = _expected_s(4 * rows * D_MODEL, gbps, request.latency_us)
    assert tied[0] - untied[0] == pytest.approx(want, rel=1e-9)
    assert tied[1] - untied[1] == pytest.approx(want, rel=1e-9)
    assert tied[2]["embedding group all-reduce (tied copies, first and last rank)"] == pytest.approx(want, rel=1e-12)
    assert "embedding group all-reduce (tied copies, first and last rank)" not in untied[2]


@pytest.mark.parametrize(("schedule", "stages", "virtual", "microbatches"), [
    ("1f1b", 1, 1, 4), ("zbv", 2, 2, 4), ("dualpipev", 2, 2, 4), ("v_half", 2, 2, 4), ("v_min", 2, 2, 4)])
def test_one_rank_holding_the_one_matrix_pays_nothing(schedule, stages, virtual, microbatches):
    """At D = 1 the tied step is the untied one; at D = 2 no embedding group either (the one matrix
    makes the data-parallel all-reduce V x d smaller than the untied model's two)."""
    candidate = Candidate(schedule=schedule, n_stages=stages, n_virtual=virtual, n_microbatches=microbatches,
                          data_parallel=1, block_size=2, dp_shard="replicate", activation_checkpoint="none")
    untied, tied = _prices(UNTIED, candidate, 8), _prices(TIED, candidate, 8)
    assert tied[0] == untied[0] and tied[1] == untied[1]
    assert "embedding group all-reduce (tied copies, first and last rank)" not in tied[2]
    replicated = dataclasses.replace(candidate, data_parallel=2)
    planner = Planner(PlanRequest(model=TIED, global_batch=16, gpus=2 * stages, gpu_memory_gib=80.0))
    assert planner.dp_collectives(replicated, planner.partition(replicated))["embed_all_reduce_s"] == 0.0


def _schedule_json(capsys, *extra: str) -> dict:
    argv = ["simulate", "schedule", "--schedule", "1f1b", "--stages", "4", "--microbatches", "8", "--costs", "model",
            "--layers", "8", "--block-size", "2", "--d-model", str(D_MODEL), "--vocab-size", str(V), "--json", *extra]
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_simulate_schedule_prices_the_group_on_the_profiles_link(capsys):
    untied = _schedule_json(capsys)
    tied = _schedule_json(capsys, "--tie-embeddings")
    profile = PROFILES["h100-ib"]
    want = _expected_s(4 * V * D_MODEL, profile.link_bytes_per_s * 8 / 1e9, profile.link_latency_s * 1e6)
    assert "embed_all_reduce_s" not in untied and tied["makespan"] == untied["makespan"]
    assert tied["embed_all_reduce_bytes"] == 4 * V * D_MODEL
    assert tied["embed_all_reduce_s"] == pytest.approx(want, rel=1e-12)
    assert tied["step_s"] == pytest.approx(tied["makespan"] + want, rel=1e-12)
    vshape = _schedule_json(capsys, "--tie-embeddings", "--schedule", "zbv", "--virtual", "2")
    assert "embed_all_reduce_s" not in vshape


def test_simulate_project_adds_the_group_to_every_mode():
    cluster = Cluster(schedule="1f1b", n_stages=4, n_microbatches=8, data_parallel=2, link_gbs=50.0,
                      link_latency_us=10.0)
    untied, tied = (project(cfg, tokens=1024, dtype_bytes=2, cluster=cluster) for cfg in (UNTIED, TIED))
    want = _expected_s(4 * V * D_MODEL, 50.0 * 8, 10.0)
    for u, t in zip(untied, tied, strict=True):
        assert u["embed_all_reduce_s"] == 0.0
        assert t["step_s"] - u["step_s"] == pytest.approx(want, rel=1e-9)
