"""The simulator and the planner know mixtures of experts (docs/spec.md section 12): total and active
parameters equal the modules' counts, the FLOPs per token count the MoE sublayer's real products,
what an MoE sublayer saves for backward is what the meter counts, the held bytes equal a real run's,
the all-to-all bytes and time follow docs/spec.md section 12's rule, and the plan searches EP and prints runnable
MoE commands."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from attnres_pp.cli import build_parser, main
from attnres_pp.comm.partition import make_partition
from attnres_pp.model.config import ModelConfig
from attnres_pp.model.layers import MLP
from attnres_pp.model.moe import MoE
from attnres_pp.model.transformer import Transformer, active_parameter_count, parameter_count
from attnres_pp.pipeline.memory_meter import ActivationMeter
from attnres_pp.simulator.collectives import all_to_all_s
from attnres_pp.simulator.costs import chunk_forward_flops
from attnres_pp.simulator.layer_recipe import mlp_flops_per_token, moe_flops_per_token
from attnres_pp.simulator.memory import local_numel, rank_parameter_shapes, rank_state_bytes
from attnres_pp.simulator.moe import all_to_all_bytes, moe_saved_bytes, parameter_counts
from attnres_pp.simulator.plan import PlanRequest, make_plan

MOE = {
    "shared_dense": {"moe_experts": 8, "moe_top_k": 2, "moe_shared_experts": 1, "moe_d_ff": 48,
                     "moe_dense_layers": 1},
    "no_shared_sigmoid": {"moe_experts": 4, "moe_top_k": 3, "moe_router": "sigmoid"},
    "plr_two_shared": {"moe_experts": 6, "moe_top_k": 2, "moe_shared_experts": 2, "residual": "lr_attnres",
                       "key_mode": "projected", "key_rank": 8, "block_size": 2},
    "msar_gelu_dense": {"moe_experts": 8, "moe_top_k": 1, "moe_dense_layers": 2, "residual": "msar",
                        "block_size": 2, "mlp": "gelu"},
}


def _cfg(name: str, **fields) -> ModelConfig:
    base = {"vocab_size": 64, "n_layers": 4, "d_model": 32, "n_heads": 4, "seq_len": 16, "residual": "attnres",
            "block_size": 2}
    return ModelConfig(**(base | MOE[name] | fields))


@pytest.mark.parametrize("name", sorted(MOE))
def test_total_and_active_parameters_are_the_modules(name):
    cfg = _cfg(name)
    with torch.device("meta"):
        model = Transformer(cfg)
    shapes = sorted(tuple(p.shape) for p in model.parameters())
    assert sorted(rank_parameter_shapes(cfg, make_partition(cfg.n_layers, 1, 1), 0)) == shapes
    total, active = parameter_counts(cfg)
    assert total == sum(p.numel() for p in model.parameters()) == parameter_count(cfg)
    assert active == active_parameter_count(cfg) < total
    # EP = 2 holds half of each MoE layer's routed experts, nothing else changes
    halved = rank_parameter_shapes(cfg, make_partition(cfg.n_layers, 1, 1), 0, expert_parallel=2)
    routed = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert total - sum(math.prod(s) for s in halved) == routed // 2


@pytest.mark.parametrize("name", ["shared_dense", "no_shared_sigmoid", "plr_two_shared"])
def test_forward_flops_count_the_moe_sublayers_products(name):
    cfg = _cfg(name)
    # float64: the experts run one matmul per expert (`grouped_matmul_loop`), which the counter sees
    moe = MoE(cfg).double()
    x = torch.randn(2, cfg.seq_len, cfg.d_model, dtype=torch.float64)
    with FlopCounterMode(display=False) as counter:
        moe(x)
    counted = sum(v for op, v in counter.get_flop_counts()["Global"].items() if "mm" in str(op))
    assert moe_flops_per_token(cfg) * x.shape[0] * x.shape[1] == counted
    if cfg.source_width == cfg.d_model:  # docs/spec.md section 12: 3 d F (K + S) + d E multiply-adds
        d, f = cfg.d_model, cfg.expert_dim
        assert moe_flops_per_token(cfg) == 2 * (3 * d * f * (cfg.moe_top_k + cfg.moe_shared_experts)
                                                + d * cfg.moe_experts)
    dense = dataclasses.replace(cfg, moe_experts=0)
    partition = make_partition(cfg.n_layers, 1, 1)
    per_token = chunk_forward_flops(cfg, partition, 0, 1) - chunk_forward_flops(dense, partition, 0, 1)
    assert per_token == cfg.n_moe_layers * (moe_flops_per_token(cfg) - mlp_flops_per_token(dense))


def _saved(module, x, dtype: str) -> int:
    meter = ActivationMeter()
    meter.set_excluded(module.parameters())
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16")
    with meter.saving(), autocast:
        y = module(x)  # its graph holds the saved tensors while it lives
    assert y.grad_fn is not None
    return meter.live_bytes


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("experts,top_k,shared,router", [(8, 2, 1, "softmax"), (6, 3, 2, "sigmoid")])
def test_what_an_moe_sublayer_saves_is_the_meters_count(dtype, experts, top_k, shared, router):
    cfg = ModelConfig(n_layers=2, d_model=32, n_heads=4, seq_len=16, vocab_size=64, residual="standard",
                      moe_experts=experts, moe_top_k=top_k, moe_shared_experts=shared, moe_d_ff=48,
                      moe_router=router)
    torch.manual_seed(0)
    x = torch.randn(3, cfg.seq_len, cfg.d_model, requires_grad=True)
    # the shared experts and the norm are the dense MLP of width S F that the units price
    dense = MLP(dataclasses.replace(cfg, moe_experts=0, d_ff=shared * cfg.expert_dim))
    extra = _saved(MoE(cfg), x, dtype) - _saved(dense, x, dtype)
    assert extra == moe_saved_bytes(cfg, tokens=x.shape[0] * x.shape[1], dtype=dtype)


def _train(tmp_path, name: str, *flags: str) -> list[dict]:
    out = tmp_path / name
    argv = ["train", "--steps", "1", "--device", "cpu", "--threads", "1", "--quiet", "--launcher", "inprocess",
            "--out", str(out),
            "--layers", "3", "--d-model", "32", "--heads", "4", "--seq-len", "16", "--vocab-size", "256",
            "--batch-size", "4", "--microbatches", "2", "--dtype", "fp32", *flags]
    assert main(argv) == 0
    return json.loads((out / "summary.json").read_text())["memory_per_rank"]


def _predict(capsys, *flags: str) -> list[dict]:
    argv = ["simulate", "memory", "--layers", "3", "--d-model", "32", "--heads", "4", "--seq-len", "16",
            "--vocab-size", "256", "--microbatches", "2", "--tokens", "32", "--dtype", "fp32", "--json", *flags]
    capsys.readouterr()
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)["memory_per_rank"]


@pytest.mark.parametrize("run,model", [
    (["--stages", "1"], ["--block-size", "2", "--moe-experts", "4", "--moe-shared-experts", "1",
                         "--moe-dense-layers", "1", "--moe-d-ff", "32"]),
    (["--stages", "2", "--layer-counts", "1,2"],
     ["--residual", "standard", "--moe-experts", "6", "--moe-top-k", "3", "--moe-router", "sigmoid"]),
])
def test_held_bytes_equal_a_real_run_and_activations_are_close(tmp_path, capsys, run, model):
    counted = _train(tmp_path, "run", *run, *model)
    predicted = _predict(capsys, "--schedule", "1f1b", *run, *model)
    assert len(counted) == len(predicted)
    for real, mine in zip(counted, predicted, strict=True):
        for key in ("param_bytes", "grad_bytes", "optimizer_bytes"):
            assert mine[key] == real[key], key
        assert mine["activation_peak_bytes"] == pytest.approx(real["activation_peak_bytes"], rel=0.10)
    # the selection bias is a parameter without gradient or AdamW state: E floats per MoE layer
    experts = int(model[model.index("--moe-experts") + 1])
    moe_layers = 2 if "--moe-dense-layers" in model else 3
    assert sum(r["param_bytes"] - r["grad_bytes"] for r in counted) == 4 * experts * moe_layers


def test_dispatch_and_combine_bytes_and_the_all_to_all_time():
    cfg = ModelConfig(n_layers=2, d_model=64, n_heads=4, seq_len=16, vocab_size=64, moe_experts=8, moe_top_k=2)
    moved = all_to_all_bytes(cfg, tokens=100, expert_parallel=4, dtype="bf16")
    assert moved.dispatch_bytes == moved.combine_bytes == 100 * 2 * 64 * 2  # K copies of d values, bf16
    assert moved.off_rank_forward_bytes == pytest.approx(0.75 * 2 * moved.dispatch_bytes)
    link = {"intra_bytes_per_s": 400e9, "inter_bytes_per_s": 50e9, "latency_s": 1e-5}
    inside = all_to_all_s(8e6, 4, peers_in_node=4, **link)
    across = all_to_all_s(8e6, 4, peers_in_node=1, **link)
    assert inside == pytest.approx(3 * 2e6 / 400e9 + 2e-5) and across == pytest.approx(3 * 2e6 / 50e9 + 2e-5)
    assert all_to_all_s(8e6, 1, peers_in_node=1, **link) == 0.0


def _request(**fields) -> PlanRequest:
    cfg = ModelConfig(n_layers=8, d_model=256, n_heads=4, seq_len=256, vocab_size=512, residual="attnres",
                      block_size=4, moe_experts=8, moe_top_k=2, moe_shared_experts=1, moe_dense_layers=1)
    return PlanRequest(**({"model": cfg, "global_batch": 64, "gpus": 16, "gpu_memory_gib": 80, "top": 8,
                           "tflops": 400.0, "inter_node_gbps": 100.0} | fields))


def test_plan_searches_expert_parallelism_and_prints_moe_commands():
    request = _request()
    result = make_plan(request)
    fixed = make_plan(dataclasses.replace(request, expert_parallel=2))
    assert result.rows and {row["expert_parallel"] for row in fixed.rows} == {2}
    for row in result.rows + fixed.rows:
        ep, c = row["expert_parallel"], row["config"]
        assert ep == c["expert_parallel"] and c["data_parallel"] % ep == 0 and 8 % ep == 0
        moved = row["moe_all_to_all"]  # K copies of each token's d values, (EP - 1) / EP off the rank
        assert moved["dispatch_bytes_per_layer_and_microbatch"] == c["tokens_per_microbatch"] * 2 * 256 * 2
        assert moved["off_rank_share"] == (ep - 1) / ep and (moved["seconds_per_step"] > 0) == (ep > 1)
        command = row["command"].split()
        for flag, value in (("--moe-experts", "8"), ("--moe-top-k", "2"), ("--moe-shared-experts", "1"),
                            ("--moe-d-ff", str(request.model.expert_dim)), ("--moe-dense-layers", "1")):
            assert command[command.index(flag) + 1] == value
        assert ("--expert-parallel" in command) == (ep > 1)
        if ep > 1:
            assert command[command.index("--expert-parallel") + 1] == str(ep)
        # train's parser takes the whole command
        _args, unknown = build_parser(command[1:]).parse_known_args(command[1:])
        assert unknown == []
    assert all(row["config"]["tensor_parallel"] == 1 for row in result.rows)  # MoE layers are priced at T = 1


def test_plan_table_has_an_ep_column_and_bad_ep_is_one_error_line(capsys):
    base = ["simulate", "plan", "--layers", "8", "--d-model", "256", "--heads", "4", "--seq-len", "256",
            "--vocab-size", "512", "--block-size", "4", "--moe-experts", "8", "--moe-shared-experts", "1",
            "--global-batch", "64", "--gpus", "16", "--gpu-memory-gib", "80", "--top", "3"]
    assert main(base) == 0
    out = capsys.readouterr().out
    assert " EP " in out.splitlines()[1] and "B active)" in out.splitlines()[0]
    assert main([*base, "--expert-parallel", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --expert-parallel 3 does not divide --moe-experts 8")
    assert main(["simulate", "memory", "--schedule", "1f1b", "--stages", "1", "--microbatches", "2",
                 "--moe-experts", "4", "--data-parallel", "2", "--expert-parallel", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not divide --data-parallel 2" in err[0]
    assert main([*base, "--expert-parallel", "8", "--gpus", "4"]) == 2  # D <= 4 here
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --expert-parallel 8 divides no data-parallel degree")
    assert main([*base, "--tensor-parallel", "2"]) == 2  # MoE layers are priced at T = 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --tensor-parallel 2 with --moe-experts is not modelled")


def test_routed_experts_shard_over_the_replicas_that_hold_them():
    # E = 6 over EP = 2: 3 experts a rank, which FSDP2 shards over the D / EP = 2 replicas that hold
    # them (`train.fsdp`, "edp": padded to 2 rows each, the second holder's moments of 1 expert); it
    # leaves the selection bias [E] whole (no gradient, no moments); the rest is sharded over D = 4
    cfg = ModelConfig(n_layers=1, d_model=8, n_heads=2, seq_len=8, vocab_size=16, residual="standard",
                      moe_experts=6, moe_top_k=2, moe_d_ff=4)
    partition = make_partition(1, 1, 1)
    expert = 2 * 4 * 8 + 8 * 4  # gate_up and down rows of one expert
    rest = [s for s in rank_parameter_shapes(cfg, partition, 0) if len(s) != 3 and s != (6,)]
    rest_rows = sum(-(-s[0] // 4) * math.prod(s[1:]) for s in rest if s)
    for dp_rank in range(4):
        terms = rank_state_bytes(cfg, partition, 0, data_parallel=4, dp_shard="fsdp", dp_rank=dp_rank,
                                 expert_parallel=2)
        held_experts = (2, 1)[dp_rank // 2]  # torch.chunk's rows of 3 over the two holders
        assert terms["param_bytes"] == 4 * (rest_rows + 6 + 2 * expert)
        assert terms["grad_bytes"] == 4 * (rest_rows + 2 * expert)
        assert terms["optimizer_bytes"] // 8 - held_experts * expert == sum(
            local_numel(s, 4, "fsdp", dp_rank) for s in rest)
    at_d_equal_ep = rank_state_bytes(cfg, partition, 0, data_parallel=2, dp_shard="fsdp", expert_parallel=2)
    assert at_d_equal_ep["grad_bytes"] == 4 * (sum(-(-s[0] // 2) * math.prod(s[1:]) for s in rest if s)
                                               + 3 * expert)  # one holder: the slice stays whole
    replicated = rank_state_bytes(cfg, partition, 0, data_parallel=4, dp_shard="replicate", expert_parallel=2)
    assert replicated["param_bytes"] == 4 * (sum(math.prod(s) for s in rest) + 6 + 3 * expert)
