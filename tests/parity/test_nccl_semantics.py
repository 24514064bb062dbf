"""NCCL's point-to-point rules (docs/spec.md section 5): the model (FIFO matching per rank pair that raises
on a mismatched message or size, rendezvous sends, one execution order per rank), the validator's
proof that every schedule generator runs deadlock-free under them in the runtime's issue order,
readable reports for crossed orders, and pipelined steps over the NCCL-semantics loopback that
equal the single-process model for every generator in SCHEDULES x P x V (`RUNTIME_GRID`: the most
microbatches at each, the fewest too at P = 2)."""

from __future__ import annotations

import copy

import pytest
import torch

from attnres_pp.comm.partition import make_partition
from attnres_pp.comm.plan import plan_for_model
from attnres_pp.pipeline.chunk import build_rank_chunks
from attnres_pp.pipeline.loopback import make_loopback_runtimes, run_loopback_step
from attnres_pp.pipeline.loopback_nccl import NcclLoopbackTransport
from attnres_pp.schedule.passes import insert_comm
from attnres_pp.schedule.schedules import SCHEDULES, build_schedule, schedule_placement
from attnres_pp.schedule.validate import validate
from attnres_pp.schedule.validate_nccl import (
    NcclDeadlock,
    NcclP2P,
    Op,
    P2PMismatch,
    check_nccl,
    lockstep_plan,
    naive_plan,
)
from attnres_pp.train.config import RunConfig
from tests.pipeline_helpers import (
    MICRO,
    SEQ,
    assert_grads_match,
    batch,
    build_model,
    model_config,
    reference_step,
    shared_reference_step,
)


def _grid():
    """(schedule, P, V, m) for every generator, P in 2..4, V in 1..3, m in {1, P, 2P + 1}, where valid;
    dualpipev, which needs m >= 2P, at 2P and 3P too."""
    cases = []
    for name in SCHEDULES:
        for n_stages in (2, 3, 4):
            for n_virtual in (1, 2, 3):
                extra = {2 * n_stages, 3 * n_stages} if name == "dualpipev" else set()
                for m in sorted({1, n_stages, 2 * n_stages + 1} | extra):
                    try:
                        build_schedule(name, n_stages, n_virtual, m)
                    except ValueError:
                        continue
                    cases.append((name, n_stages, n_virtual, m))
    return cases


GRID = _grid()


def _runtime_grid():
    """The pipelined steps' share of GRID: every generator at every P and V with its most
    microbatches (warm-up, steady state and cool-down all present), and at P = 2 and every V with its
    fewest too. The rest of GRID differs from these only in m, i.e. in the order `lockstep_plan` issues (proved
    deadlock-free and FIFO-matched for every GRID point by the validator test below); the runtime
    walks that plan with one code path whatever m is."""
    most: dict = {}
    for name, n_stages, n_virtual, m in GRID:
        most[name, n_stages, n_virtual] = max(m, most.get((name, n_stages, n_virtual), 0))
    fewest: dict = {}
    for name, n_stages, n_virtual, m in GRID:
        if n_stages == 2:
            fewest[name, n_virtual] = min(m, fewest.get((name, n_virtual), m))
    return list(dict.fromkeys([*((*key, m) for key, m in most.items()),
                                *((name, 2, n_virtual, m) for (name, n_virtual), m in fewest.items())]))


RUNTIME_GRID = _runtime_grid()


def test_the_grid_covers_every_generator_and_shape():
    assert {name for name, *_ in GRID} == set(SCHEDULES)
    assert {p for _, p, _, _ in GRID} == {2, 3, 4} and {v for _, _, v, _ in GRID} == {1, 2, 3}
    assert len(GRID) >= 40
    assert {case[:3] for case in RUNTIME_GRID} == {case[:3] for case in GRID} and set(RUNTIME_GRID) <= set(GRID)


# ---- the model ----


def test_a_send_completes_only_when_its_receive_is_posted():
    fabric = NcclP2P(2)
    send = fabric.post(0, [Op(0, 1, True, "a", size=4)])
    assert not send.complete  # no receive yet: rendezvous, not buffered
    recv = fabric.post(1, [Op(1, 0, False, "a", size=4)])
    assert send.complete and recv.complete


