"""The driver's device decision and what it resolves (fake GPU counts: this machine has none),
fused AdamW where the parameters are on a GPU, clipping from one stacked norm, and per-rank
clocks for the bubble and the trace."""

from __future__ import annotations

import json

import pytest
import torch

from attnres_pp.cli import main
from attnres_pp.launch.resolve import (
    DeviceDecision,
    backend_of,
    check_tensor_parallel,
    decide_device,
    resolve_run,
)
from attnres_pp.model.config import ModelConfig
from attnres_pp.pipeline.clock import HostClock, make_clock
from attnres_pp.pipeline.config import PipelineConfig
from attnres_pp.pipeline.stage_setup import init_process_group
from attnres_pp.schedule.timeline import align_per_rank, bubble_fraction, own_clock_bubble, rank_bubbles
from attnres_pp.train.config import RunConfig, TrainConfig, resolve_training
from attnres_pp.train.optim import build_optimizer, clip_grad_norm_
from tests.pipeline_helpers import model_config


@pytest.mark.parametrize("requested,n_ranks,one_process,gpus,want", [
    ("auto", 4, False, 4, DeviceDecision("cuda", "nccl")),  # every rank its own GPU
    ("auto", 4, False, 8, DeviceDecision("cuda", "nccl")),
    ("auto", 4, False, 3, DeviceDecision("cpu", "gloo")),  # not enough: gloo on cpu, never shared GPUs
    ("auto", 4, False, 0, DeviceDecision("cpu", "gloo")),
    ("cuda", 2, False, 2, DeviceDecision("cuda", "nccl")),
    ("cpu", 4, False, 8, DeviceDecision("cpu", "gloo")),
    ("auto", 4, True, 1, DeviceDecision("cuda", "none")),  # one process (inprocess, single): one GPU
    ("auto", 1, True, 0, DeviceDecision("cpu", "none")),
])
def test_the_driver_decides_device_and_backend(requested, n_ranks, one_process, gpus, want):
    assert decide_device(requested, n_ranks=n_ranks, one_process=one_process, gpus=gpus) == want


def test_more_ranks_than_gpus_with_nccl_is_refused_with_the_fix():
    with pytest.raises(ValueError) as info:
        decide_device("cuda", n_ranks=4, one_process=False, gpus=2)
    message = str(info.value)
    assert "--device cuda runs 4 pipeline ranks with nccl, one GPU each, but 2 GPU(s) are visible on this " \
           "node" in message
    assert "--device cpu" in message and "--stages 2 or fewer" in message
    with pytest.raises(ValueError, match="needs a CUDA GPU, and none is visible"):
        decide_device("cuda", n_ranks=1, one_process=True, gpus=0)
    with pytest.raises(ValueError, match="none is visible in the Ray cluster"):
        decide_device("cuda", n_ranks=2, one_process=False, gpus=0, where="in the Ray cluster")


def test_cli_refuses_cuda_without_gpus_before_starting_anything(tmp_path, capsys):
    code = main(["train", "--launcher", "local", "--stages", "2", "--device", "cuda", "--steps", "1",
                 "--out", str(tmp_path / "run")])
    assert code == 2
    assert "--device cuda needs a CUDA GPU for each pipeline rank" in capsys.readouterr().err


