"""Tensor and sequence parallelism over gloo, T = 2: the layer split alone (`pipeline.tensor_parallel`,
the whole model on two rank processes, float64), then the pipeline runtime's ranks (`StageWorker`)
on four processes: Block AttnRes and MSAR on a loop and a V schedule at P = 2, and FSDP2 shards at
D = 2 (`RUNTIME_GLOO`). Loss and every gradient equal the single-process model's, each hop pair
carries comm.plan's bytes per rank, and each rank's tp collectives send the simulator's bytes. The
whole variant x schedule x cache matrix runs on thread ranks: tests/parity/test_tensor_parallel_inprocess.py."""

from __future__ import annotations

import traceback

import pytest
import torch

from tests.pipeline_helpers import (
    MICRO,
    TORCH_TWINS,
    assert_grads_match,
    batch,
    build_model,
    model_config,
    reference_step,
)
from tests.spawn_helpers import spawn_ranks

pytestmark = pytest.mark.distributed

T = 2
# (variant, sequence parallel): Block AttnRes and MSAR (its convolutions' halo under SP) both ways;
# projected keys (the row-parallel outputs' extra r columns) and the standard residual under SP.
CASES = [("block", True), ("block", False), ("lr_projected", True), ("standard", True), ("msar", False),
         ("msar", True)]
# The Triton kernels (interpreted on CPU, fp32 math) on each rank's sequence shard, the torch twins
# made to raise: MSAR's streams are convolved with the halo and read by the phase-1 kernel.
TRITON_CASES = [("block", True), ("msar", True)]


def _config(variant):
    return model_config(variant, n_layers=3, n_heads=2, d_model=16)


def _torch_twins_raise():
    """The depth-attention ops' torch twins replaced by ones that raise, in this process: a run that
    completes read through the Triton kernels. Returns what puts them back."""
    from attnres_pp.kernels import dispatch

    saved = {name: getattr(dispatch, name) for name in TORCH_TWINS}

    def refuse(*args, **kwargs):
        raise AssertionError("a torch twin ran where the Triton kernels should")

    for name in TORCH_TWINS:
        setattr(dispatch, name, refuse)
    return lambda: [setattr(dispatch, name, op) for name, op in saved.items()]


def _rank_main(rank, init_method, cases, results):
    try:
        from attnres_pp.pipeline.mesh import MeshCollectives, RankCoords
        from attnres_pp.pipeline.stage_setup import init_process_group
        from attnres_pp.pipeline.tensor_parallel import (
            full_grads,
            install_halo,
            parallelize_layers,
            rank_loss,
            sum_replicated_grads,
        )

        torch.set_num_threads(1)
        init_process_group(init_method, rank, T, 60.0)
        coords = RankCoords(rank, data_parallel=1, stages=1, tensor_parallel=T)
        collectives = MeshCollectives(coords, "cpu")
        inputs, targets = batch(1)
        out = []
        for variant, sp, *backend in cases:
            cfg = _config(variant)
            triton = backend == ["triton"]
            model = build_model(cfg, torch.float32 if triton else torch.float64,
                                backend="triton" if triton else "torch")
            restore = _torch_twins_raise() if triton else (lambda: None)
            parallelize_layers(cfg, model.layers, collectives.mesh["tp"], sequence_parallel=sp)
            install_halo(model.stream_convs, collectives.mesh["tp"], sequence_parallel=sp)
            try:
                loss = rank_loss(model, inputs, targets, tp_rank=coords.tp_rank, tensor_parallel=T,
                                 sequence_parallel=sp)
                loss.backward()
            finally:
                restore()
            if sp:
                sum_replicated_grads(model.parameters(), collectives)
            share = loss.detach().clone()
            if sp:
                collectives.all_reduce(share, "tp")
            grads = {name: g.detach().numpy().copy() for name, g in full_grads(model).items()}
            local_qkv = model.layers[0].attn.qkv.weight.to_local().detach().numpy().copy()
            out.append((float(share), grads, local_qkv))
        results.put((rank, out))
    except Exception:
        results.put((rank, traceback.format_exc()))


