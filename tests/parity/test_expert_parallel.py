"""Expert parallelism in one process (thread ranks, loopback hops, thread all-to-alls): EP = 2 ranks of
each stage share an MoE model's routed experts (E = 4, K = 2, one shared expert, one dense layer).
A step's loss and every gradient equal the single-process model's (fp32, 1e-5) in every residual
variant; under ZB-V's I/W split with full activation checkpointing and no cache (and equal EP = 1's
gradient for gradient); with two expert replicas (D = 4); with a rank whose experts get no token;
with tensor parallelism on the attention (T = 2, with and without sequence parallelism); under bf16
to bf16's rounding. The slices equal the whole experts in float64 (1e-10). AdamW steps with clipping
keep equal losses, norms, loads and aux-free biases; thread ranks' checkpoints load at another EP.
Rank processes over gloo and Ray: tests/distributed/test_expert_parallel_gloo.py, test_ray.py."""

from __future__ import annotations

import threading

import pytest
import torch
from torch.distributed.tensor import DTensor

from attnres_pp.launch.thread_rank_group import ThreadRankGroup
from attnres_pp.model.layers import init_weights
from attnres_pp.model.moe import RoutedExperts, moe_sublayers, set_aux_scale
from attnres_pp.pipeline.expert_parallel import ExpertSlice, expert_rows
from attnres_pp.pipeline.mesh import RankCoords, thread_collectives
from attnres_pp.train.config import RunConfig
from attnres_pp.train.engines import make_engine
from attnres_pp.train.stage_worker import StageWorker
from tests.pipeline_helpers import MICRO, assert_grads_match, batch, build_model, model_config
from tests.reference_model import randomize_depth_params
from tests.whole_model import WholeModel

MOE = dict(moe_experts=4, moe_top_k=2, moe_shared_experts=1, moe_dense_layers=1)


def moe_config(variant: str, **overrides):
    return model_config(variant, 4, **{**MOE, **overrides})


def run_config(cfg, *, D, P, V, m, EP, schedule="1f1b", cache=True, **train) -> RunConfig:
    return RunConfig.from_dict({
        "model": cfg.to_dict(),
        "train": {"steps": 3, "batch_size": MICRO * m * D, "microbatches": m, "seed": 0, "warmup_steps": 1, **train},
        "pipeline": {"stages": P, "virtual": V, "data_parallel": D, "schedule": schedule, "cache": cache,
                     "launcher": "inprocess", "timeout_s": 60.0, "expert_parallel": EP},
    })


def engine_with_random_reads(run_cfg: RunConfig, bias_E: torch.Tensor | None = None):
    """Non-zero pseudo-queries and gates on every rank, drawn as the reference model draws them;
    `bias_E`, if given, every MoE sublayer's selection bias."""
    engine = make_engine(run_cfg)
    for worker in engine.ranks.workers:
        randomize_depth_params(worker.model, torch.Generator().manual_seed(1))
        set_bias(worker.model, bias_E)
    return engine


def set_bias(model, bias_E: torch.Tensor | None) -> None:
    if bias_E is not None:
        for moe in moe_sublayers(model).values():
            moe.expert_bias.data.copy_(bias_E)


def whole_grads(engine) -> dict[str, torch.Tensor]:
    """Every rank's synced gradients by whole-model name, expert slices put in their rows; ranks that
    hold the same rows (replicas; an expert slice's holders) must agree."""
    grads: dict[str, torch.Tensor] = {}
    for worker in engine.ranks.workers:
        rows = expert_rows(worker.model)
        for name, p in worker.params.items():
            if not p.requires_grad:
                continue
            if name in rows:
                whole = grads.setdefault(name, torch.full((4, *p.shape[1:]), float("nan")))
                held = whole[rows[name]]
                assert torch.isnan(held).all() or torch.equal(held, p.grad), f"{name} differs between holders"
                whole[rows[name]] = p.grad
            else:
                kept = grads.setdefault(name, p.grad)
                assert torch.equal(kept, p.grad), f"{name} differs between ranks (rank {worker.rank})"
    assert not any(torch.isnan(g).any() for g in grads.values()), "some expert rows are held by no rank"
    return grads