def test_a_rank_runs_its_groups_in_issue_order():
    fabric = NcclP2P(3)
    first = fabric.post(0, [Op(0, 1, True, "to 1")])
    second = fabric.post(0, [Op(0, 2, True, "to 2")])
    fabric.post(2, [Op(2, 0, False, "to 2")])
    assert not second.complete  # posted on rank 2, but queued behind rank 0's first group
    fabric.post(1, [Op(1, 0, False, "to 1")])
    assert first.complete and second.complete


def test_crossing_sends_deadlock_alone_and_complete_in_one_group():
    alone = NcclP2P(2)
    for rank in (0, 1):
        alone.post(rank, [Op(rank, 1 - rank, True, f"from {rank}")])
        alone.post(rank, [Op(rank, 1 - rank, False, f"from {1 - rank}")])
    assert not any(g.complete for groups in alone.groups for g in groups)
    grouped = NcclP2P(2)
    for rank in (0, 1):
        grouped.post(rank, [Op(rank, 1 - rank, True, f"from {rank}"), Op(rank, 1 - rank, False, f"from {1 - rank}")])
    assert all(g.complete for groups in grouped.groups for g in groups)


@pytest.mark.parametrize("recv_label,recv_size,what", [("b", 8, "RB0.0"), ("a", 6, "(8 vs 6 elements)")])
def test_fifo_matching_raises_on_another_message_or_size(recv_label, recv_size, what):
    fabric = NcclP2P(2)
    fabric.post(0, [Op(0, 1, True, "a", size=8, name="SF0.0")])
    with pytest.raises(P2PMismatch, match="in issue order and ignores tags") as info:
        fabric.post(1, [Op(1, 0, False, recv_label, size=recv_size, name="RB0.0")])
    assert "rank 0's 1st send to rank 1, SF0.0, with rank 1's 1st receive from rank 0" in str(info.value)
    assert what in str(info.value)


def test_loopback_transport_pairs_by_issue_order_not_tag():
    fabric = NcclP2P(2)
    sender, receiver = NcclLoopbackTransport(0, fabric), NcclLoopbackTransport(1, fabric)
    sender.send([torch.ones(2, 3)], 1, tag=7, label=("fwd", 0, 0))
    sender.send([torch.ones(2, 3)], 1, tag=9, label=("fwd", 0, 1))
    with pytest.raises(P2PMismatch, match="tag 7"):
        receiver.prepost_recv([torch.Size((2, 3))], torch.float32, 0, tag=9)  # the 1st receive meets tag 7
    fabric = NcclP2P(2)
    sender, receiver = NcclLoopbackTransport(0, fabric), NcclLoopbackTransport(1, fabric)
    sender.send([torch.arange(6.0).view(2, 3)], 1, tag=7, label=("fwd", 0, 0))
    assert not receiver.ready(0, 7)
    receiver.prepost_recv([torch.Size((2, 3))], torch.float32, 0, tag=7)
    assert receiver.ready(0, 7)
    assert torch.equal(receiver.recv([torch.Size((2, 3))], torch.float32, 0, 7)[0], torch.arange(6.0).view(2, 3))


# ---- the validator ----


@pytest.mark.parametrize("case", GRID, ids=lambda c: f"{c[0]}-P{c[1]}V{c[2]}m{c[3]}")
def test_every_schedule_is_deadlock_free_in_the_runtime_nccl_order(case):
    schedule = insert_comm(build_schedule(*case))
    validate(schedule, p2p_semantics="nccl")
    check_nccl(schedule, lockstep_plan(schedule))


