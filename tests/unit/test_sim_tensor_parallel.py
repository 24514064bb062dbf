"""Tensor and sequence parallelism in the simulator (docs/spec.md section 10; derived terms, no tp
runtime yet): hop bytes per tp rank, the per-layer tp collectives in closed form, the parameter and
activation shares of a tp rank, the planner's T search, and one `error:` line per broken rule."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from attnres_pp.cli import main
from attnres_pp.comm.partition import make_partition
from attnres_pp.comm.plan import hop_bytes_per_rank, plan_for_model, shard_tokens
from attnres_pp.model.config import ModelConfig
from attnres_pp.simulator.comm import COMM_MODES, comm_report
from attnres_pp.simulator.costs import ring_all_gather_s
from attnres_pp.simulator.layer_recipe import qkv_rows
from attnres_pp.simulator.memory import MemorySetup, predict_memory, rank_parameter_shapes
from attnres_pp.simulator.memory_features import activation_features
from attnres_pp.simulator.plan import Planner, PlanRequest, candidates, plan
from attnres_pp.simulator.tensor_parallel import (
    TP_SIZES,
    TensorParallel,
    layer_collective_s,
    layer_collectives,
)

VARIANTS = {
    "standard": dict(residual="standard"),
    "block": dict(residual="attnres", block_size=4),
    "full": dict(residual="attnres", block_size=1),
    "lr_projected": dict(residual="lr_attnres", block_size=4, key_mode="projected", key_rank=8),
    "lr_sliced": dict(residual="lr_attnres", block_size=4, key_mode="sliced", key_rank=8),
    "msar": dict(residual="msar", block_size=4),
}


def _model(variant: str = "block", **overrides) -> ModelConfig:
    values = dict(vocab_size=256, n_layers=8, d_model=64, n_heads=8, seq_len=64) | VARIANTS[variant] | overrides
    return ModelConfig(**values)


# ---- hops ----

@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("cache", [True, False])
def test_hop_bytes_per_rank_halve_at_t2(variant, cache):
    cfg = _model(variant)
    partition = make_partition(cfg.n_layers, 4, 2)
    payloads = plan_for_model(cfg, partition, cache)
    width = cfg.d_model if payloads.mode == "standard" else cfg.source_width
    one = hop_bytes_per_rank(payloads, tokens=256, width=width, element_bytes=2)
    two = hop_bytes_per_rank(payloads, tokens=256, width=width, element_bytes=2, tensor_parallel=2,
                             sequence_parallel=True)
    assert sum(one) > 0
    assert [2 * b for b in two] == one
    # Without sequence parallelism each tp rank sends the whole tensor.
    assert hop_bytes_per_rank(payloads, tokens=256, width=width, element_bytes=2, tensor_parallel=2) == one


def test_comm_report_and_planner_hops_per_rank_halve():
    one = comm_report(n_layers=8, block_size=4, n_stages=4, n_virtual=2, tokens=4096, d_model=1024,
                      source_width=1024)
    for t in (2, 4):
        other = comm_report(n_layers=8, block_size=4, n_stages=4, n_virtual=2, tokens=4096, d_model=1024,
                            source_width=1024, tensor_parallel=t, sequence_parallel=True)
        for mode in COMM_MODES:
            assert other.bytes_per_microbatch[mode] * t == one.bytes_per_microbatch[mode]
        assert other.to_dict()["tokens_per_rank"] == 4096 // t
    cfg = ModelConfig(vocab_size=32000, n_layers=8, d_model=1024, n_heads=8, seq_len=2048, block_size=4)
    planner = Planner(PlanRequest(model=cfg, global_batch=16, gpus=16, gpu_memory_gib=80.0))
    base = candidates(PlanRequest(model=cfg, global_batch=16, gpus=16, gpu_memory_gib=80.0))[0]
    base = dataclasses.replace(base, schedule="1f1b", n_stages=2, n_virtual=1, n_microbatches=2, data_parallel=8)
    sharded = dataclasses.replace(base, data_parallel=4, n_microbatches=4, tensor_parallel=2, sequence_parallel=True)
    assert planner.tokens(sharded) == planner.tokens(base)
    partition = planner.chunk_costs(base)[0]
    tensor_one = planner.hop_seconds(base, partition, planner.payloads(base, partition))[2]
    tensor_two = planner.hop_seconds(sharded, partition, planner.payloads(sharded, partition))[2]
    assert 2 * tensor_two == tensor_one


def test_shard_tokens_rule():
    assert shard_tokens(4096, 4, True) == 1024
    assert shard_tokens(4096, 4, False) == 4096
    with pytest.raises(ValueError, match="not divisible by --tensor-parallel 3"):
        shard_tokens(4096, 3, True)


# ---- the per-layer tp collectives ----

@pytest.mark.parametrize("t", [2, 4, 8])
def test_tp_collectives_per_layer_closed_form(t):
    tokens, d, element = 2 * 4096, 7168, 2
    activation = tokens * d * element  # b x s x d_model
    sp = layer_collectives(tokens, d, element, TensorParallel(t, True))
    assert sp == [
        {"kind": "all_gather", "count": 2, "buffer_bytes": activation,
         "sent_bytes_per_rank": (t - 1) * activation // t},
        {"kind": "reduce_scatter", "count": 2, "buffer_bytes": activation,
         "sent_bytes_per_rank": (t - 1) * activation // t}]
    no_sp = layer_collectives(tokens, d, element, TensorParallel(t, False))
    assert no_sp == [{"kind": "all_reduce", "count": 2, "buffer_bytes": activation,
                      "sent_bytes_per_rank": 2 * (t - 1) * activation // t}]
    # The same bytes leave each rank either way: 4 (T - 1) / T of the activation per direction.
    assert sum(c["count"] * c["sent_bytes_per_rank"] for c in sp) == 4 * (t - 1) * activation // t
    assert sum(c["count"] * c["sent_bytes_per_rank"] for c in no_sp) == 4 * (t - 1) * activation // t
    bandwidth, latency = 450e9, 2e-6
    closed = 4 * ((t - 1) / t * activation / bandwidth + (t - 1) * latency)
    for sequence_parallel in (True, False):
        seconds = layer_collective_s(tokens, d, element, TensorParallel(t, sequence_parallel),
                                     bytes_per_s=bandwidth, latency_s=latency)
        assert seconds == pytest.approx(closed)
    assert closed == pytest.approx(4 * ring_all_gather_s(activation, t, bandwidth, latency))
    assert layer_collectives(tokens, d, element, TensorParallel(1)) == []


def test_sequence_parallel_defaults_on_when_t_above_1():
    assert TensorParallel(2).sp and not TensorParallel(1).sp and not TensorParallel(2, False).sp


# ---- memory ----

def _split(shape: tuple[int, ...], cfg: ModelConfig) -> bool:
    d, f, w = cfg.d_model, cfg.ff_dim, cfg.source_width
    gate_up = 2 * f if cfg.mlp == "swiglu" else f
    return shape in {(qkv_rows(cfg), d), (w, d), (gate_up, d), (w, f)}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_split_matrices_are_1_over_t_and_replicated_ones_whole(variant):
    cfg = _model(variant, vocab_size=100, seq_len=32)  # no table shaped like a split matrix
    partition = make_partition(cfg.n_layers, 2, 1)
    for rank in range(2):
        whole = rank_parameter_shapes(cfg, partition, rank)
        split = [s for s in whole if _split(s, cfg)]  # embeddings and head replicated
        replicated = sum(math.prod(s) for s in whole) - sum(math.prod(s) for s in split)
        for t in (2, 4):
            local = rank_parameter_shapes(cfg, partition, rank, t)
            assert sum(math.prod(s) for s in local) == replicated + sum(math.prod(s) for s in split) // t
    setups = {t: MemorySetup(schedule="1f1b", n_stages=2, n_microbatches=2, tokens=128, dtype="fp32",
                             tensor_parallel=t) for t in (1, 4)}
    one, four = (predict_memory(cfg, setups[t]) for t in (1, 4))
    for a, b in zip(one, four, strict=True):
        assert b.terms["param_bytes"] < a.terms["param_bytes"]
        assert b.terms["optimizer_bytes"] == 2 * b.terms["param_bytes"]


def test_activations_scale_as_stated():
    cfg = _model("block")
    partition = make_partition(cfg.n_layers, 2, 1)
    base = activation_features(cfg, partition, 1, tokens=64, n_sequences=2, dtype="fp32")
    sp = activation_features(cfg, partition, 1, tokens=128, n_sequences=2, dtype="fp32", tensor_parallel=2,
                             sequence_parallel=True)
    assert sp == base  # under SP: the features of the rank's tokens / T
    full = activation_features(cfg, partition, 1, tokens=128, n_sequences=2, dtype="fp32")
    no_sp = activation_features(cfg, partition, 1, tokens=128, n_sequences=2, dtype="fp32", tensor_parallel=2)
    assert no_sp["layer_th"] * 2 == full["layer_th"] and no_sp["layer_tf"] * 2 == full["layer_tf"]
    assert no_sp["layer_td"] == full["layer_td"] and no_sp["seg_ntw"] == full["seg_ntw"]
    # The cache holds sequence shards: its peak halves exactly at T = 2 under SP.
    setup = dict(schedule="interleaved_1f1b", n_stages=2, n_virtual=2, n_microbatches=4, tokens=128, dtype="fp32")
    one = predict_memory(cfg, MemorySetup(**setup))
    two = predict_memory(cfg, MemorySetup(**setup, tensor_parallel=2))
    assert any(r.terms["cache_peak_bytes"] for r in one)
    for a, b in zip(one, two, strict=True):
        assert 2 * b.terms["cache_peak_bytes"] == a.terms["cache_peak_bytes"]
        assert b.terms["activation_peak_bytes"] < a.terms["activation_peak_bytes"]


# ---- the planner ----

def _request(**overrides) -> PlanRequest:
    cfg = ModelConfig(vocab_size=32000, n_layers=8, d_model=1536, n_heads=12, seq_len=2048, block_size=4)
    values = dict(model=cfg, global_batch=16, gpus=8, gpu_memory_gib=40.0, top=400,
                  tensor_parallel_sizes=TP_SIZES)
    return PlanRequest(**(values | overrides))


def test_plan_searches_the_legal_t_and_rows_carry_it():
    request = _request()
    assert request.legal_tp_sizes() == [1, 2, 4]  # 12 heads: not 8
    found = {c.tensor_parallel for c in candidates(request)}
    assert found == {1, 2, 4}
    assert all(c.sequence_parallel == (c.tensor_parallel > 1) for c in candidates(request))
    rows = plan(request, evaluate_at_most=64)
    assert {row["config"]["tensor_parallel"] for row in rows} > {1}
    for row in rows:
        c = row["config"]
        assert c["tensor_parallel"] * c["n_stages"] * c["data_parallel"] == request.gpus
    # A 4-GPU node bounds T at 4; a fixed T is the only one.
    assert _request(gpus_per_node=2).legal_tp_sizes() == [1, 2]
    assert {c.tensor_parallel for c in candidates(_request(tensor_parallel_sizes=(2,)))} == {2}


_PLAN = ["simulate", "plan", "--layers", "8", "--d-model", "1536", "--heads", "12", "--seq-len", "2048",
         "--vocab-size", "32000", "--global-batch", "16", "--gpus", "8", "--gpu-memory-gib", "40"]


def test_plan_cli_table_json_and_why(capsys):
    assert main(_PLAN + ["--tensor-parallel", "2", "--top", "2", "--why", "1"]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if "schedule" in line)
    assert header.split()[:3] == ["#", "schedule", "T"]
    assert "tp collectives (T=2, SP on" in out and "tp all-reduce of replicated gradients" in out
    assert "--tensor-parallel 2" in out
    assert main(_PLAN + ["--tensor-parallel", "2", "--top", "2", "--json", "--why", "1"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert all(row["config"]["tensor_parallel"] == 2 and row["config"]["sequence_parallel"]
               for row in payload["rows"])
    why = payload["why"]["time_s"]
    assert sum(why.values()) == pytest.approx(payload["rows"][0]["step_time_s"])
    assert why["tp collectives (T=2, SP on, busiest rank)"] > 0


# ---- bad input: one `error:` line each, exit 2, naming the rule ----

_MEMORY = ["simulate", "memory", "--schedule", "1f1b", "--stages", "2", "--microbatches", "2", "--layers", "4",
           "--d-model", "64", "--heads", "4", "--seq-len", "64", "--tokens", "128"]
_COMM = ["simulate", "comm", "--layers", "4", "--block-size", "2", "--stages", "2", "--d-model", "64",
         "--tokens", "128"]


@pytest.mark.parametrize("argv, rule", [
    (_MEMORY + ["--tensor-parallel", "8"], "does not divide the 4 heads"),
    (_COMM + ["--heads", "2", "--tensor-parallel", "4"], "does not divide the 2 heads"),
    (_MEMORY + ["--tensor-parallel", "4", "--d-ff", "66"], "does not divide d_ff = 66"),
    (_MEMORY[:-4] + ["--seq-len", "66", "--tokens", "132", "--tensor-parallel", "4"],
     "does not divide --seq-len 66"),
    (_COMM + ["--heads", "16", "--tensor-parallel", "16"], "larger than a node's 8 GPUs"),
    (_MEMORY + ["--tensor-parallel", "2", "--ranks", "6"], "T x P x D = 2 x 2 x 1 = 4 is not the 6 ranks"),
    (_PLAN + ["--tensor-parallel", "16", "--heads", "16"], "larger than a node's 8 GPUs"),
    (_PLAN + ["--tensor-parallel", "8"], "does not divide the 12 heads"),
    (_PLAN[:-4] + ["--gpus", "6", "--gpu-memory-gib", "40", "--tensor-parallel", "4"],
     "does not divide --gpus 6: T x P x D must equal the GPUs"),
])
def test_bad_input_is_one_error_line(capsys, argv, rule):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and rule in err, err


def test_bench_comm_shows_hop_bytes_per_tp_rank():
    from attnres_pp.bench.comm import tp_hop_rows

    rows = tp_hop_rows(quick=True)
    assert {r["mode"] for r in rows} == set(COMM_MODES)
    for row in rows:
        per_rank = row["bytes_per_step_per_tp_rank"]
        assert per_rank["1"] == 2 * per_rank["2"] == 4 * per_rank["4"] > 0


@pytest.mark.distributed
def test_bench_comm_counts_hop_bytes_per_tp_lane_on_gloo_ranks():
    """One training step on P x T = 2 x 2 local rank processes: every rank sent half the T = 1 lane's
    bytes per stage, and each tp lane's total equals the simulator's count."""
    from attnres_pp.bench.comm import count_tp_hop_bytes

    row = count_tp_hop_bytes("cached", 2)
    assert row["match"] and len(row["counted_bytes_per_rank"]) == 4
    assert row["counted_bytes_per_tp_lane"] == [row["predicted_bytes_per_tp_lane"]] * 2
    assert row["predicted_bytes_per_tp_lane"] > 0


def test_comm_schedule_and_memory_cli_take_the_tp_flags(capsys):
    assert main(_COMM + ["--tensor-parallel", "2", "--json"]) == 0
    two = json.loads(capsys.readouterr().out)
    assert main(_COMM + ["--json"]) == 0
    one = json.loads(capsys.readouterr().out)
    assert two["tensor_parallel"] == 2 and two["sequence_parallel"] and two["tokens_per_rank"] == 64
    assert {m: 2 * b for m, b in two["bytes_per_microbatch"].items()} == one["bytes_per_microbatch"]
    assert [c["kind"] for c in two["tp_collectives_per_layer"]] == ["all_gather", "reduce_scatter"]
    assert two["tp_collective_s_per_layer"] > 0 and one["tp_collectives_per_layer"] == []
    schedule = ["simulate", "schedule", "--schedule", "1f1b", "--stages", "2", "--microbatches", "4", "--layers", "4",
                "--block-size", "2", "--d-model", "64", "--tokens", "128", "--costs", "model", "--json"]
    assert main(schedule) == 0
    base = json.loads(capsys.readouterr().out)
    assert main(schedule + ["--tensor-parallel", "2"]) == 0
    tp = json.loads(capsys.readouterr().out)
    assert tp["tensor_parallel"] == 2 and tp["makespan"] != base["makespan"]
    assert main(schedule[:-3] + ["--tensor-parallel", "2", "--no-sequence-parallel", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["sequence_parallel"] is False
    assert main(_MEMORY + ["--tensor-parallel", "2", "--ranks", "4", "--json"]) == 0
    memory = json.loads(capsys.readouterr().out)
    assert memory["tensor_parallel"] == 2 and len(memory["memory_per_rank"]) == 2


def test_plan_without_sequence_parallelism():
    request = _request(tensor_parallel_sizes=(4,), sequence_parallel=False, top=4)
    rows = plan(request)
    assert rows and all(r["config"]["tensor_parallel"] == 4 and not r["config"]["sequence_parallel"] for r in rows)
    assert all(r["dp_collectives"]["tp_all_reduce_s"] == 0 for r in rows)
    # A tp rank's hop pair carries the whole tensor without SP.
    c = rows[0]["config"]
    tensor = c["tokens_per_microbatch"] * request.model.source_width * 2
    assert rows[0]["bytes_per_hop"] % tensor == 0


def test_msar_halo_under_sequence_parallelism_only():
    from attnres_pp.simulator.tensor_parallel import chunk_tp_seconds, halo_bytes

    cfg = _model("msar")
    # Sublayer 0 reads b_0; sublayer 1 reads b_0 and the open partial: three sources, (12 - 1) tokens each.
    expected = 3 * (max(cfg.stream_kernels) - 1) * 2 * cfg.d_model * 2
    assert halo_bytes(cfg, range(0, 2), n_sequences=2, element_bytes=2, tp=TensorParallel(2)) == expected
    assert halo_bytes(cfg, range(0, 2), n_sequences=2, element_bytes=2, tp=TensorParallel(2, False)) == 0
    assert halo_bytes(_model("block"), range(0, 2), n_sequences=2, element_bytes=2, tp=TensorParallel(2)) == 0
    link = dict(tokens=128, element_bytes=2, bytes_per_s=1e9, latency_s=1e-6)
    with_halo = chunk_tp_seconds(cfg, range(0, 2), tp=TensorParallel(2), **link)
    without = chunk_tp_seconds(_model("block"), range(0, 2), tp=TensorParallel(2), **link)
    assert with_halo == pytest.approx(without + 2 * 1e-6 + expected / 1e9)
