"""Pipelined steps over the in-process loopback transport against the single-process model:
loss and every parameter gradient, for every variant x schedule x (P, V, m), cached and naive."""

from __future__ import annotations

import pytest
import torch

from attnres_pp.comm.cache import BlockCache, CacheError
from attnres_pp.comm.partition import make_partition
from attnres_pp.comm.plan import Source, plan_for_model, plan_payloads
from attnres_pp.comm.transport import ByteLedger
from attnres_pp.pipeline.chunk import build_rank_chunks
from attnres_pp.pipeline.passes import insert_comm
from attnres_pp.pipeline.schedules import build_schedule
from attnres_pp.pipeline.validate import validate
from attnres_pp.pipeline.loopback import make_loopback_runtimes, run_loopback_step
from attnres_pp.train.step_stats import fwd_hop_tensors
from tests.pipeline_helpers import MICRO, SEQ, assert_grads_match, batch, build_model, model_config, reference_step
from tests.reference_model import VARIANTS

# (schedule, P, V, m, n_layers, block-size override): P = 3, uneven splits, and blocks whose edges
# fall inside chunks (block_size 3 with 2 sublayers per layer) are all covered.
LAYOUTS = [
    ("interleaved_1f1b", 2, 2, 4, 4, None),
    ("interleaved_1f1b", 3, 2, 3, 6, 5),
    ("1f1b", 3, 1, 4, 5, None),
    ("gpipe", 2, 2, 3, 5, 3),
]


def pipelined_step(cfg, schedule_name, P, V, m, cache, dtype=torch.float32, ledger=None):
    model = build_model(cfg, dtype)
    partition = make_partition(cfg.n_layers, P, V)
    rank_chunks = [build_rank_chunks(model, partition, r) for r in range(P)]
    schedule = insert_comm(build_schedule(schedule_name, P, V, m))
    validate(schedule)
    runtimes = make_loopback_runtimes(cfg, rank_chunks, plan_for_model(cfg, partition, cache), schedule,
                                      (MICRO, SEQ), ledger)
    inputs, targets = batch(m)
    records = run_loopback_step(runtimes, list(inputs.chunk(m)), list(targets.chunk(m)), 1.0 / m)
    losses = {mb: loss for r in records for mb, loss in r.losses.items()}
    assert sorted(losses) == list(range(m))
    return sum(losses.values()) / m, {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: f"{x[0]}-P{x[1]}V{x[2]}m{x[3]}")
@pytest.mark.parametrize("cache", [True, False], ids=["cached", "naive"])
def test_pipelined_step_equals_single_process_fp32(variant, layout, cache):
    schedule_name, P, V, m, n_layers, block_size = layout
    overrides = {} if block_size is None or variant in ("standard", "full") else {"block_size": block_size}
    cfg = model_config(variant, n_layers, **overrides)
    loss, grads = pipelined_step(cfg, schedule_name, P, V, m, cache)
    want_loss, want_grads = reference_step(cfg, *batch(m), m)
    assert abs(loss - want_loss) <= 1e-5 * abs(want_loss)
    assert_grads_match(grads, want_grads, rtol=1e-5)


@pytest.mark.parametrize("variant", ["block", "lr_projected", "msar"])
def test_pipelined_step_equals_single_process_float64(variant):
    cfg = model_config(variant, 6, block_size=5)
    loss, grads = pipelined_step(cfg, "interleaved_1f1b", 3, 2, 3, True, dtype=torch.float64)
    want_loss, want_grads = reference_step(cfg, *batch(3), 3, dtype=torch.float64)
    assert abs(loss - want_loss) <= 1e-12
    assert_grads_match(grads, want_grads, rtol=1e-10)


GOLDEN = [  # SPEC section 4.1: (L, S, P, V, naive per hop, cached per hop)
    (16, 4, 4, 2, [2, 2, 3, 3, 4, 4, 5], [2, 2, 3, 2, 2, 2, 2]),
    (16, 2, 4, 2, [2, 3, 4, 5, 6, 7, 8], [2, 3, 4, 3, 3, 3, 3]),
    (32, 4, 4, 4, [2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7, 8, 8, 9], [2, 2, 3] + [2] * 12),
    (16, 1, 4, 2, [3, 5, 7, 9, 11, 13, 15], [3, 5, 7, 6, 6, 6, 6]),
    (16, 16, 4, 2, [2] * 7, [2, 2, 2, 1, 1, 1, 1]),
]


@pytest.mark.parametrize("row", GOLDEN, ids=lambda r: f"L{r[0]}S{r[1]}P{r[2]}V{r[3]}")
def test_measured_hop_counts_equal_spec_table_and_plan(row):
    L, S, P, V, naive, cached = row
    for cache, want in ((False, naive), (True, cached)):
        cfg = model_config("block", L // 2, block_size=S, d_model=8)
        ledger = ByteLedger()
        pipelined_step(cfg, "interleaved_1f1b", P, V, P, cache, ledger=ledger)
        measured = fwd_hop_tensors(ledger.records, P * V)
        planned = plan_payloads(n_sublayers=L, block_size=S, partition=make_partition(L // 2, P, V),
                                mode="cached" if cache else "naive").fwd_hop_tensors
        assert measured == planned == want
        # Bytes: every tensor is [microbatch tokens, d] fp32, both directions alike.
        fwd = sum(r[4] for r in ledger.records if r[0] == "fwd")
        assert fwd == sum(want) * P * MICRO * SEQ * 8 * 4
        assert sum(r[4] for r in ledger.records if r[0] == "bwd") == fwd


def test_projected_keys_travel_with_their_sources():
    cfg = model_config("lr_projected", 4)
    ledger = ByteLedger()
    pipelined_step(cfg, "interleaved_1f1b", 2, 2, 2, True, ledger=ledger)
    tensors = sum(r[3] for r in ledger.records if r[0] == "fwd")
    fwd = sum(r[4] for r in ledger.records if r[0] == "fwd")
    assert fwd == tensors * MICRO * SEQ * (cfg.d_model + cfg.key_rank) * 4


def test_leftover_deposit_raises():
    cache = BlockCache()
    cache.deposit(0, Source("block", 1), torch.ones(2))
    with pytest.raises(CacheError, match="never collected"):
        cache.check_drained(0)
    cache.check_drained(1)  # other microbatches are unaffected


def test_cache_read_is_a_fresh_leaf_sharing_storage():
    cache = BlockCache()
    value = torch.randn(3, requires_grad=True) * 2
    cache.put(0, Source("block", 0), value)
    a, b = cache.read(0, Source("block", 0)), cache.read(0, Source("block", 0))
    assert a.is_leaf and a.requires_grad and a is not b
    assert a.data_ptr() == value.data_ptr()
    with pytest.raises(CacheError, match="cache miss"):
        cache.read(1, Source("block", 0))