def test_the_crossed_1f1b_order_deadlocks_with_the_blocked_pairs():
    """Each send alone where it stands (isend at SF, irecv at RF), as a tag-matching runtime would
    issue them: 1F1B's steady state crosses a forward and a backward send between two ranks."""
    schedule = insert_comm(build_schedule("1f1b", 2, 1, 4))
    with pytest.raises(NcclDeadlock) as info:
        check_nccl(schedule, naive_plan(schedule))
    report = str(info.value)
    assert "'1f1b' (P=2, V=1, m=4) deadlocks under NCCL point-to-point semantics" in report
    assert "blocked pairs (sender -> receiver): 0 -> 1, 1 -> 0" in report
    assert "rank 0 waits at RB0.0" in report and "rank 1 waits at RF1.1" in report
    assert "SB1.0 (-> rank 0) is matched by rank 0's RB0.0" in report
    assert "queued behind rank 0's incomplete group [SF0.1]" in report


def test_receives_posted_out_of_order_are_a_mismatch():
    schedule = insert_comm(build_schedule("gpipe", 2, 1, 3))
    plan = copy.deepcopy(lockstep_plan(schedule))
    positions = [(i, j) for i, groups in enumerate(plan[1]) for j, g in enumerate(groups)
                 if any(a.is_recv and str(a).startswith("RF") for a in g)]
    (i1, j1), (i2, j2) = positions[0], positions[1]
    plan[1][i1][j1], plan[1][i2][j2] = plan[1][i2][j2], plan[1][i1][j1]
    with pytest.raises(P2PMismatch, match="rank 0's 1st send to rank 1, SF0.0, with rank 1's 1st receive"):
        check_nccl(schedule, plan)


# ---- pipelined steps under NCCL rules equal the single process ----


@pytest.mark.parametrize("case", RUNTIME_GRID, ids=lambda c: f"{c[0]}-P{c[1]}V{c[2]}m{c[3]}")
def test_pipelined_step_under_nccl_semantics_equals_single_process(case):
    name, n_stages, n_virtual, m = case
    cfg = model_config("block", n_stages * n_virtual)
    model = build_model(cfg)
    partition = make_partition(cfg.n_layers, n_stages, n_virtual, placement=schedule_placement(name))
    schedule = insert_comm(build_schedule(name, n_stages, n_virtual, m))
    runtimes = make_loopback_runtimes(cfg, [build_rank_chunks(model, partition, r) for r in range(n_stages)],
                                      plan_for_model(cfg, partition, True), schedule, (MICRO, SEQ),
                                      p2p_semantics="nccl")
    assert all(isinstance(r.transport, NcclLoopbackTransport) for r in runtimes)
    inputs, targets = batch(m)
    records = run_loopback_step(runtimes, list(inputs.chunk(m)), list(targets.chunk(m)), 1.0 / m)
    losses = {mb: loss for r in records for mb, loss in r.losses.items()}
    want_loss, want_grads = shared_reference_step(cfg, m)  # one per (P x V layers, m), over the schedules
    assert abs(sum(losses.values()) / m - want_loss) <= 1e-5 * abs(want_loss)
    assert_grads_match({n: p.grad for n, p in model.named_parameters()}, want_grads, rtol=1e-5)
    assert not any(runtimes[0].transport.fabric.groups)  # every rank flushed with every group complete


def test_the_loopback_enforces_the_rules_on_a_crossed_runtime_order(monkeypatch):
    """The same step with every send and receive issued alone where it stands cannot finish."""
    from attnres_pp.pipeline import executor

    monkeypatch.setattr(executor, "lockstep_plan", naive_plan)
    cfg = model_config("block", 2)
    model = build_model(cfg)
    partition = make_partition(cfg.n_layers, 2, 1)
    schedule = insert_comm(build_schedule("1f1b", 2, 1, 4))
    runtimes = make_loopback_runtimes(cfg, [build_rank_chunks(model, partition, r) for r in range(2)],
                                      plan_for_model(cfg, partition, True), schedule, (MICRO, SEQ),
                                      p2p_semantics="nccl")
    inputs, targets = batch(4)
    with pytest.raises(RuntimeError, match="loopback pipeline is stuck"):
        run_loopback_step(runtimes, list(inputs.chunk(4)), list(targets.chunk(4)), 0.25)