def test_auto_resolves_dtype_and_kernels_by_device(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    two_ranks = PipelineConfig(stages=2)
    on_gpu = resolve_run(two_ranks, device="auto", dtype="auto", kernels="auto", gpus=2)
    assert (on_gpu.device, on_gpu.backend, on_gpu.dtype, on_gpu.kernels) == ("cuda", "nccl", "bf16", "triton")
    assert backend_of(on_gpu.device) == "nccl" and on_gpu.engine == "pipeline" and on_gpu.n_ranks == 2
    on_cpu = resolve_run(two_ranks, device="auto", dtype="auto", kernels="auto", gpus=1)
    assert (on_cpu.device, on_cpu.backend, on_cpu.dtype, on_cpu.kernels) == ("cpu", "gloo", "fp32", "torch")
    assert resolve_run(PipelineConfig(), device="cpu", dtype="bf16", kernels="torch", gpus=0).dtype == "bf16"
    single = resolve_run(PipelineConfig(launcher="local"), device="auto", dtype="auto", kernels="auto", gpus=1)
    assert (single.engine, single.backend, single.device, single.ranks_in_this_process) == ("single", "none", "cuda",
                                                                                           True)
    threads = resolve_run(PipelineConfig(stages=2, launcher="inprocess"), device="auto", dtype="auto",
                          kernels="auto", gpus=1)
    assert (threads.engine, threads.backend, threads.device) == ("pipeline", "none", "cuda")  # one GPU, shared
    # Replica groups run on torchft's gloo group: cpu, whatever the node has.
    replicas = resolve_run(PipelineConfig(data_parallel=2), device="auto", dtype="auto", kernels="auto", gpus=8,
                           fault_tolerance="replicas")
    assert (replicas.engine, replicas.device, replicas.dtype) == ("replicas", "cpu", "fp32")
    with pytest.raises(ValueError, match="--kernels triton runs the Triton kernels, which need a CUDA device"):
        resolve_run(PipelineConfig(), device="cpu", dtype="auto", kernels="triton", gpus=0)
    with pytest.raises(ValueError, match="undecided"):
        backend_of("auto")
    with pytest.raises(ValueError, match="the driver passes 'cpu' or 'cuda'"):
        init_process_group("file:///nonexistent", 0, 1, 1.0, device="auto")


def test_a_run_config_is_resolved_once_and_records_the_decision():
    run_cfg = RunConfig(model=model_config("block", 2), pipeline=PipelineConfig(stages=2))
    decided, run = resolve_training(run_cfg, gpus=0)
    assert (decided.train.device, decided.train.dtype, decided.train.kernels) == ("cpu", "fp32", "torch")
    assert decided.model == run_cfg.model and decided.pipeline == run_cfg.pipeline and run.backend == "gloo"
    # Resolving a resolved config changes nothing: the ranks receive it and never decide again.
    assert resolve_training(decided, gpus=4)[0] == decided


def test_tensor_parallel_under_ray_is_decided_again_with_the_clusters_gpus():
    cfg, pipe = ModelConfig(n_heads=2, d_model=32), PipelineConfig(tensor_parallel=2, launcher="ray")
    check_tensor_parallel(cfg, pipe, "auto")  # before Ray is joined: the cluster's GPUs are not known yet
    check_tensor_parallel(cfg, pipe, "auto", gpus=0)  # a cpu cluster
    with pytest.raises(ValueError, match="does not support --device auto under --launcher ray"):
        check_tensor_parallel(cfg, pipe, "auto", gpus=4)  # auto found the cluster's GPUs
    with pytest.raises(ValueError, match="does not support --device cuda under --launcher ray"):
        check_tensor_parallel(cfg, pipe, "cuda")


def test_kernels_flag_picks_the_backend_and_the_summary_records_it(tmp_path):
    from attnres_pp.train.engines import make_engine

    engine = make_engine(RunConfig(model=model_config("block", 2), pipeline=PipelineConfig(launcher="local"),
                                   train=TrainConfig(kernels="torch", batch_size=2, microbatches=1)))
    try:
        assert engine.model.backend == "torch" and engine.train_cfg.kernels == "torch"
    finally:
        engine.close()
    out = tmp_path / "run"
    assert main(["train", "--launcher", "inprocess", "--stages", "2", "--layers", "2", "--d-model", "16",
                 "--heads", "2", "--seq-len", "16", "--batch-size", "4", "--steps", "1", "--eval-every", "0",
                 "--quiet", "--out", str(out)]) == 0
    config = json.loads((out / "summary.json").read_text())["config"]["train"]
    assert (config["kernels"], config["dtype"], config["device"]) == ("torch", "fp32", "cpu")  # auto, resolved


def test_fused_adamw_where_asked():
    params = [torch.nn.Parameter(torch.randn(4, 4)), torch.nn.Parameter(torch.randn(4))]
    assert build_optimizer(params, TrainConfig(), fused=True).defaults["fused"] is True
    plain = build_optimizer(params, TrainConfig())
    assert not plain.defaults.get("fused") and plain.defaults["foreach"] is False


def test_clipping_uses_one_stacked_norm_and_matches_float64(monkeypatch):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)) for _ in range(4)]
    for p in params:
        p.grad = torch.randn_like(p) * 3
    want = float(sum(p.grad.double().square().sum() for p in params).sqrt())
    calls = []
    foreach_norm = torch._foreach_norm
    monkeypatch.setattr(torch, "_foreach_norm", lambda tensors: calls.append(len(tensors)) or foreach_norm(tensors))
    before = [p.grad.clone() for p in params]
    norm = clip_grad_norm_(params, max_norm=1.0)
    assert calls == [4]  # one call for the device's gradients, not one per parameter
    assert norm == pytest.approx(want, rel=1e-6)
    for p, g in zip(params, before, strict=True):
        torch.testing.assert_close(p.grad, g * (1.0 / (want + 1e-6)), rtol=1e-5, atol=0)


def test_bubble_and_trace_use_each_ranks_own_clock():
    events = [(0, "F0.0", 0.0, 1.0, "compute"), (0, "SF0.0", 1.0, 1.1, "comm"), (0, "flush", 1.1, 3.0, "comm"),
              (1, "RF1.0", 0.0, 1.1, "comm"), (1, "F1.0", 1.1, 2.1, "compute"), (1, "flush", 2.1, 3.0, "comm")]
    skewed = [(r, n, s + 1000.0 * r, e + 1000.0 * r, c) for r, n, s, e, c in events]  # rank 1's host clock is off
    assert own_clock_bubble(skewed, 2) == pytest.approx(own_clock_bubble(events, 2)) == pytest.approx(1 - 2 / 6)
    assert rank_bubbles(skewed, 2) == pytest.approx([1 - 1 / 3, 1 - 1 / 3])
    assert bubble_fraction(skewed, 2) > 0.99  # comparing the two clocks would be nonsense
    aligned = align_per_rank(skewed)
    assert {min(s for r, _, s, _, _ in aligned if r == rank) for rank in (0, 1)} == {0.0}
    assert isinstance(make_clock(torch.device("cpu")), HostClock)


