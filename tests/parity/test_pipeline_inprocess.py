"""What pipelined steps over the in-process loopback transport carry: the wire hops of any placement
against docs/spec.md section 4's rule and its golden table, the V placement's self-hop, projected
keys beside their sources, and the block cache's own contract; a hand-built GPipe order on the V
placement against the single-process model. The parity of every schedule and variant is
tests/parity/test_parity.py's curated case list."""

from __future__ import annotations

import pytest
import torch

from attnres_pp.comm.cache import BlockCache, CacheError
from attnres_pp.comm.partition import make_partition
from attnres_pp.comm.plan import Source, plan_for_model, plan_payloads
from attnres_pp.comm.transport import ByteLedger
from attnres_pp.pipeline.chunk import build_rank_chunks
from attnres_pp.pipeline.loopback import make_loopback_runtimes, run_loopback_step
from attnres_pp.schedule.passes import insert_comm
from attnres_pp.schedule.validate import validate
from attnres_pp.train.step_stats import fwd_hop_tensors
from tests.pipeline_helpers import (
    MICRO,
    SEQ,
    assert_grads_match,
    batch,
    build_model,
    loopback_step,
    model_config,
    reference_step,
)
from tests.reference_model import VARIANTS


def _spec_rule_hops(n_layers: int, block_size: int, partition) -> list[list[str]]:
    """docs/spec.md section 4's cached rule restated on its own: hop c -> c+1 sends the open partial plus the
    completed blocks its receiving rank does not hold (what it made or received earlier); a hop
    between two chunks of one rank sends nothing over the wire."""
    held: dict[int, set[int]] = {}
    hops = []
    for c in range(partition.n_chunks - 1):
        rank, receiver = partition.rank_of(c), partition.rank_of(c + 1)
        done = 2 * sum(partition.layers_per_chunk[: c + 1])
        completed = set(range(done // block_size + 1))  # b_0 .. b_n
        held.setdefault(rank, set()).update(completed)
        if rank == receiver:
            hops.append([])
            continue
        partial = [f"p{done // block_size + 1}"] if done % block_size else []
        hops.append([f"b{j}" for j in sorted(completed - held.get(receiver, set()))] + partial)
        held.setdefault(receiver, set()).update(completed)
    return hops


@pytest.mark.parametrize("P,V,placement", [(1, 3, "loop"), (3, 2, "vshape"), (4, 2, "vshape"), (2, 3, "loop")])
@pytest.mark.parametrize("block_size", [1, 2, 3])
def test_wire_hops_follow_the_spec_rule_for_any_placement(P, V, placement, block_size):
    """The planner's wire hops equal the rule restated above, self-hops (P = 1; ZB-V's middle hop)
    count zero, and naive and standard self-hops still hand their tensors over in memory."""
    n_layers = P * V
    partition = make_partition(n_layers, P, V, placement=placement)
    cached = plan_payloads(n_sublayers=2 * n_layers, block_size=block_size, partition=partition, mode="cached")
    assert [[str(s) for s in hop] for hop in cached.wire_hops] == _spec_rule_hops(n_layers, block_size, partition)
    assert cached.fwd_hop_tensors == [len(hop) for hop in cached.wire_hops]
    self_hops = [c for c in range(P * V - 1) if partition.is_self_hop(c)]
    assert self_hops == ([P - 1] if placement == "vshape" else list(range(P * V - 1)) if P == 1 else [])
    for mode in ("naive", "standard"):
        plan = plan_payloads(n_sublayers=2 * n_layers, block_size=block_size, partition=partition, mode=mode)
        assert all(plan.fwd_hop_tensors[c] == 0 and len(plan.hops[c]) > 0 for c in self_hops)


def _vshape_gpipe(P: int, m: int):
    """A GPipe order under V-shape placement (chunk c on rank c, then 2P - 1 - c): each rank runs
    all forwards of its chunks in visit order, then all backwards in reverse."""
    from attnres_pp.schedule.ir import B, F, Schedule

    rank_actions = []
    for rank in range(P):
        chunks = [rank, 2 * P - 1 - rank]
        actions = [F(c, mb) for c in chunks for mb in range(m)]
        actions += [B(c, mb) for c in reversed(chunks) for mb in range(m)]
        rank_actions.append(tuple(actions))
    return Schedule(name="gpipe_vshape", n_stages=P, n_virtual=2, n_microbatches=m,
                    rank_actions=tuple(rank_actions), placement="vshape")


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("cache", [True, False], ids=["cached", "naive"])
def test_vshape_placement_runs_with_single_process_parity(variant, cache):
    """The runtime with a placement other than loop: the middle hop is a self-hop (in memory), the
    cache serves what each rank holds, and loss and gradients equal the single process."""
    P, m, n_layers = 2, 2, 4
    cfg = model_config(variant, n_layers)
    model = build_model(cfg)
    partition = make_partition(n_layers, P, 2, placement="vshape")
    schedule = insert_comm(_vshape_gpipe(P, m))
    validate(schedule)
    ledger = ByteLedger()
    plan = plan_for_model(cfg, partition, cache)
    runtimes = make_loopback_runtimes(cfg, [build_rank_chunks(model, partition, r) for r in range(P)], plan,
                                      schedule, (MICRO, SEQ), ledger)
    inputs, targets = batch(m)
    records = run_loopback_step(runtimes, list(inputs.chunk(m)), list(targets.chunk(m)), 1.0 / m)
    loss = sum(loss for r in records for loss in r.losses.values()) / m
    want_loss, want_grads = reference_step(cfg, inputs, targets, m)
    assert abs(loss - want_loss) <= 1e-5 * abs(want_loss)
    assert_grads_match({n: p.grad for n, p in model.named_parameters()}, want_grads, rtol=1e-5)
    measured = fwd_hop_tensors(ledger.records, 2 * P)
    assert measured == plan.fwd_hop_tensors and measured[P - 1] == 0


@pytest.mark.parametrize("schedule_name", ["zbv", "dualpipev"])
@pytest.mark.parametrize("P", [2, 3])
@pytest.mark.parametrize("block_size", [1, 2, 3])
def test_v_placement_hop_counts_follow_the_spec_rule(schedule_name, P, block_size):
    """ZB-V and DualPipeV: the transport counts, per forward hop, what the docs/spec.md section 4 rule
    says for the V placement (the middle hop, between the two chunks of rank P - 1, moves nothing
    over the wire); each at its fewest microbatches."""
    n_layers = 2 * P
    cfg = model_config("block", n_layers, block_size=block_size)
    ledger = ByteLedger()
    m = 2 * P - 1 if schedule_name == "zbv" else 2 * P
    loopback_step(cfg, schedule_name, P, 2, m, True, ledger=ledger)
    partition = make_partition(n_layers, P, 2, placement="vshape")
    want = [len(hop) for hop in _spec_rule_hops(n_layers, block_size, partition)]
    assert fwd_hop_tensors(ledger.records, 2 * P) == plan_for_model(cfg, partition, True).fwd_hop_tensors == want
    assert want[P - 1] == 0 and sum(want) > 0


GOLDEN = [  # docs/spec.md section 4.1: (L, S, P, V, naive per hop, cached per hop)
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
        loopback_step(cfg, "interleaved_1f1b", P, V, P, cache, ledger=ledger)
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
    loopback_step(cfg, "interleaved_1f1b", 2, 2, 2, True, ledger=ledger)
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