@pytest.mark.distributed
def test_batched_transport_runs_the_nccl_order_over_gloo(tmp_path):
    """The GPU path's transport (batch_isend_irecv groups in the validated order, receives waited
    when needed), run by two spawned ranks over gloo: same losses and gradients as one process."""
    from ..distributed.test_pipeline_distributed import run_dict, run_group

    cfg = model_config("block", 4)
    runs = []
    for name, n_virtual, m in (("1f1b", 1, 4), ("interleaved_1f1b", 2, 4)):
        run = run_dict(cfg, name, 2, n_virtual, m)
        run["pipeline"]["p2p_semantics"] = "nccl"
        runs.append((run, m))
    out = run_group(2, [run for run, _ in runs], tmp_path)
    for index, (_run, m) in enumerate(runs):
        want_loss, want_grads = reference_step(cfg, *batch(m), m)
        losses = out[index]["losses"]
        assert len(losses) == m
        assert abs(sum(losses) / m - want_loss) <= 1e-5 * abs(want_loss)
        assert_grads_match(out[index]["grads"], want_grads, rtol=1e-5)


@pytest.mark.distributed
def test_batched_transport_runs_the_nccl_order_in_a_data_parallel_mesh(tmp_path):
    """D = 2 replicas of a P = 2 pipeline in four processes over gloo, under NCCL's issue order: the
    batched groups address each replica's peers by global rank, and the replicas' averaged
    gradients equal the single process's on the whole batch."""
    from ..distributed.test_pipeline_distributed import run_dict, run_group

    cfg = model_config("block", 4)
    D, m = 2, 2
    run = run_dict(cfg, "interleaved_1f1b", 2, 2, m, D=D)
    run["pipeline"]["p2p_semantics"] = "nccl"
    out = run_group(D * 2, [run], tmp_path)
    want_loss, want_grads = reference_step(cfg, *batch(D * m), D * m)
    losses = out[0]["losses"]
    assert len(losses) == D * m
    assert abs(sum(losses) / (D * m) - want_loss) <= 1e-5 * abs(want_loss)
    assert_grads_match(out[0]["grads"], want_grads, rtol=1e-5)


@pytest.mark.parametrize("variant", ["block", "msar"])
def test_data_parallel_training_and_evaluation_under_nccl_semantics_equal_single_process(variant):
    """`--launcher inprocess --p2p-semantics nccl` at D = 2, P = 2, V = 2: every replica's loopback
    enforces NCCL's rules on the training steps and on the forward-only evaluation, and both equal
    the single process (loss, clipped norm, val loss)."""
    from attnres_pp.train.engines import make_engine
    from tests.whole_model import WholeModel

    from .test_data_parallel import run_config

    run_cfg = run_config(model_config(variant, 4), D=2, P=2, V=2, m=2, grad_clip=0.05, lr=1e-2)
    run_cfg = RunConfig.from_dict({**run_cfg.to_dict(),
                                   "pipeline": {**run_cfg.pipeline.to_dict(), "p2p_semantics": "nccl"}})
    engine, local = make_engine(run_cfg), WholeModel(run_cfg.model, run_cfg.train)
    assert all(isinstance(w.runtime.transport, NcclLoopbackTransport) for w in engine.ranks.workers)
    assert len({id(w.runtime.transport.fabric) for w in engine.ranks.workers}) == 2  # one per replica
    for step in range(2):
        inputs, targets = batch(4, seed=10 + step)
        got, want = engine.train_step(step, inputs, targets, 1e-2), local.train_step(step, inputs, targets, 1e-2)
        assert abs(got.loss - want.loss) <= 1e-5 * abs(want.loss), (step, got.loss, want.loss)
        assert abs(got.metrics["grad_norm"] - want.metrics["grad_norm"]) <= 1e-5 * want.metrics["grad_norm"]
    inputs, targets = batch(4, seed=99)
    want = local.eval_loss(inputs, targets)
    assert abs(engine.eval_loss(inputs, targets) - want) <= 1e-5 * abs(want)
    assert not any(g for w in engine.ranks.workers for g in w.runtime.transport.fabric.groups)  # all flushed