def test_two_tp_ranks_give_the_single_process_loss_and_gradients(tmp_path):
    replies = dict(spawn_ranks(_rank_main, T, tmp_path, [*CASES, *((v, sp, "triton") for v, sp in TRITON_CASES)],
                               timeout_s=180.0))
    inputs, targets = batch(1)
    assert inputs.shape[0] == MICRO
    for index, (variant, sp) in enumerate(CASES):
        cfg = _config(variant)
        want_loss, want_grads = reference_step(cfg, inputs, targets, 1, dtype=torch.float64)
        whole_qkv = build_model(cfg, torch.float64).layers[0].attn.qkv.weight.detach()
        d, half = cfg.d_model, cfg.d_model // T
        for rank in range(T):
            loss, grads, local_qkv = replies[rank][index]
            assert abs(loss - want_loss) <= 1e-10 * abs(want_loss), (variant, sp, rank, loss, want_loss)
            assert_grads_match({n: torch.from_numpy(g) for n, g in grads.items()}, want_grads, rtol=1e-10)
            # Rank t holds its heads' rows of q, k and v, not a contiguous third of the fused weight.
            rows = [part * d + rank * half + i for part in range(3) for i in range(half)]
            assert torch.equal(torch.from_numpy(local_qkv), whole_qkv[rows]), (variant, rank)
    # fp32 against the fp32 single process (the seeded depth parameters are drawn in the model's dtype)
    for index, (variant, _sp) in enumerate(TRITON_CASES, start=len(CASES)):
        want_loss, want_grads = reference_step(_config(variant), inputs, targets, 1, dtype=torch.float32)
        for rank in range(T):
            loss, grads, _local_qkv = replies[rank][index]
            assert abs(loss - want_loss) <= 1e-5 * abs(want_loss), (variant, "triton", rank, loss, want_loss)
            assert_grads_match({n: torch.from_numpy(g) for n, g in grads.items()}, want_grads, rtol=1e-4)


# ---- the pipeline runtime's ranks (StageWorker) with T = 2 over gloo: 4 processes ----
# Block AttnRes and MSAR (its halos under SP), a loop and a V schedule (ZB-V: the split backward, W
# from the weight store), and FSDP2 over dp on top of the tp split, which needs rank processes. The
# whole matrix (every variant x schedule x cache, P = 1, P = 2, D = 2) runs on the in-process
# launcher's thread ranks (tests/parity/test_tensor_parallel_inprocess.py); these check that rank processes
# over gloo give the same, and count what only they count in full: each rank's tp collectives'
# bytes, the partial gradients' sums over gloo included. (variant, schedule, P, V, m, cache,
# sequence parallel[, train and data_parallel keys]); block size 3 puts block edges inside chunks.
RUNTIME_GLOO = [("block", "interleaved_1f1b", 2, 2, 2, True, True), ("block", "zbv", 2, 2, 3, True, True),
                ("msar", "interleaved_1f1b", 2, 2, 2, True, False),
                # selective checkpointing replays the tp collectives its saved products do not cover
                ("msar", "zbv", 2, 2, 2, True, True, {"activation_checkpoint": "selective"}),
                # FSDP2 over dp on top of the tp split: the split backward's W store, MSAR's tied
                # convolutions and halos; all-gathers again after every forward, under checkpointing
                ("msar", "zbv", 1, 2, 2, True, True, {"data_parallel": 2, "dp_shard": "fsdp"}),
                ("block", "interleaved_1f1b", 1, 2, 2, True, True, {"data_parallel": 2, "dp_shard": "fsdp",
                                                                   "fsdp_reshard_after_forward": "always",
                                                                   "activation_checkpoint": "full"}),
                # grouped kv heads: the fused qkv's four row blocks split over tp, FSDP2's columns over
                # dp; QK-norm's replicated gains, their gradients summed over tp without SP
                ("block", "zbv", 1, 2, 2, True, False, {"data_parallel": 2, "dp_shard": "fsdp",
                                                        "model": {"n_heads": 4, "n_kv_heads": 2, "qk_norm": True}})]


def tp_run_dict(case):
    from attnres_pp.train.config import RunConfig

    variant, schedule, P, V, m, cache, sp, *rest = case
    extra = rest[0] if rest else {}
    cfg = model_config(variant, 4, block_size=3, **extra.get("model", {}))  # "model": a layer recipe's fields
    pipeline_keys = ("data_parallel", "dp_shard", "fsdp_reshard_after_forward")
    D = extra.get("data_parallel", 1)
    return RunConfig.from_dict({
        "model": cfg.to_dict(),
        "train": {"steps": 2, "batch_size": MICRO * m * D, "microbatches": m, "seed": 0, "warmup_steps": 1,
                  **{k: v for k, v in extra.items() if k not in (*pipeline_keys, "model")}},
        "pipeline": {"stages": P, "virtual": V, "schedule": schedule, "cache": cache, "launcher": "local",
                     "timeout_s": 60.0, "tensor_parallel": T, "sequence_parallel": sp, "data_parallel": D,
                     **{k: v for k, v in extra.items() if k in pipeline_keys}},
    }).to_dict()


