"""The layer split of tensor and sequence parallelism (`pipeline.tensor_parallel`) over gloo: T = 2
rank processes share every layer of the whole model (P = 1), and their loss and every gradient
equal the single-process model's in float64, with and without sequence parallelism."""

from __future__ import annotations

import traceback

import pytest
import torch

from tests.pipeline_helpers import MICRO, assert_grads_match, batch, build_model, model_config, reference_step
from tests.spawn_helpers import spawn_ranks

pytestmark = pytest.mark.distributed

T = 2
# (variant, sequence parallel): Block AttnRes both ways; projected keys (the row-parallel outputs'
# extra r columns) and the standard residual under SP; MSAR only without SP (no halo exchange).
CASES = [("block", True), ("block", False), ("lr_projected", True), ("standard", True), ("msar", False)]


def _config(variant):
    return model_config(variant, n_layers=3, n_heads=2, d_model=16)


def _rank_main(rank, init_method, cases, results):
    try:
        from attnres_pp.pipeline.mesh import MeshCollectives, RankCoords
        from attnres_pp.pipeline.stage_setup import init_process_group
        from attnres_pp.pipeline.tensor_parallel import full_grads, parallelize_layers, rank_loss, sum_replicated_grads

        torch.set_num_threads(1)
        init_process_group(init_method, rank, T, 60.0)
        coords = RankCoords(rank, data_parallel=1, stages=1, tensor_parallel=T)
        collectives = MeshCollectives(coords, "cpu")
        inputs, targets = batch(1)
        out = []
        for variant, sp in cases:
            cfg = _config(variant)
            model = build_model(cfg, torch.float64)
            parallelize_layers(cfg, model.layers, collectives.mesh["tp"], sequence_parallel=sp)
            loss = rank_loss(model, inputs, targets, tp_rank=coords.tp_rank, tensor_parallel=T, sequence_parallel=sp)
            loss.backward()
            if sp:
                sum_replicated_grads(model, collectives)
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
    replies = dict(spawn_ranks(_rank_main, T, tmp_path, CASES, timeout_s=180.0))
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
