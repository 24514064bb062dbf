"""Tensor and sequence parallelism at T = 2 under the in-process launcher: every rank a thread of this
process, joined to torch's threaded process group (`launch.threaded_process_group`), its layers
split by DTensor over the threads' tp mesh. The pipeline runtime's ranks (`StageWorker`) at P = 1,
P = 2 and D = 2, and every variant on the loop and the V layouts at P = 2 (`RUNTIME_MATRIX`): loss and every
gradient equal the single-process model's (fp32 to 1e-5, float64 to 1e-10), each hop pair carries
comm.plan's bytes per rank, and the threaded process group is gone once the group stops, also after
a rank fails; and `attnres-pp train` at T = 2 on thread ranks gives the single process's losses. No
process starts here (rank processes over gloo: tests/distributed/test_tensor_parallel_gloo.py)."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from attnres_pp.comm.plan import hop_bytes_per_rank, plan_for_model
from attnres_pp.launch.thread_rank_group import ThreadRankGroup
from attnres_pp.pipeline.stage_setup import run_partition
from attnres_pp.simulator.tensor_parallel import TensorParallel, layer_collectives
from attnres_pp.train.config import RunConfig
from attnres_pp.train.stage_worker import StageWorker
from tests.pipeline_helpers import MICRO, assert_grads_match, batch, shared_reference_step
from tests.reference_model import randomize_depth_params

from ..distributed.test_tensor_parallel_gloo import T, tp_run_dict, variant_has_plain_collectives

GROUPED = {"n_heads": 4, "n_kv_heads": 2, "qk_norm": True}  # head_dim 4, two query heads per kv head
# (variant, schedule, P, V, m, cache, sequence parallel[, train, data_parallel and model keys]); block size 3
# puts block edges inside chunks. ZB-V runs the split backward (I, then W from the weight store).
# Block AttnRes on the loop layout and MSAR on the V layout at P = 1, cached, under SP, run in float64
# (FLOAT64), which checks them as these do (their tp collectives' bytes too) to 1e-10.
RUNTIME_P1 = [("block", "gpipe", 1, 1, 2, True, False),
              ("block", "zbv", 1, 2, 2, True, True),
              ("block", "interleaved_1f1b", 1, 2, 2, True, True, {"activation_checkpoint": "full"}),
              ("block", "interleaved_1f1b", 1, 2, 2, True, True, {"activation_checkpoint": "selective"}),
              # grouped kv heads split over T with the query heads that read them; QK-norm's gains
              # replicated, their gradients summed over tp with and without SP; tied embeddings
              ("block", "interleaved_1f1b", 1, 2, 2, True, True, {"model": GROUPED}),
              ("msar", "zbv", 1, 2, 2, True, False, {"model": GROUPED}),
              ("lr_projected", "zbv", 1, 2, 2, False, True, {"model": {**GROUPED, "tie_embeddings": True}})]
RUNTIME_FOUR = [("block", "1f1b", 2, 1, 3, True, True), ("block", "interleaved_1f1b", 2, 2, 4, False, True),
                ("block", "interleaved_1f1b", 2, 2, 2, True, False), ("lr_projected", "1f1b", 2, 1, 2, True, True),
                ("block", "zbv", 2, 2, 3, True, True), ("msar", "interleaved_1f1b", 2, 2, 2, True, False),
                ("msar", "1f1b", 2, 1, 2, True, True),
                # selective checkpointing replays the tp collectives its saved products do not cover
                ("msar", "zbv", 2, 2, 2, True, True, {"activation_checkpoint": "selective"}),
                ("lr_sliced", "interleaved_1f1b", 2, 2, 2, False, False, {"activation_checkpoint": "selective"}),
                ("block", "interleaved_1f1b", 1, 2, 2, True, True, {"data_parallel": 2}),
                ("msar", "zbv", 1, 2, 2, True, True, {"data_parallel": 2})]
# Every variant on two layouts under sequence parallelism at P = 2, as the parity list crosses them
# (tests/parity/parity_cases.py): the loop placement with the fused backward (interleaved 1F1B),
# cached, and the V placement with the split backward through the weight store (ZB-V), naive; each
# variant thus meets both backwards and both cache modes. 1F1B (V = 1) runs Block AttnRes, LR
# projected keys and MSAR in RUNTIME_FOUR, as do the V layout cached and the loop layout naive.
RUNTIME_MATRIX = [case for case in ((variant, schedule, 2, 2, 2, cache, True)
                                    for variant in ("standard", "full", "block", "lr_projected", "lr_sliced", "msar")
                                    for schedule, cache in (("interleaved_1f1b", True), ("zbv", False)))
                  if case not in RUNTIME_FOUR]
# Beyond the P = 1 cases the matrix is `make test`'s, not `make test-fast`'s (marker `matrix`): the
# inner loop keeps P = 1, the float64 cases at P = 1 and 2, the failure and the CLI run.
CASES = [*RUNTIME_P1, *(pytest.param(case, marks=pytest.mark.matrix) for case in [*RUNTIME_FOUR, *RUNTIME_MATRIX])]
# float64 at P = 1 and P = 2: Block AttnRes and MSAR (its halos), loop and V placements, both caches.
FLOAT64 = [("block", "interleaved_1f1b", 1, 2, 2, True, True), ("msar", "zbv", 1, 2, 2, True, True),
           ("block", "interleaved_1f1b", 2, 2, 2, False, True), ("msar", "zbv", 2, 2, 2, True, True),
           ("msar", "1f1b", 2, 1, 2, True, False), ("block", "zbv", 2, 2, 3, True, False),
           ("block", "1f1b", 2, 1, 2, True, False, {"model": GROUPED}),
           ("msar", "interleaved_1f1b", 1, 2, 2, True, True, {"model": {**GROUPED, "positions": "learned"}})]


def _case_id(case) -> str:
    variant, schedule, P, V, m, cache, sp, *rest = case
    extra = "-".join(f"{k}={v}" if k != "model" else "-".join(f"{f}={x}" for f, x in v.items())
                     for k, v in (rest[0] if rest else {}).items())
    return "-".join(filter(None, [variant, schedule, f"P{P}V{V}m{m}", "cached" if cache else "naive",
                                  "sp" if sp else "nosp", extra]))


class ParityWorker(StageWorker):
    """A training rank seeded as the reference model (non-zero depth parameters), in `dtype`."""

    def __init__(self, *, dtype: torch.dtype = torch.float32, **kwargs) -> None:
        super().__init__(**kwargs)
        self.model.to(dtype)  # the same Parameter objects: the optimizer keeps them
        # drawn in the model's dtype, as `pipeline_helpers.build_model` draws them
        randomize_depth_params(self.model, torch.Generator().manual_seed(1))

    def parity_step(self, inputs, targets) -> tuple:
        m = self.run_cfg.train.microbatches
        rows = slice(self.dp_rank * MICRO * m, (self.dp_rank + 1) * MICRO * m)
        record = self.backward(0, (inputs[rows], targets[rows]))
        grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
                 for n, p in self.params.items() if p.grad is not None}
        fwd_bytes = sum(r[4] for r in self.runtime.transport.ledger.records if r[0] == "fwd")
        whole_bytes = sum(p.numel() * p.element_size() for n, p in self.params.items()
                          if not isinstance(p, DTensor) or n.endswith("norm.weight"))
        return record.losses, grads, fwd_bytes, self.pp_rank, self.tp_bytes, whole_bytes


def _inprocess(case) -> dict:
    run_dict = tp_run_dict(case)
    run_dict["pipeline"]["launcher"] = "inprocess"
    return run_dict


def _run(case, dtype=torch.float32):
    run_dict = _inprocess(case)
    run_cfg = RunConfig.from_dict(run_dict)
    pipe, world = run_cfg.pipeline, run_cfg.pipeline.world_size
    D, m = pipe.data_parallel, case[4]
    inputs, targets = batch(D * m)
    group = ThreadRankGroup(world, stages=pipe.stages, timeout_s=60.0, tensor_parallel=T)
    try:
        group.start(ParityWorker, [{"run_cfg_dict": run_dict, "rank": r, "dtype": dtype} for r in range(world)])
        replies = group.call_all("parity_step", inputs, targets)
    finally:
        group.stop(graceful=True)
    # `batch(D * m)`'s single-process step, once per model, batch and dtype (38 cases, 16 of them)
    return run_cfg, replies, shared_reference_step(run_cfg.model, D * m, dtype=dtype)


def _check(case, dtype, rtol):
    run_cfg, per_rank, (want_loss, want_grads) = _run(case, dtype)
    cfg, m, sp, D = run_cfg.model, case[4], case[6], run_cfg.pipeline.data_parallel
    # Every tp rank of the last stage scores its own shard (under SP) or the whole (without).
    losses = [loss for losses, *_ in per_rank for loss in losses.values()]
    assert len(losses) == D * m * T, case
    loss = sum(losses) / len(losses)
    assert abs(loss - want_loss) <= rtol * abs(want_loss), (case, loss, want_loss)
    merged: dict = {}
    for _losses, grads, *_ in per_rank:
        for name, grad in grads.items():
            assert grad.dtype == dtype
            kept = merged.setdefault(name, grad)  # the tp ranks of one stage hold the same whole gradient
            torch.testing.assert_close(kept, grad, rtol=rtol, atol=rtol * 1e-4, msg=lambda text, n=name: f"{n}: {text}")
    assert_grads_match(merged, want_grads, rtol=rtol)
    # Each hop pair (d, p, t) -> (d, p + 1, t) carries its shard: comm.plan's count, per rank.
    partition = run_partition(cfg.n_layers, run_cfg.pipeline)
    plan = plan_for_model(cfg, partition, run_cfg.pipeline.cache)
    per_hop = hop_bytes_per_rank(plan, tokens=MICRO * cfg.seq_len, width=cfg.source_width,
                                 element_bytes=torch.tensor([], dtype=dtype).element_size(), tensor_parallel=T,
                                 sequence_parallel=sp)
    sent_by_pair = sum(per_hop[h] for h in range(len(per_hop)) if partition.rank_of(h) != partition.rank_of(h + 1))
    assert sum(fwd_bytes for _l, _g, fwd_bytes, *_ in per_rank) == D * T * m * sent_by_pair, case
    # (QK-norm's replicated gains without SP sum their gradients over tp outside these terms)
    if variant_has_plain_collectives(case) and (sp or not (case[7:] and "model" in case[7])):
        # The tp collectives each thread rank counted, as a rank process counts them
        # (tests/distributed/test_tensor_parallel_gloo.py): the simulator's per-layer terms (forward and backward,
        # each microbatch) plus, under SP, the sums of the partial gradients of what it holds whole,
        # the DTensor norm gains' and the plain tensors' (which go between the threads outside the
        # dispatcher, `mesh.ThreadCollectives`, and are counted there).
        element_bytes = torch.tensor([], dtype=dtype).element_size()
        per_layer = sum(c["count"] * c["sent_bytes_per_rank"] for c in layer_collectives(
            MICRO * cfg.seq_len, cfg.d_model, element_bytes, TensorParallel(T, sp)))
        for *_rest, pp_rank, tp_bytes, whole_bytes in per_rank:
            n_layers = sum(len(partition.layer_range(c)) for c in partition.chunks_of(pp_rank))
            want = 2 * m * n_layers * per_layer + (2 * whole_bytes * (T - 1) // T if sp else 0)
            assert tp_bytes == want, (case, pp_rank, tp_bytes, want)
    return run_cfg, per_rank


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_two_tp_thread_ranks_equal_the_single_process(case):
    _check(case, torch.float32, 1e-5)


@pytest.mark.parametrize("case", FLOAT64, ids=_case_id)
def test_two_tp_thread_ranks_equal_the_single_process_float64(case):
    _check(case, torch.float64, 1e-10)


def _threaded_pg_gone() -> None:
    from torch.testing._internal.distributed.multi_threaded_pg import ThreadLocalWorld

    assert not isinstance(dist.distributed_c10d._world, ThreadLocalWorld)
    assert torch._C._is_multithreading_enabled()  # autograd's, which the threaded group switches off
    assert not dist.is_initialized()


class FailingWorker(ParityWorker):
    def fail_on_tp_rank_1(self) -> float:
        """tp rank 1 raises at once; tp rank 0 waits for it in a tp collective (the threaded group's
        collectives have no timeout of their own)."""
        if self.coords.tp_rank == 1:
            raise ValueError("tp rank 1 fails on purpose")
        qkv = next(p for n, p in self.params.items() if n.endswith("attn.qkv.weight"))
        return float(qkv.full_tensor().sum())


def test_a_failing_rank_ends_the_call_and_stop_gives_the_process_back():
    case = ("block", "1f1b", 1, 1, 1, True, True)
    run_dict = _inprocess(case)
    group = ThreadRankGroup(T, stages=1, timeout_s=60.0, tensor_parallel=T)
    try:
        group.start(FailingWorker, [{"run_cfg_dict": run_dict, "rank": r} for r in range(T)])
        assert [r["backend"] for r in group.setup_results] == ["loopback"] * T
        with pytest.raises(ValueError, match="tp rank 1 fails on purpose"):
            started = time.monotonic()
            group.call_all("fail_on_tp_rank_1")
        assert time.monotonic() - started < 20.0  # woken, not left to the 90 s bound
        with pytest.raises(ValueError, match="another in-process tensor-parallel run"):
            ThreadRankGroup(T, stages=1, timeout_s=60.0, tensor_parallel=T).start(
                FailingWorker, [{"run_cfg_dict": run_dict, "rank": r} for r in range(T)])
        # the group still runs collectives after the failure
        loss, *_ = group.call_all("parity_step", *batch(1))[0]
        assert len(loss) == 1
        threads = [rank_thread.thread for rank_thread in group._threads]
        assert len(threads) == T and all(thread.is_alive() for thread in threads)
    finally:
        group.stop(graceful=True)
    _threaded_pg_gone()
    assert not any(thread.is_alive() for thread in threads)  # the rank threads ended
    # and a second run may take the threaded group now
    _check(case, torch.float32, 1e-5)
    _threaded_pg_gone()


def test_train_cli_in_process_at_t2_gives_the_single_process_losses(tmp_path):
    """`attnres-pp train --launcher inprocess --tensor-parallel 2 --stages 2` (four rank threads) trains
    as the local launcher's single process: the same losses, clipping norms and validation losses."""
    import json

    from attnres_pp.cli import main

    run = ["train", "--device", "cpu", "--steps", "3", "--layers", "2", "--d-model", "32", "--heads", "2",
           "--seq-len", "16", "--batch-size", "4", "--microbatches", "2", "--block-size", "3", "--eval-every", "2",
           "--no-final-checkpoint", "--checkpoint-every", "0", "--quiet"]
    assert main([*run, "--launcher", "local", "--out", str(tmp_path / "single")]) == 0
    assert main([*run, "--launcher", "inprocess", "--stages", "2", "--tensor-parallel", "2",
                 "--out", str(tmp_path / "threads")]) == 0
    single, threads = (json.loads((tmp_path / name / "summary.json").read_text()) for name in ("single", "threads"))
    assert threads["config"]["pipeline"]["tensor_parallel"] == 2 and len(threads["memory_per_rank"]) == 4
    assert threads["tp_bytes_per_step"] > 0

    def close(got, want):
        return len(got) == len(want) and all(abs(g - w) <= 1e-5 * abs(w) for g, w in zip(got, want, strict=True))

    def norms(name):
        return [json.loads(line)["grad_norm"] for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]

    assert len(single["losses"]) == 3 and close(threads["losses"], single["losses"]), (threads["losses"],
                                                                                         single["losses"])
    assert close(norms("threads"), norms("single"))
    assert close([v for _s, v in threads["val_losses"]], [v for _s, v in single["val_losses"]])
    _threaded_pg_gone()
