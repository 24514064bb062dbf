"""Expert slices sharded by FSDP2 over "edp" (`train.fsdp`): at D = 4, EP = 2 under `--dp-shard fsdp`
each routed-expert slice (E / EP = 2 experts) is split over the D / EP = 2 replicas that hold it, so
a rank holds one expert of each MoE layer. In four gloo rank processes (P = 1): the step's loss and
every gradient equal the single process's (fp32, 1e-5; the expert gradient is the mean over all D
replicas' batches although its reduce-scatter runs over two); two AdamW steps with active clipping
and aux-free balancing keep the single process's losses, norms and selection biases (equal on every
replica); the held bytes are what `simulate memory` prices. The CLI run at EP = 2, D = 4 under fsdp,
its losses against EP = 1 and its checkpoints into another EP and D: test_expert_fsdp_save.py."""

from __future__ import annotations

import pytest
import torch

from tests.spawn_helpers import spawn_ranks

pytestmark = pytest.mark.distributed

D, EP, M = 4, 2, 2
MOE = dict(moe_experts=4, moe_top_k=2, moe_shared_experts=1, moe_dense_layers=1, moe_bias_gamma=0.01)


def _run_config():
    from tests.parity.test_expert_parallel import moe_config, run_config

    run_cfg = run_config(moe_config("block", **MOE), D=D, P=1, V=1, m=M, EP=EP, grad_clip=0.05, lr=1e-2)
    as_dict = run_cfg.to_dict()
    as_dict["pipeline"].update(launcher="local", dp_shard="fsdp")
    return as_dict


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor shard made whole over its mesh (a collective), a plain tensor as is."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _rank(rank: int, init_method: str, run_cfg: dict, batches: list, results) -> None:
    """One rank: a backward (every gradient made whole), then two training steps."""
    import traceback

    from attnres_pp.model.moe import moe_sublayers, take_aux, take_loads
    from attnres_pp.pipeline.expert_parallel import expert_rows
    from attnres_pp.pipeline.stage_setup import init_process_group
    from attnres_pp.train.stage_worker import StageWorker
    from tests.reference_model import randomize_depth_params

    try:
        torch.set_num_threads(1)
        _backend, device = init_process_group(init_method, rank, D, 60.0)
        worker = StageWorker(run_cfg, rank)
        shard = worker._shard

        def random_reads_then_shard(dp_mesh) -> None:  # the reference's pseudo-queries, before FSDP2
            randomize_depth_params(worker.model, torch.Generator().manual_seed(1))
            shard(dp_mesh)

        worker._shard = random_reads_then_shard
        worker.connect(device)
        share = batches[0][0].shape[0] // D
        mine = [(i[rank * share:(rank + 1) * share], t[rank * share:(rank + 1) * share]) for i, t in batches]
        record = worker.backward(0, mine[0])
        rows = {name: (held.start, held.stop) for name, held in expert_rows(worker.model).items()}
        held_rows = {name: _local_rows(worker.params[name]) for name in rows}
        # numpy arrays: pickled by value (a torch tensor would be shared by a descriptor of this process)
        grads = {name: _full(p.grad).numpy().copy() for name, p in worker.params.items() if p.requires_grad}
        for p in worker.params.values():
            p.grad = None
        take_loads(moe_sublayers(worker.model))  # the training steps' balancing counts their own loads
        take_aux(moe_sublayers(worker.model))
        steps = []
        for step, rank_batch in enumerate(mine[1:]):
            reply = worker.train_step(step, 1e-2, rank_batch)
            steps.append((reply.loss_sum / reply.n_losses, reply.grad_norm))
        held = worker.memory(record)  # after AdamW made its moments
        biases = {name: moe.expert_bias.detach().numpy().copy() for name, moe in moe_sublayers(worker.model).items()}
        results.put((rank, sum(record.losses.values()), grads, rows, held_rows, held, steps, biases))
    except Exception:
        results.put((rank, traceback.format_exc()))