def _worker_main(rank, init_method, run_dicts, results):
    try:
        from torch.distributed.tensor import DTensor

        from attnres_pp.pipeline.stage_setup import init_process_group
        from attnres_pp.train.stage_worker import StageWorker
        from tests.reference_model import randomize_depth_params

        torch.set_num_threads(1)
        pipe = run_dicts[0]["pipeline"]
        world = pipe["stages"] * pipe["data_parallel"] * T
        _backend, device = init_process_group(init_method, rank, world, 60.0)
        out = []
        for run_cfg in run_dicts:
            worker = StageWorker(run_cfg, rank)
            randomize_depth_params(worker.model, torch.Generator().manual_seed(1))
            worker.connect(device)
            D, m = run_cfg["pipeline"]["data_parallel"], run_cfg["train"]["microbatches"]
            inputs, targets = batch(D * m)
            rows = slice(worker.dp_rank * MICRO * m, (worker.dp_rank + 1) * MICRO * m)
            record = worker.backward(0, (inputs[rows], targets[rows]))
            grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).numpy().copy()
                     for n, p in worker.params.items() if p.grad is not None}
            fwd_bytes = sum(r[4] for r in worker.runtime.transport.ledger.records if r[0] == "fwd")
            whole_bytes = sum(p.numel() * p.element_size() for n, p in worker.params.items()
                              if not isinstance(p, DTensor) or n.endswith("norm.weight"))
            out.append((record.losses, grads, fwd_bytes, (worker.pp_rank, worker.tp_bytes, whole_bytes)))
            getattr(worker.runtime.transport, "close", lambda: None)()
        results.put((rank, out))
    except Exception:
        results.put((rank, traceback.format_exc()))


def variant_has_plain_collectives(case) -> bool:
    """Block AttnRes, one fused backward, no activation checkpointing: the row-parallel outputs are d
    wide (no projected keys), nothing is recomputed, there are no MSAR halos, and no weight store
    (whose W passes reduce some norm gains' partial gradients again, a few hundred bytes more)."""
    return case[0] == "block" and case[1] != "zbv" and not (case[7:] and case[7].get("activation_checkpoint"))


def _check_runtime(cases, tmp_path):
    from attnres_pp.comm.plan import hop_bytes_per_rank, plan_for_model
    from attnres_pp.pipeline.stage_setup import run_partition
    from attnres_pp.simulator.tensor_parallel import TensorParallel, layer_collectives
    from attnres_pp.train.config import RunConfig

    run_dicts = [tp_run_dict(case) for case in cases]
    world = RunConfig.from_dict(run_dicts[0]).pipeline.world_size
    replies = dict(spawn_ranks(_worker_main, world, tmp_path, run_dicts, timeout_s=240.0))
    for index, case in enumerate(cases):
        run_cfg = RunConfig.from_dict(run_dicts[index])
        D = run_cfg.pipeline.data_parallel
        cfg, m, sp = run_cfg.model, case[4], case[6]
        want_loss, want_grads = reference_step(cfg, *batch(D * m), D * m)
        per_rank = [replies[rank][index] for rank in range(world)]
        # Every tp rank of the last stage scores its own shard (under SP) or the whole (without):
        # the mean of their losses is the microbatches' mean loss.
        losses = [loss for losses, *_ in per_rank for loss in losses.values()]
        assert len(losses) == D * m * T, case
        loss = sum(losses) / len(losses)
        assert abs(loss - want_loss) <= 1e-5 * abs(want_loss), (case, loss, want_loss)
        merged: dict = {}
        for _losses, grads, _bytes, _tp in per_rank:
            for name, grad in grads.items():
                # the tp ranks of one stage hold the very same whole gradient
                kept = merged.setdefault(name, torch.from_numpy(grad))
                assert torch.allclose(kept, torch.from_numpy(grad), rtol=1e-6, atol=1e-9), (case, name)
        assert_grads_match(merged, want_grads, rtol=1e-5)
        # Each hop pair (d, p, t) -> (d, p + 1, t) carries its shard: comm.plan's count, per rank.
        partition = run_partition(cfg.n_layers, run_cfg.pipeline)
        plan = plan_for_model(cfg, partition, run_cfg.pipeline.cache)
        per_hop = hop_bytes_per_rank(plan, tokens=MICRO * cfg.seq_len, width=cfg.source_width, element_bytes=4,
                                     tensor_parallel=T, sequence_parallel=sp)
        sent_by_pair = sum(per_hop[h] for h in range(len(per_hop)) if partition.rank_of(h) != partition.rank_of(h + 1))
        total_fwd = sum(b for _losses, _grads, b, _tp in per_rank)
        assert total_fwd == D * T * m * sent_by_pair, (case, total_fwd, D * T * m * sent_by_pair)
        if variant_has_plain_collectives(case):
            # The tp collectives each rank counted are the simulator's per-layer terms (forward and
            # backward, each microbatch) plus, under SP, the sums of the partial gradients of what
            # it holds whole (an all-reduce each).
            per_layer = sum(c["count"] * c["sent_bytes_per_rank"] for c in layer_collectives(
                MICRO * cfg.seq_len, cfg.d_model, 4, TensorParallel(T, sp)))
            for _losses, _grads, _bytes, (pp_rank, tp_bytes, whole_bytes) in per_rank:
                n_layers = sum(len(partition.layer_range(c)) for c in partition.chunks_of(pp_rank))
                want = 2 * m * n_layers * per_layer + (2 * whole_bytes * (T - 1) // T if sp else 0)
                assert tp_bytes == want, (case, pp_rank, tp_bytes, want)


def test_two_stages_or_two_replicas_of_two_tp_rank_processes_equal_the_single_process(tmp_path):
    _check_runtime(RUNTIME_GLOO, tmp_path)
