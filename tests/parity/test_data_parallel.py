"""Data parallel x pipeline parallel in one process (the in-process launcher: D x P rank workers,
loopback hops, thread collectives) against the single-process model: loss and every gradient of a
step, several optimiser steps with clipping, and the pipelined evaluation; plus the pieces: bucketed
gradient averaging, rank-local data, the forward-only schedule."""

from __future__ import annotations

import pytest
import torch

from attnres_pp.data import batch_at, load_corpus
from attnres_pp.pipeline.mesh import RankCoords
from attnres_pp.schedule.forward_schedule import forward_only_schedule
from attnres_pp.schedule.ir import ActionKind
from attnres_pp.train.config import RunConfig
from attnres_pp.train.engine import Engine
from attnres_pp.train.engines import make_engine
from attnres_pp.train.grad_sync import flat_buckets, sync_gradients
from attnres_pp.train.rank_data import RankData
from tests.pipeline_helpers import MICRO, assert_grads_match, batch, model_config, shared_reference_step
from tests.reference_model import VARIANTS, randomize_depth_params
from tests.run_helpers import REPO
from tests.whole_model import WholeModel


def run_config(cfg, *, D, P, V, m, schedule="interleaved_1f1b", cache=True, **train) -> RunConfig:
    return RunConfig.from_dict({
        "model": cfg.to_dict(),
        "train": {"steps": 3, "batch_size": MICRO * m * D, "microbatches": m, "seed": 0, "warmup_steps": 1, **train},
        "pipeline": {"stages": P, "virtual": V, "data_parallel": D, "schedule": schedule, "cache": cache,
                     "launcher": "inprocess", "timeout_s": 60.0},
    })


def engine_with_random_reads(run_cfg: RunConfig) -> Engine:
    """Non-zero pseudo-queries and gates on every rank, drawn as the reference model draws them."""
    engine = make_engine(run_cfg)
    for worker in engine.ranks.workers:
        randomize_depth_params(worker.model, torch.Generator().manual_seed(1))
    return engine


def synced_grads(engine: Engine) -> dict[str, torch.Tensor]:
    """Every rank's synced gradients by name; replicas (and the tied convs everywhere) must agree."""
    grads: dict[str, torch.Tensor] = {}
    for worker in engine.ranks.workers:
        for name, p in worker.params.items():
            kept = grads.setdefault(name, p.grad)
            assert torch.equal(kept, p.grad), f"{name} differs between ranks (rank {worker.rank})"
    return grads


# (D, P, V, m, schedule): the D2 x P2 x V2, plus one chunk per replica and three replicas;
# and ZB-V (the I/W split, V placement) under D x P.
LAYOUTS = [(2, 2, 2, 2, "interleaved_1f1b"), (2, 1, 1, 2, "1f1b"), (3, 2, 1, 2, "1f1b"), (2, 2, 2, 3, "zbv")]


CASES = [(layout, cache) for layout in LAYOUTS for cache in (True, False) if cache or layout[1:3] != (1, 1)]
# What a variant brings to D x P is its parameter set (pseudo-queries, gates, projected keys, MSAR's
# convolutions tied across chunks), which the bucketed averaging must carry: every variant runs on the
# loop layout cached (fused backward) and the V layout naive (split backward), as the parity list
# crosses them; Block AttnRes and MSAR, whose block bookkeeping meets the cache, run every layout.
_ALL_LAYOUTS = ("block", "msar")
VARIANT_CASES = [(variant, layout, cache) for variant in sorted(VARIANTS) for layout, cache in CASES
                 if variant in _ALL_LAYOUTS or (layout, cache) in ((LAYOUTS[0], True), (LAYOUTS[3], False))]


def _dp_id(case) -> str:
    variant, (D, P, V, m, _), cache = case
    return f"D{D}P{P}V{V}m{m}-{'cached' if cache else 'naive'}-{variant}"


