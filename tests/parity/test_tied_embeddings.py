"""Tied embeddings with the embedding and the LM head on two pipeline ranks (Megatron's embedding
group, `grad_sync.TiedEmbedding`): each rank holds a copy of the matrix, initialised equal, and their
gradients are summed between the two after the backward. Over the curated cases of
tests/parity/parity_cases.py (`TIED_CASES`) a step of rank-local models, each rank building only its
own chunks, gives the single process's loss and every gradient (fp32 1e-5, float64 1e-10), the two
copies bit-equal; where one rank holds both (V placement, P = 1) there is one parameter and no group."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from attnres_pp.comm.partition import make_partition, tied_copy_ranks
from attnres_pp.comm.plan import plan_for_model
from attnres_pp.pipeline.chunk import build_rank_model, rank_parameters
from attnres_pp.pipeline.loopback import make_loopback_runtimes, run_loopback_step
from attnres_pp.pipeline.mesh import thread_collectives
from attnres_pp.schedule.passes import insert_comm
from attnres_pp.schedule.schedules import SCHEDULES, build_schedule, schedule_placement
from attnres_pp.schedule.validate import validate
from attnres_pp.train.grad_sync import TiedEmbedding, sync_gradients
from attnres_pp.train.tied_keys import stored_key
from tests.pipeline_helpers import MICRO, SEQ, assert_grads_match, batch, shared_reference_step
from tests.reference_model import randomize_depth_params

from .parity_cases import TIED_CASES, ParityCase


def rank_local_step(case: ParityCase) -> tuple[float, list[dict[str, torch.nn.Parameter]]]:
    """One pipelined step of rank-local models over loopback hops, then each rank's gradient sync as a
    StageWorker's (MSAR's convolutions over every rank, then the embedding group's sum), the ranks as
    threads: (mean loss, each rank's parameters)."""
    cfg, P, V, m = case.config(), case.n_stages, case.n_virtual, case.n_microbatches
    partition = make_partition(cfg.n_layers, P, V, placement=schedule_placement(case.schedule))
    models, rank_chunks = [], []
    for rank in range(P):
        model, chunks = build_rank_model(cfg, partition, rank, seed=0, activation_checkpoint=case.policy)
        model.to(case.torch_dtype)
        randomize_depth_params(model, torch.Generator().manual_seed(1))  # as tests.pipeline_helpers.build_model
        models.append(model)
        rank_chunks.append(chunks)
    schedule = insert_comm(build_schedule(case.schedule, P, V, m))
    validate(schedule)
    runtimes = make_loopback_runtimes(cfg, rank_chunks, plan_for_model(cfg, partition, case.cache), schedule,
                                      (MICRO, SEQ))
    inputs, targets = batch(m)
    records = run_loopback_step(runtimes, list(inputs.chunk(m)), list(targets.chunk(m)), 1.0 / m)
    params = [rank_parameters(chunks, model) for chunks, model in zip(rank_chunks, models, strict=True)]
    collectives = thread_collectives(1, P, timeout_s=30.0)
    ties = [TiedEmbedding(cfg.tie_embeddings, partition, rank) for rank in range(P)]

    def sync(rank: int) -> None:
        own = params[rank]
        convs = [p for name, p in own.items() if name.startswith("stream_convs.")]
        sync_gradients([p for name, p in own.items() if not name.startswith("stream_convs.")], convs,
                       collectives[rank], data_parallel=1)
        ties[rank].sync(own, collectives[rank])

    with ThreadPoolExecutor(P) as pool:
        list(pool.map(sync, range(P)))
    loss = sum(loss for record in records for loss in record.losses.values()) / m
    return loss, params


def by_checkpoint_name(models_params: list[dict]) -> dict[str, torch.Tensor]:
    """Every rank's gradients under the names a checkpoint stores (the head's copy as the embedding);
    a parameter held on two ranks must have bit-equal gradients there."""
    grads: dict[str, torch.Tensor] = {}
    for params in models_params:
        for name, p in params.items():
            key = "embed.tok.weight" if name == "head.lm_head.weight" else name
            kept = grads.setdefault(key, p.grad)
            assert torch.equal(kept, p.grad), f"{key}: the ranks' copies differ"
    return grads


@pytest.mark.parametrize("case", TIED_CASES, ids=lambda case: case.id)
def test_rank_local_tied_step_equals_single_process(case: ParityCase):
    cfg, m = case.config(), case.n_microbatches
    loss, params = rank_local_step(case)
    want_loss, want_grads = shared_reference_step(cfg, m, dtype=case.torch_dtype)
    rtol = 1e-10 if case.dtype == "float64" else 1e-5
    assert abs(loss - want_loss) <= (1e-12 if case.dtype == "float64" else rtol * abs(want_loss))
    assert_grads_match(by_checkpoint_name(params), want_grads, rtol=rtol)
    holders = [r for r, p in enumerate(params) if {"embed.tok.weight", "head.lm_head.weight"} & set(p)]
    assert tuple(holders) == (tied_copy_ranks(True, case.partition()) or (0,))


def test_the_tied_cases_cover_every_schedule_cache_on_and_off_and_float64():
    assert {c.schedule for c in TIED_CASES} == set(SCHEDULES)
    assert all(c.config().tie_embeddings for c in TIED_CASES)
    across = [c for c in TIED_CASES if tied_copy_ranks(True, c.partition())]
    assert {c.cache for c in across} == {True, False} and {c.dtype for c in across} == {"float32", "float64"}
    assert any(c.n_stages == 3 for c in across) and any(c.policy != "none" for c in across)


def test_the_two_copies_start_bit_equal_and_the_checkpoint_names_them_once():
    from attnres_pp.model import Transformer
    from tests.pipeline_helpers import model_config

    cfg = model_config("block", 6, n_heads=4, n_kv_heads=1, tie_embeddings=True)
    partition = make_partition(6, 3, 1)
    first, _ = build_rank_model(cfg, partition, 0, seed=5)
    last, chunks = build_rank_model(cfg, partition, 2, seed=5)
    whole = Transformer(cfg, seed=5)
    assert torch.equal(first.embed.tok.weight, whole.embed.tok.weight)
    assert torch.equal(last.head.lm_head.weight, whole.embed.tok.weight)
    assert "head.lm_head.weight" in rank_parameters(chunks, last)
    assert stored_key(last, "head.lm_head.weight") == "embed.tok.weight"
    assert stored_key(last, "optim.head.lm_head.weight.exp_avg") == "optim.embed.tok.weight.exp_avg"
    untied = model_config("block", 6)
    assert stored_key(Transformer(untied), "head.lm_head.weight") == "head.lm_head.weight"


def _workers_at(engine, pp_rank: int) -> list:
    return [w for w in engine.ranks.workers if w.pp_rank == pp_rank]


# (D, P, V, m, schedule, cache): three ranks (the embedding group is not the pp group) under data
# parallelism, and the split backward's interleaved order without the cache.
ENGINE_LAYOUTS = [(2, 3, 1, 3, "1f1b", True), (1, 2, 2, 2, "interleaved_zb", False)]


@pytest.mark.parametrize("layout", ENGINE_LAYOUTS, ids=lambda l: f"D{l[0]}P{l[1]}V{l[2]}-{l[4]}-cache{l[5]}")
def test_tied_training_on_thread_ranks_equals_single_process_and_keeps_the_copies_equal(layout):
    """Three AdamW steps with active clipping on the in-process launcher's thread ranks: each step's
    loss and the global norm (which counts the matrix once) equal the single process's, and after
    every step the first rank's embedding and the last rank's head copy are bit-equal, and equal the
    single process's matrix."""
    from attnres_pp.train.config import RunConfig
    from attnres_pp.train.engines import make_engine
    from tests.pipeline_helpers import model_config
    from tests.whole_model import WholeModel

    D, P, V, m, schedule, cache = layout
    cfg = model_config("block", 6, n_heads=4, n_kv_heads=2, tie_embeddings=True)
    run_cfg = RunConfig.from_dict({
        "model": cfg.to_dict(),
        "train": {"steps": 3, "batch_size": MICRO * m * D, "microbatches": m, "seed": 0, "warmup_steps": 1,
                  "grad_clip": 0.05, "lr": 1e-2},
        "pipeline": {"stages": P, "virtual": V, "data_parallel": D, "schedule": schedule, "cache": cache,
                     "launcher": "inprocess", "timeout_s": 60.0}})
    engine, local = make_engine(run_cfg), WholeModel(run_cfg.model, run_cfg.train)
    try:
        for step in range(3):
            inputs, targets = batch(m * D, seed=10 + step)
            got, want = engine.train_step(step, inputs, targets, 1e-2), local.train_step(step, inputs, targets, 1e-2)
            assert abs(got.loss - want.loss) <= 1e-5 * abs(want.loss), (step, got.loss, want.loss)
            norm, want_norm = got.metrics["grad_norm"], want.metrics["grad_norm"]
            assert want_norm > 0.05 and abs(norm - want_norm) <= 1e-5 * want_norm, (step, norm, want_norm)
            copies = [w.params["embed.tok.weight"] for w in _workers_at(engine, 0)] + \
                     [w.params["head.lm_head.weight"] for w in _workers_at(engine, P - 1)]
            assert len(copies) == 2 * D and all(torch.equal(c, copies[0]) for c in copies), step
            whole = local.model.embed.tok.weight
            assert (copies[0] - whole).abs().max() <= 1e-5 * whole.abs().max(), step
    finally:
        engine.close()


# Tensor parallelism at T = 2 (thread ranks over torch's threaded process group, `MeshCollectives`):
# the embedding group pairs (d, first, t) with (d, last, t); under sequence parallelism each copy's
# gradient is first summed over tp (each tp rank embedded and scored its own tokens).
TP_TIED = [("block", "1f1b", 2, 1, 2, True, True, {"model": {"n_heads": 4, "n_kv_heads": 2, "tie_embeddings": True}}),
           ("msar", "interleaved_1f1b", 2, 2, 2, False, False, {"model": {"n_heads": 4, "tie_embeddings": True}})]


@pytest.mark.parametrize("case", TP_TIED, ids=lambda case: f"{case[0]}-{case[1]}-sp{case[6]}")
def test_tied_copies_under_tensor_parallelism_equal_the_single_process(case):
    from .test_tensor_parallel_inprocess import _run

    _run_cfg, per_rank, (want_loss, want_grads) = _run(case)
    losses = [loss for losses, *_ in per_rank for loss in losses.values()]
    assert abs(sum(losses) / len(losses) - want_loss) <= 1e-5 * abs(want_loss)
    merged: dict[str, torch.Tensor] = {}
    for _losses, grads, *_ in per_rank:
        for name, grad in grads.items():  # the tp ranks of a stage, and the two copies, hold the same gradient
            key = "embed.tok.weight" if name == "head.lm_head.weight" else name
            torch.testing.assert_close(merged.setdefault(key, grad), grad, rtol=1e-5, atol=1e-9)
    assert_grads_match(merged, want_grads, rtol=1e-5)
    assert sum("head.lm_head.weight" in grads for _losses, grads, *_ in per_rank) == 2  # the last stage's tp ranks


def test_the_embedding_group_pairs_each_replicas_first_and_last_rank_per_tp_rank():
    from attnres_pp.pipeline.mesh import RankCoords

    # D = 2, P = 3, T = 2: rank = (dp * 3 + pp) * 2 + tp
    groups = {r: RankCoords(r, 2, 3, 2).axis_members("embed") for r in range(12)}
    assert groups[0] == groups[4] == [0, 4] and groups[5] == [1, 5] and groups[6] == groups[10] == [6, 10]
    assert groups[2] == [2] and groups[9] == [9]  # a middle rank holds no copy: a group of its own
    assert RankCoords(0, 1, 1).axis_members("embed") == [0]
