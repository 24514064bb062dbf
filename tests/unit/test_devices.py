"""The driver's device decision and what it resolves (fake GPU counts: this machine has none),
fused AdamW where the parameters are on a GPU, clipping from one stacked norm, and per-rank
clocks for the bubble and the trace."""

from __future__ import annotations

import json

import pytest
import torch

from attnres_pp.cli import main
from attnres_pp.pipeline.clock import HostClock, make_clock
from attnres_pp.pipeline.stage_setup import init_process_group
from attnres_pp.schedule.timeline import align_per_rank, bubble_fraction, own_clock_bubble, rank_bubbles
from attnres_pp.train.config import TrainConfig
from attnres_pp.train.devices import DeviceDecision, backend_of, decide_device, resolve_train
from attnres_pp.train.optim import build_optimizer, clip_grad_norm_
from attnres_pp.train.single_process_engine import SingleProcessEngine
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
    on_gpu = resolve_train(TrainConfig(), "cuda")
    assert (on_gpu.device, on_gpu.dtype, on_gpu.kernels) == ("cuda", "bf16", "triton") and backend_of(on_gpu) == "nccl"
    on_cpu = resolve_train(TrainConfig(), "cpu")
    assert (on_cpu.device, on_cpu.dtype, on_cpu.kernels) == ("cpu", "fp32", "torch") and backend_of(on_cpu) == "gloo"
    assert resolve_train(TrainConfig(dtype="bf16", kernels="torch"), "cpu").dtype == "bf16"
    with pytest.raises(ValueError, match="--kernels triton runs the Triton kernels, which need a CUDA device"):
        resolve_train(TrainConfig(kernels="triton"), "cpu")
    with pytest.raises(ValueError, match="unresolved"):
        backend_of(TrainConfig())
    with pytest.raises(ValueError, match="the driver passes 'cpu' or 'cuda'"):
        init_process_group("file:///nonexistent", 0, 1, 1.0, device="auto")


def test_kernels_flag_picks_the_backend_and_the_summary_records_it(tmp_path):
    engine = SingleProcessEngine(model_config("block", 2), TrainConfig(kernels="torch", batch_size=2, microbatches=1))
    assert engine.model.backend == "torch" and engine.train_cfg.kernels == "torch"
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
    from attnres_pp.train.grad_sync import norm_reducer

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
    reduce_sq = norm_reducer(tied, OtherRankHoldsTheSame(), torch.device("cpu"))
    norm = clip_grad_norm_(untied + tied, max_norm=0.0, reduce_sq=reduce_sq)
    want = float((2 * sum(p.grad.double().square().sum() for p in untied)
                  + sum(p.grad.double().square().sum() for p in tied)).sqrt())
    assert OtherRankHoldsTheSame.axes == ["pp"] and norm == pytest.approx(want, rel=1e-6)


def test_ranks_of_one_gpu_node_see_all_its_gpus_each_using_its_own():
    """Fake GPU ids as Ray assigns them (one per rank): node a holds ranks 0, 1 and 3 on GPUs 2, 0
    and 10; node b rank 2 on GPU 0. The ranks of node a all see "0,2,10" and each takes its own."""
    from attnres_pp.pipeline.ray_checks import node_gpu_views

    views = node_gpu_views(["a", "a", "b", "a"], [["2"], ["0"], ["0"], ["10"]])
    assert views == [("0,2,10", 1), ("0,2,10", 0), ("0", 0), ("0,2,10", 2)]
    with pytest.raises(ValueError, match="rank 1 was given GPU 0 of node a, which another rank there holds"):
        node_gpu_views(["a", "a"], [["0"], ["0"]])
    with pytest.raises(ValueError, match="rank 0 holds 2 GPUs"):
        node_gpu_views(["a"], [["0", "1"]])