@pytest.mark.parametrize("variant,layout,cache", VARIANT_CASES, ids=[_dp_id(c) for c in VARIANT_CASES])
def test_data_parallel_step_equals_single_process(variant, layout, cache):
    D, P, V, m, schedule = layout
    cfg = model_config(variant, 4)
    engine = engine_with_random_reads(run_config(cfg, D=D, P=P, V=V, m=m, schedule=schedule, cache=cache))
    inputs, targets = batch(D * m)
    records = engine.ranks.call("backward", [(0, b) for b in engine.rank_batches(inputs, targets)])
    loss = sum(loss for r in records for loss in r.losses.values()) / (D * m)
    want_loss, want_grads = shared_reference_step(cfg, D * m)  # `batch(D * m)`'s, once per variant and D x m
    assert sum(len(r.losses) for r in records) == D * m
    assert abs(loss - want_loss) <= 1e-5 * abs(want_loss)
    assert_grads_match(synced_grads(engine), want_grads, rtol=1e-5)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_data_parallel_training_and_evaluation_equal_single_process(variant):
    """Two AdamW steps with active clipping (the global norm counts each parameter once, or the
    scale differs; the second step's loss and norm are taken on weights the first clipped update
    moved, and a third step would repeat that), then the pipelined forward-only evaluation."""
    cfg = model_config(variant, 4)
    run_cfg = run_config(cfg, D=2, P=2, V=2, m=2, grad_clip=0.05, lr=1e-2)
    engine, local = make_engine(run_cfg), WholeModel(run_cfg.model, run_cfg.train)
    for step in range(2):
        inputs, targets = batch(4, seed=10 + step)
        got, want = engine.train_step(step, inputs, targets, 1e-2), local.train_step(step, inputs, targets, 1e-2)
        assert abs(got.loss - want.loss) <= 1e-5 * abs(want.loss), (step, got.loss, want.loss)
        norm, want_norm = got.metrics["grad_norm"], want.metrics["grad_norm"]
        assert want_norm > 0.05 and abs(norm - want_norm) <= 1e-5 * want_norm, (step, norm, want_norm)
    inputs, targets = batch(4, seed=99)
    want = local.eval_loss(inputs, targets)
    assert abs(engine.eval_loss(inputs, targets) - want) <= 1e-5 * abs(want)
    assert all(p.grad is None for w in engine.ranks.workers for p in w.params.values())  # evaluation: no backward


def test_zero_bubble_training_and_evaluation_under_data_parallel_equal_single_process():
    """ZB-V at D = 2: two AdamW steps through I and W, then the forward-only evaluation in the V
    placement (its middle hop a self-hop)."""
    cfg = model_config("block", 4)
    run_cfg = run_config(cfg, D=2, P=2, V=2, m=3, schedule="zbv", grad_clip=0.05, lr=1e-2)
    engine, local = make_engine(run_cfg), WholeModel(run_cfg.model, run_cfg.train)
    for step in range(2):
        inputs, targets = batch(6, seed=10 + step)
        got, want = engine.train_step(step, inputs, targets, 1e-2), local.train_step(step, inputs, targets, 1e-2)
        assert abs(got.loss - want.loss) <= 1e-5 * abs(want.loss), (step, got.loss, want.loss)
    inputs, targets = batch(6, seed=99)
    want = local.eval_loss(inputs, targets)
    assert abs(engine.eval_loss(inputs, targets) - want) <= 1e-5 * abs(want)


def test_gradients_are_averaged_in_flat_buckets_not_per_parameter():
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (3, 4, 5, 6)]
    for i, p in enumerate(params):
        p.grad = torch.full_like(p, float(i))
    assert [len(b) for b in flat_buckets(params, bucket_bytes=6 * 4)] == [1, 1, 1, 1]
    assert [len(b) for b in flat_buckets(params, bucket_bytes=12 * 4)] == [3, 1]

    class Doubling:  # two replicas holding equal gradients
        calls: list = []

        def all_reduce(self, tensor, axis):
            self.calls.append((axis, tensor.numel()))
            tensor.mul_(2)

    tied = torch.nn.Parameter(torch.zeros(2))  # no gradient on this rank: joins the reduction as zeros
    sync_gradients(params, [tied], Doubling(), data_parallel=2)
    assert Doubling.calls == [("dp", 18), ("world", 2)]  # one call per bucket, one for the tied convs
    assert all(torch.equal(p.grad, torch.full_like(p, float(i))) for i, p in enumerate(params))
    assert torch.equal(tied.grad, torch.zeros(2))