def reference(cfg, inputs, targets, n_microbatches: int, bias_E: torch.Tensor | None = None):
    """The single-process model's mean loss and gradients (parameters that train only); the aux loss
    enters each microbatch's backward scaled as its loss is."""
    model = build_model(cfg)
    set_bias(model, bias_E)
    set_aux_scale(model, 1.0 / n_microbatches)
    total = 0.0
    for i, t in zip(inputs.chunk(n_microbatches), targets.chunk(n_microbatches), strict=True):
        loss = model(i, t)
        (loss / n_microbatches).backward()
        total += float(loss.detach())
    return total / n_microbatches, {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def step_equals_single_process(cfg, bias_E: torch.Tensor | None = None, **layout) -> dict[str, torch.Tensor]:
    D, m = layout["D"], layout["m"]
    engine = engine_with_random_reads(run_config(cfg, **layout), bias_E)
    inputs, targets = batch(D * m)
    records = engine.ranks.call("backward", [(0, b) for b in engine.rank_batches(inputs, targets)])
    loss = sum(loss for r in records for loss in r.losses.values()) / (D * m)
    want_loss, want_grads = reference(cfg, inputs, targets, D * m, bias_E)
    assert abs(loss - want_loss) <= 1e-5 * abs(want_loss), (loss, want_loss)
    got = whole_grads(engine)
    assert_grads_match(got, want_grads, rtol=1e-5)
    engine.close()
    return got


@pytest.mark.parametrize("variant", ["standard", "block", "lr_projected", "msar"])
def test_ep2_step_equals_single_process(variant):
    """D = 2, P = 2 under 1F1B, the cache on: each stage's two replicas share its experts."""
    overrides = {"moe_balance": "aux_loss", "moe_router": "sigmoid"} if variant == "msar" else {}
    step_equals_single_process(moe_config(variant, **overrides), D=2, P=2, V=1, m=2, EP=2)


def test_ep_split_schedule_checkpointing_and_replicas_equal_ep1():
    """ZB-V's I/W split with full activation checkpointing (the recomputation runs the all-to-alls
    again), no cache; and D = 4 with EP = 2, so two ranks hold each expert slice: both equal the
    single process, and EP = 2 equals EP = 1 gradient for gradient."""
    cfg = moe_config("block")
    ep2 = step_equals_single_process(cfg, D=2, P=2, V=2, m=3, EP=2, schedule="zbv", cache=False,
                                     activation_checkpoint="full")
    ep1 = step_equals_single_process(cfg, D=2, P=2, V=2, m=3, EP=1, schedule="zbv", cache=False,
                                     activation_checkpoint="full")
    assert_grads_match(ep2, ep1, rtol=1e-5)
    step_equals_single_process(cfg, D=4, P=1, V=2, m=2, EP=2, schedule="interleaved_1f1b")


def test_ep_under_bf16_autocast_equals_ep1():
    """bf16 autocast over fp32 weights (the rows cross the all-to-alls in bf16, the grouped matmul
    casts itself): EP = 2's loss is EP = 1's and its gradients agree to bf16's rounding (measured:
    4e-3 of each tensor's largest; 2^-6 allowed)."""
    cfg = moe_config("block")
    inputs, targets = batch(4)
    runs = []
    for ep in (1, 2):
        engine = engine_with_random_reads(run_config(cfg, D=2, P=2, V=1, m=2, EP=ep, dtype="bf16"))
        records = engine.ranks.call("backward", [(0, b) for b in engine.rank_batches(inputs, targets)])
        runs.append((sum(loss for r in records for loss in r.losses.values()), whole_grads(engine)))
        engine.close()
    (loss1, grads1), (loss2, grads2) = runs
    assert abs(loss2 - loss1) <= 1e-5 * abs(loss1)
    assert_grads_match(grads2, grads1, rtol=2 ** -6)


def test_a_rank_whose_experts_get_no_tokens_still_joins_every_all_to_all():
    """Biases that send every token to experts 0 and 1: EP rank 1 receives no rows, computes
    nothing, and still meets its group in the combine and in both backward all-to-alls (the step
    would hang otherwise); its experts' gradients are zeros, as the single process's."""
    grads = step_equals_single_process(moe_config("block"), bias_E=torch.tensor([10.0, 10.0, 0.0, 0.0]),
                                       D=2, P=2, V=1, m=2, EP=2)
    assert all(not g[2:].any() and g[:2].any() for name, g in grads.items() if ".experts." in name)


def test_ep_training_equals_single_process_and_biases_stay_equal():
    """Two AdamW steps with active clipping (the norm counts each expert once) and aux-free
    balancing, then the pipelined evaluation: losses and norms equal the single process, and every
    rank's selection biases equal the single process's after each step (the second step routes with
    the biases the first moved; a third would repeat that)."""
    cfg = moe_config("lr_projected", moe_bias_gamma=0.01)
    run_cfg = run_config(cfg, D=2, P=2, V=1, m=2, EP=2, grad_clip=0.05, lr=1e-2)
    engine, local = make_engine(run_cfg), WholeModel(run_cfg.model, run_cfg.train)
    for step in range(2):
        inputs, targets = batch(4, seed=10 + step)
        got, want = engine.train_step(step, inputs, targets, 1e-2), local.train_step(step, inputs, targets, 1e-2)
        assert abs(got.loss - want.loss) <= 1e-5 * abs(want.loss), (step, got.loss, want.loss)
        norm, want_norm = got.metrics["grad_norm"], want.metrics["grad_norm"]
        assert want_norm > 0.05 and abs(norm - want_norm) <= 1e-5 * want_norm, (step, norm, want_norm)
        # tokens per expert, summed over the replicas (the counters start at zero on every rank)
        assert got.extras["moe_expert_loads"] == want.extras["moe_expert_loads"], step
        want_bias = {name: moe.expert_bias for name, moe in moe_sublayers(local.model).items()}
        assert any(bias.abs().sum() > 0 for bias in want_bias.values())
        for worker in engine.ranks.workers:
            for name, moe in moe_sublayers(worker.model).items():
                assert torch.equal(moe.expert_bias, want_bias[name]), (step, worker.rank, name)
    inputs, targets = batch(4, seed=99)
    want = local.eval_loss(inputs, targets)
    assert abs(engine.eval_loss(inputs, targets) - want) <= 1e-5 * abs(want)
    engine.close()


def _held_state(engine) -> dict[str, torch.Tensor]:
    """Every parameter and AdamW moment of the run by whole-model key, expert slices put in their rows."""
    out: dict[str, torch.Tensor] = {}
    for worker in engine.ranks.workers:
        rows = expert_rows(worker.model)
        for name, p in worker.params.items():
            values = {name: p.detach(), **{f"optim.{name}.{k}": v for k, v in worker.optimizer.state[p].items()
                                           if k != "step"}}
            for key, value in values.items():
                if name in rows:
                    out.setdefault(key, torch.zeros((4, *value.shape[1:])))[rows[name]] = value
                else:
                    out[key] = value
    return out


@pytest.mark.parametrize("first,then", [(2, 1), (1, 2)])
def test_thread_ranks_checkpoints_load_at_another_ep(first, then, tmp_path):
    """Thread ranks at EP = `first` after an AdamW step save (the EP group gathers its slices whole:
    rank 0 writes for all), and ranks at EP = `then` load it: every parameter and moment, by row."""
    cfg = moe_config("block")
    saved = make_engine(run_config(cfg, D=2, P=2, V=1, m=2, EP=first))
    saved.train_step(0, *batch(4, seed=10), 1e-2)
    saved.save_checkpoint(tmp_path / "step_1")
    loaded = make_engine(run_config(cfg, D=2, P=2, V=1, m=2, EP=then))
    loaded.train_step(0, *batch(4, seed=11), 1e-3)  # other values (and AdamW state to overwrite)
    loaded.load_checkpoint(tmp_path / "step_1")
    want, got = _held_state(saved), _held_state(loaded)
    assert set(got) == set(want) and any(".experts." in key for key in want)
    for key, value in want.items():
        assert torch.equal(got[key], value), key
    saved.close()
    loaded.close()


def test_each_rank_holds_its_slice_of_the_experts_with_the_single_process_values():
    cfg = moe_config("block")
    engine = make_engine(run_config(cfg, D=2, P=2, V=1, m=2, EP=2))
    whole = build_model(cfg)
    for worker in engine.ranks.workers:
        slices = [m for m in worker.model.modules() if isinstance(m, ExpertSlice) and not m.gate_up.is_meta]
        assert slices and all(m.gate_up.shape[0] == 2 for m in slices)
        for name, rows in expert_rows(worker.model).items():
            assert rows == slice(2 * worker.coords.ep_rank, 2 * worker.coords.ep_rank + 2)
            assert torch.equal(worker.params[name].detach(), whole.get_parameter(name).detach()[rows])
    engine.close()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_expert_slices_equal_the_whole_experts_in_float64_and_with_a_rank_left_empty(dtype):
    """Two thread ranks' `ExpertSlice`s against `RoutedExperts` holding all four experts, on each
    rank's own token-choices: outputs and input gradients per rank, weight gradients summed over the
    two (float64: the per-expert loop, 1e-10; fp32: the grouped matmul). Rank 1's experts (2, 3) get
    no token here, so it computes nothing and still joins every all-to-all."""
    cfg = moe_config("block")
    whole = RoutedExperts(cfg).to(dtype)
    init_weights(whole, cfg, seed=0)
    slices = [ExpertSlice(cfg, ep_rank, 2).to(dtype) for ep_rank in range(2)]
    for ep_rank, experts in enumerate(slices):
        experts.load_state_dict({k: v[2 * ep_rank:2 * ep_rank + 2] for k, v in whole.state_dict().items()})
    for experts, collectives in zip(slices, thread_collectives(2, 1, 30.0, expert_parallel=2), strict=True):
        experts.collectives = collectives
    g = torch.Generator().manual_seed(3)
    x_RND = [torch.randn(6, cfg.d_model, generator=g, dtype=dtype, requires_grad=True) for _ in range(2)]
    expert_RNK = [torch.randint(0, 2, (6, 2), generator=g) for _ in range(2)]
    grad_RNKW = [torch.randn(6, 2, cfg.source_width, generator=g, dtype=dtype) for _ in range(2)]
    results: dict[int, tuple] = {}

    def run(rank: int) -> None:
        y = slices[rank](x_RND[rank], expert_RNK[rank])
        y.backward(grad_RNKW[rank])
        results[rank] = (y.detach(), x_RND[rank].grad.clone())
        x_RND[rank].grad = None

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    for rank in range(2):
        y = whole(x_RND[rank], expert_RNK[rank])
        y.backward(grad_RNKW[rank])
        assert results and torch.allclose(results[rank][0], y, rtol=tol, atol=tol)
        assert torch.allclose(results[rank][1], x_RND[rank].grad, rtol=tol, atol=tol)
    # Every choice is of rank 0's experts: rank 1 dispatches its 12 rows (d wide) and gets their
    # gradients back; rank 0 combines them back (W wide) and gets those gradients.
    row_bytes = (cfg.d_model + cfg.source_width) * torch.tensor([], dtype=dtype).element_size()
    assert [experts.sent_bytes for experts in slices] == [12 * row_bytes] * 2
    for name in ("gate_up", "down"):
        # The per-expert loop leaves no gradient where no row ran (the rank's sync makes it zeros).
        got = torch.cat([torch.zeros_like(p) if p.grad is None else p.grad
                         for p in (getattr(experts, name) for experts in slices)])
        assert torch.allclose(got, getattr(whole, name).grad, rtol=tol, atol=tol), name
        assert not got[2:].any()


class GradWorker(StageWorker):
    """A training rank seeded as the reference model; `step_grads` returns its losses and its synced
    gradients whole (a tp-split weight's gathered) with the rows each expert slice holds."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        randomize_depth_params(self.model, torch.Generator().manual_seed(1))

    def step_grads(self, inputs, targets) -> tuple:
        m = self.run_cfg.train.microbatches
        rows = slice(self.dp_rank * MICRO * m, (self.dp_rank + 1) * MICRO * m)
        record = self.backward(0, (inputs[rows], targets[rows]))
        held = expert_rows(self.model)
        grads = {n: ((p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone(), held.get(n))
                 for n, p in self.params.items() if p.requires_grad}
        return list(record.losses.values()), grads


# (variant, D, P, V, schedule, EP, sequence parallel) at T = 2
TP_CASES = [("block", 2, 1, 2, "interleaved_1f1b", 2, True), ("msar", 2, 2, 1, "1f1b", 2, False),
            ("lr_projected", 1, 2, 1, "1f1b", 1, True)]


@pytest.mark.parametrize("case", TP_CASES, ids=lambda c: f"{c[0]}-D{c[1]}P{c[2]}V{c[3]}-EP{c[5]}-sp{int(c[6])}")
def test_moe_with_tensor_parallel_attention_equals_single_process(case):
    """T = 2 thread ranks split the attention; the MoE sublayers stay whole on each tp rank (their
    experts split over EP as without tp) and run on its tokens: under sequence parallelism its
    shard, whose gradients are summed over tp. Loss and every gradient equal the single process."""
    variant, D, P, V, schedule, EP, sp = case
    cfg = moe_config(variant)
    run_dict = run_config(cfg, D=D, P=P, V=V, m=2, EP=EP, schedule=schedule).to_dict()
    run_dict["pipeline"] |= {"tensor_parallel": 2, "sequence_parallel": sp}
    world = RunConfig.from_dict(run_dict).pipeline.world_size
    inputs, targets = batch(D * 2)
    group = ThreadRankGroup(world, stages=P, timeout_s=60.0, tensor_parallel=2, expert_parallel=EP)
    try:
        group.start(GradWorker, [{"run_cfg_dict": run_dict, "rank": r} for r in range(world)])
        replies = group.call_all("step_grads", inputs, targets)
    finally:
        group.stop(graceful=True)
    losses = [loss for rank_losses, _ in replies for loss in rank_losses]
    want_loss, want_grads = reference(cfg, inputs, targets, D * 2)
    assert len(losses) == D * 2 * 2 and abs(sum(losses) / len(losses) - want_loss) <= 1e-5 * abs(want_loss)
    got: dict[str, torch.Tensor] = {}
    for _losses, grads in replies:
        for name, (grad, rows) in grads.items():
            if rows is None:
                got[name] = grad
            else:
                got.setdefault(name, torch.zeros_like(want_grads[name]))[rows] = grad
    assert_grads_match(got, want_grads, rtol=1e-5)


def test_expert_parallel_groups_lie_along_the_data_parallel_axis():
    coords = [RankCoords(rank, 4, 2, 1, 2) for rank in range(8)]  # D = 4, P = 2, EP = 2
    assert [c.ep_rank for c in coords] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert coords[2].axis_members("ep") == [0, 2] and coords[5].axis_members("ep") == [5, 7]
    assert coords[0].axis_members("edp") == [0, 4] and coords[3].axis_members("edp") == [3, 7]


@pytest.mark.parametrize("flags,model,message", [
    ({"expert_parallel": 2, "data_parallel": 2}, {}, "needs a mixture-of-experts model"),
    ({"expert_parallel": 3, "data_parallel": 3}, MOE, "does not divide --moe-experts 4"),
    ({"expert_parallel": 2, "data_parallel": 3}, MOE, "does not divide --data-parallel 3"),
    ({"expert_parallel": 0}, MOE, "give an integer >= 1"),
    ({"tensor_parallel": 2}, {**MOE, "moe_balance": "aux_loss"}, "aux_loss with --tensor-parallel 2 under sequence"),
])
def test_bad_expert_parallel_settings_are_one_clear_error(flags, model, message):
    with pytest.raises(ValueError, match=message):
        RunConfig.from_dict({"model": model_config("block", 4, **model).to_dict(),
                             "train": {"batch_size": 12, "microbatches": 1},
                             "pipeline": {"launcher": "local", **flags}})