def _local_rows(param: torch.Tensor) -> int:
    from torch.distributed.tensor import DTensor

    assert isinstance(param, DTensor) and param.device_mesh.size() == D // EP, type(param)
    return param.to_local().shape[0]


def test_sharded_expert_slices_equal_the_single_process(tmp_path):
    from attnres_pp.simulator.memory_state import rank_state_bytes
    from attnres_pp.train.config import RunConfig
    from tests.parity.test_expert_parallel import reference
    from tests.pipeline_helpers import assert_grads_match, batch
    from tests.reference_model import randomize_depth_params
    from tests.whole_model import WholeModel

    run_cfg = _run_config()
    batches = [batch(D * M, seed=s) for s in (2, 10, 11)]
    replies = sorted(spawn_ranks(_rank, D, tmp_path, run_cfg, batches, timeout_s=300.0))
    cfg = RunConfig.from_dict(run_cfg)
    want_loss, want_grads = reference(cfg.model, *batches[0], D * M)
    loss = sum(r[1] for r in replies) / (D * M)
    assert abs(loss - want_loss) <= 1e-5 * abs(want_loss), (loss, want_loss)
    n_experts = cfg.model.moe_experts
    for _rank_id, _loss, rank_grads, rows, held_rows, _held, _steps, _biases in replies:
        grads = {name: torch.from_numpy(g) for name, g in rank_grads.items()}
        # each rank holds E / D experts of every slice: EP split them, edp split the slice
        assert rows and set(held_rows.values()) == {n_experts // D}, held_rows
        whole = dict(grads)
        for name, (first, stop) in rows.items():
            assert grads[name].shape[0] == stop - first
            whole[name] = want_grads[name].clone()
            whole[name][first:stop] = grads[name]  # this rank's experts' rows; the others are its EP peers'
        assert_grads_match(whole, want_grads, rtol=1e-5)
    # what simulate memory prices for rank (dp_rank, 0)
    for dp_rank, reply in enumerate(replies):
        priced = rank_state_bytes(cfg.model, _partition(cfg), 0, data_parallel=D, dp_shard="fsdp", dp_rank=dp_rank,
                                  expert_parallel=EP)
        assert {k: reply[5][k] for k in priced} == priced, (dp_rank, reply[5], priced)
    # two AdamW steps with clipping and aux-free balancing: the single process's losses, norms and biases
    local = WholeModel(cfg.model, cfg.train)
    randomize_depth_params(local.model, torch.Generator().manual_seed(1))
    for step, (inputs, targets) in enumerate(batches[1:]):
        want = local.train_step(step, inputs, targets, 1e-2)
        assert want.metrics["grad_norm"] > 0.05  # clipping acts
        got_loss = sum(r[6][step][0] for r in replies) / D
        assert abs(got_loss - want.loss) <= 1e-5 * abs(want.loss), (step, got_loss, want.loss)
        for reply in replies:
            got_norm = reply[6][step][1]
            assert abs(got_norm - want.metrics["grad_norm"]) <= 1e-5 * want.metrics["grad_norm"], (step, got_norm)
    from attnres_pp.model.moe import moe_sublayers

    want_bias = {name: moe.expert_bias for name, moe in moe_sublayers(local.model).items()}
    assert any(b.abs().sum() > 0 for b in want_bias.values())
    for reply in replies:
        assert set(reply[7]) == set(want_bias)
        for name, bias in reply[7].items():
            assert torch.allclose(torch.from_numpy(bias), want_bias[name], rtol=0, atol=1e-7), (reply[0], name)
            assert (bias == replies[0][7][name]).all()  # equal on every replica


def _partition(cfg):
    from attnres_pp.comm.partition import make_partition

    return make_partition(cfg.model.n_layers, cfg.pipeline.stages, cfg.pipeline.virtual)