def test_each_replica_reads_its_rows_and_middle_ranks_read_nothing():
    run_cfg = run_config(model_config("block", 4), D=2, P=3, V=1, m=2, schedule="1f1b", data="builtin")
    corpus = load_corpus("builtin")
    train = run_cfg.train
    whole = batch_at(corpus.train_tokens_N, 5, train.batch_size, run_cfg.model.seq_len, train.seed)
    got_inputs, got_targets = [], []
    for dp_rank in range(2):
        first = RankData(run_cfg, dp_rank, needs_inputs=True, needs_targets=False, corpus=corpus)
        last = RankData(run_cfg, dp_rank, needs_inputs=False, needs_targets=True, corpus=corpus)
        inputs_by_mb, none = first.train_microbatches(5)
        assert none is None and len(inputs_by_mb) == 2 and inputs_by_mb[0].shape == (MICRO, run_cfg.model.seq_len)
        got_inputs += inputs_by_mb
        got_targets += last.train_microbatches(5)[1]
        middle = RankData(run_cfg, dp_rank, needs_inputs=False, needs_targets=False, data_path="/nonexistent.txt")
        assert middle.train_microbatches(5) == (None, None) and middle.val_microbatches(0) == (None, None)
    assert torch.equal(torch.cat(got_inputs), whole[0]) and torch.equal(torch.cat(got_targets), whole[1])


@pytest.mark.parametrize("P,V,placement", [(2, 2, "loop"), (3, 1, "loop"), (2, 2, "vshape"), (1, 3, "loop")])
def test_forward_only_schedule_has_forwards_and_their_hops_only(P, V, placement):
    schedule = forward_only_schedule(P, V, 3, placement)
    kinds = {a.kind for actions in schedule.rank_actions for a in actions}
    assert kinds <= {ActionKind.F, ActionKind.SEND_F, ActionKind.RECV_F}
    forwards = sorted((a.chunk_index, a.microbatch_index) for actions in schedule.rank_actions
                      for a in actions if a.kind is ActionKind.F)
    assert forwards == [(c, mb) for c in range(P * V) for mb in range(3)]


def test_rank_coords_lay_out_the_mesh_row_major():
    coords = RankCoords(5, data_parallel=2, stages=3)
    assert (coords.dp_rank, coords.pp_rank) == (1, 2)
    assert coords.axis_members("dp") == [2, 5] and coords.axis_members("pp") == [3, 4, 5]
    with pytest.raises(ValueError, match="outside 0..5"):
        RankCoords(6, data_parallel=2, stages=3)


def test_batch_must_split_over_replicas_and_microbatches():
    with pytest.raises(ValueError, match="multiple of 6"):
        run_config(model_config("block", 4), D=3, P=1, V=1, m=2, batch_size=8)


def test_rank_local_evaluation_equals_the_single_process_val_loss(tmp_path):
    """`evaluate()`: each end rank reads its replica's rows of the run's validation batches itself and
    the forward-only pipeline runs on the training ranks; no batch passes through the driver."""
    data = tmp_path / "corpus.txt"
    sources = sorted((REPO / "attnres_pp" / "train").glob("*.py"))
    data.write_text("".join(p.read_text() for p in sources))
    cfg = model_config("msar", 4, vocab_size=256)
    run_cfg = run_config(cfg, D=2, P=2, V=2, m=2, data=str(data), eval_batches=3)
    corpus = load_corpus(str(data))
    want = WholeModel(run_cfg.model, run_cfg.train, corpus=corpus).evaluate()
    got = make_engine(run_cfg, corpus=corpus).evaluate()
    assert abs(got - want) <= 1e-5 * abs(want)