def test_the_replica_norm_counts_tied_parameters_once_without_host_round_trips(monkeypatch):
    """D x P clipping: the untied squared norm summed over the replica's ranks ("pp"), the tied convs
    (equal on every rank after their reduction) added once, all of it on the gradients' device: no
    `.cpu()` copy per parameter, so `clip_grad_norm_`'s reading of the norm is the one host sync."""
    from attnres_pp.train.grad_norm import norm_groups, norm_reducer

    torch.manual_seed(0)
    untied = [torch.nn.Parameter(torch.randn(4, 3)) for _ in range(3)]
    tied = [torch.nn.Parameter(torch.randn(5))]
    for p in untied + tied:
        p.grad = torch.randn_like(p)

    class OtherRankHoldsTheSame:  # a replica of P = 2 ranks whose second rank has equal untied grads
        axes: list = []

        def all_reduce(self, tensor, axis):
            self.axes.append(axis)
            tensor.mul_(2)

    monkeypatch.setattr(torch.Tensor, "cpu", lambda self, *a, **k: pytest.fail("a host copy per parameter"))
    groups = norm_groups(untied, tied, is_split=lambda p: False)
    reduce_sq = norm_reducer(groups, OtherRankHoldsTheSame(), torch.device("cpu"))
    norm = clip_grad_norm_(untied + tied, max_norm=0.0, reduce_sq=reduce_sq)
    want = float((2 * sum(p.grad.double().square().sum() for p in untied)
                  + sum(p.grad.double().square().sum() for p in tied)).sqrt())
    assert OtherRankHoldsTheSame.axes == ["pp"] and norm == pytest.approx(want, rel=1e-6)


def test_every_layout_sums_each_group_over_its_axes_once_in_one_order():
    """The one reducer under tp and fsdp: partial sums meet once their remaining axes agree, so tp is
    one all-reduce over tp then one over pp, and fsdp one each over dp, world and pp; each group's
    squares are multiplied by the ranks of the axes it is summed over (here every axis has 2 ranks)."""
    from attnres_pp.train.grad_norm import norm_groups, norm_reducer

    params = {name: torch.nn.Parameter(torch.full((2,), float(i + 1))) for i, name in
              enumerate(("split", "whole", "tied", "dp_shard"))}
    for p in params.values():
        p.grad = p.detach().clone()

    class TwoRanksPerAxis:
        def __init__(self):
            self.axes = []

        def all_reduce(self, tensor, axis):
            self.axes.append(axis)
            tensor.mul_(2)

    sq = {name: 2 * (i + 1) ** 2 for i, name in enumerate(params)}  # two elements of value i + 1
    split = lambda p: p is params["split"]  # noqa: E731
    tp = TwoRanksPerAxis()
    groups = norm_groups([params["split"], params["whole"]], [params["tied"]], is_split=split, tensor_parallel=True)
    total = float(norm_reducer(groups, tp, torch.device("cpu"))())
    assert total == pytest.approx(4 * sq["split"] + 2 * sq["whole"] + sq["tied"], rel=1e-6)
    assert tp.axes == ["tp", "pp"]
    fsdp = TwoRanksPerAxis()
    groups = norm_groups([params["split"], params["dp_shard"], params["whole"]], [params["tied"]], is_split=split,
                         tensor_parallel=True, fsdp_replicated=[params["whole"]])
    total = float(norm_reducer(groups, fsdp, torch.device("cpu"))())
    assert total == pytest.approx(2 * sq["split"] + 4 * sq["dp_shard"] + 2 * sq["whole"] + sq["tied"], rel=1e-6)
    assert fsdp.axes == ["dp", "world", "pp"]


def test_ranks_of_one_gpu_node_see_all_its_gpus_each_using_its_own():
    """Fake GPU ids as Ray assigns them (one per rank): node a holds ranks 0, 1 and 3 on GPUs 2, 0
    and 10; node b rank 2 on GPU 0. The ranks of node a all see "0,2,10" and each takes its own."""
    from attnres_pp.launch.ray_checks import node_gpu_views

    views = node_gpu_views(["a", "a", "b", "a"], [["2"], ["0"], ["0"], ["10"]])
    assert views == [("0,2,10", 1), ("0,2,10", 0), ("0", 0), ("0,2,10", 2)]
    with pytest.raises(ValueError, match="rank 1 was given GPU 0 of node a, which another rank there holds"):
        node_gpu_views(["a", "a"], [["0"], ["0"]])
    with pytest.raises(ValueError, match="rank 0 holds 2 GPUs"):
        node_gpu_views(["a"], [["0", "1"]])
