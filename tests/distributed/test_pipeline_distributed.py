"""Multi-process pipelines over gloo (file-based rendezvous in a temp dir) against the
single-process model: loss and every gradient; measured hop counts; a lost rank's bounded failure."""

from __future__ import annotations

import dataclasses
import time
import traceback

import pytest
import torch

from attnres_pp.launch.process_rank_group import rank_context
from attnres_pp.pipeline.errors import WorkerLost
from attnres_pp.train.config import RunConfig
from attnres_pp.train.engines import make_engine
from tests.pipeline_helpers import MICRO, assert_grads_match, batch, model_config, reference_step
from tests.reference_model import VARIANTS
from tests.spawn_helpers import start_ranks
from tests.whole_model import WholeModel

pytestmark = pytest.mark.distributed


def run_dict(cfg, schedule, P, V, m, cache=True, D=1, **train):
    return RunConfig.from_dict({
        "model": cfg.to_dict(),
        "train": {"steps": 2, "batch_size": MICRO * m * D, "microbatches": m, "seed": 0, "warmup_steps": 1, **train},
        "pipeline": {"stages": P, "virtual": V, "schedule": schedule, "cache": cache, "launcher": "local",
                     "timeout_s": 60.0, "data_parallel": D},
    }).to_dict()


def _rank_main(rank, world_size, init_method, run_dicts, results, env=None):
    """One rank: join the group once, then run one forward/backward and gradient sync per configuration."""
    import os

    from attnres_pp.pipeline.stage_setup import init_process_group
    from attnres_pp.train.stage_worker import StageWorker
    from tests.reference_model import randomize_depth_params

    try:
        os.environ.update(env or {})
        torch.set_num_threads(1)
        _backend, device = init_process_group(init_method, rank, world_size, 60.0)
        for index, run_cfg in enumerate(run_dicts):
            worker = StageWorker(run_cfg, rank)
            # The same draws as the reference model's: parameters on the meta device consume them too.
            randomize_depth_params(worker.model, torch.Generator().manual_seed(1))
            worker.connect(device)
            D, m = run_cfg["pipeline"]["data_parallel"], run_cfg["train"]["microbatches"]
            inputs, targets = batch(D * m)
            rows = slice(worker.dp_rank * MICRO * m, (worker.dp_rank + 1) * MICRO * m)
            worker.begin_step(0, (inputs[rows], targets[rows]))
            record = worker.run_step(0)
            worker.sync_gradients()
            # numpy, not tensors: a tensor in a Queue lives in this process's shared memory, gone at exit
            grads = {n: p.grad.numpy().copy() for n, p in worker.params.items() if p.grad is not None}
            transport = worker.runtime.transport
            results.put((index, rank, record.losses, grads, list(transport.ledger.records),
                         type(getattr(transport, "inner", transport)).__name__))  # what a per-pair transport uses
            getattr(transport, "close", lambda: None)()  # its pipes; the group stays
    except Exception:
        results.put(("error", rank, traceback.format_exc(), None, None, None))


def run_group(world_size, run_dicts, tmp_path, timeout_s=240, env=None):
    results = rank_context(__name__).Queue()
    init_method = f"file://{tmp_path}/rendezvous"
    procs = start_ranks(_rank_main, [(r, world_size, init_method, run_dicts, results, env) for r in range(world_size)])
    out = {}
    try:
        for _ in range(world_size * len(run_dicts)):
            index, rank, losses, grads, ledger, transport = results.get(timeout=timeout_s)
            assert index != "error", f"rank {rank} failed:\n{losses}"
            entry = out.setdefault(index, {"losses": [], "grads": {}, "ledger": [], "transports": set()})
            entry["losses"] += list(losses.values())
            entry["transports"].add(transport)
            if rank < world_size // run_dicts[index]["pipeline"]["data_parallel"]:
                entry["ledger"].extend(ledger)  # replica 0's hops
            for name, grad in grads.items():
                # Replicas, and the tied convs on every rank, must hold the very same synced gradient.
                kept = entry["grads"].setdefault(name, torch.from_numpy(grad))
                assert torch.equal(kept, torch.from_numpy(grad)), f"{name} differs between ranks"
    finally:
        for proc in procs:
            proc.join(timeout=20)
            if proc.is_alive():
                proc.terminate()
    return out


# (variant, schedule, P, V, m, cache, block size): block size 3 puts block edges inside chunks (each
# chunk holds an even number of sublayers); P = 1 uses 2, so blocks close exactly at chunk edges and
# its self-hops (handed over in memory) carry nothing at all under the cache.
# Curated as the in-process parity list is (docs/testing.md): what rank processes add to the loopback
# is the transport (shared-memory slots, gloo payloads, each variant's hop tensors) and each rank
# materialising its own chunks, so every variant runs on each kind of layout (P = 1, 2, 3; the
# loop and the V placement; cached and naive), and the schedules' orders cross the two variants whose
# block bookkeeping meets the cache (Block AttnRes; MSAR, whose streams read every block and whose
# tied convolutions sit on every rank).
EDGE = ("block", "msar")
CASES_P1 = ([(v, "interleaved_1f1b", 1, 2, 2, True, 2) for v in sorted(VARIANTS)]
            + [(v, "interleaved_1f1b", 1, V, 2, False, 2) for v in EDGE for V in (3, 4)])
CASES_P2 = ([(v, "interleaved_1f1b", 2, 2, 4, cache, 3) for v in sorted(VARIANTS) for cache in (True, False)]
            + [(v, s, 2, V, m, True, 3) for v in EDGE for s, V, m in (("1f1b", 1, 3), ("gpipe", 2, 2))])
CASES_P3 = ([(v, "interleaved_1f1b", 3, 2, 3, True, 3) for v in sorted(VARIANTS)]
            + [(v, "1f1b", 3, 1, 4, True, 3) for v in EDGE])
# Split backward (I, W) over rank processes: ZB-V (V placement, its middle hop in memory) for every
# variant; Block AttnRes and MSAR also naive, under interleaved ZB with m not a multiple of P, ZB-H1,
# and DualPipeV (fused B and I/W in one order), cached.
CASES_ZB = ([(v, "zbv", 2, 2, 3, True, 3) for v in sorted(VARIANTS)]
            + [(v, "zbv", 2, 2, 3, False, 3) for v in EDGE]
            + [(v, s, 2, V, m, True, 3) for v in EDGE
               for s, V, m in (("interleaved_zb", 2, 3), ("zb_h1", 1, 3), ("dualpipev", 2, 5))])


# The same over gloo's own payloads (ATTNRES_PP_SHM=0), not the shared-memory slots of one host.
CASES_GLOO_PAYLOADS = [(v, s, 2, V, m, True, 3) for v in ("block", "msar", "standard")
                       for s, V, m in (("interleaved_1f1b", 2, 4), ("zbv", 2, 3))]


@pytest.mark.parametrize(("cases", "env"), [(CASES_P1, None), (CASES_P2, None), (CASES_P3, None), (CASES_ZB, None),
                                            (CASES_GLOO_PAYLOADS, {"ATTNRES_PP_SHM": "0"})],
                         ids=["P1", "P2", "P3", "ZB", "gloo-payloads"])
def test_gloo_pipeline_equals_single_process(cases, env, tmp_path):
    run_dicts = []
    for variant, schedule, P, V, m, cache, block_size in cases:
        n_layers = 6 if P == 3 else 4
        overrides = {} if variant in ("standard", "full") else {"block_size": block_size}
        run_dicts.append(run_dict(model_config(variant, n_layers, **overrides), schedule, P, V, m, cache))
    out = run_group(cases[0][2], run_dicts, tmp_path, env=env)
    for index, (variant, schedule, P, V, m, cache, _) in enumerate(cases):
        cfg = RunConfig.from_dict(run_dicts[index]).model
        want_loss, want_grads = reference_step(cfg, *batch(m), m)
        got = out[index]
        assert len(got["losses"]) == m, (variant, schedule)
        loss = sum(got["losses"]) / m
        assert abs(loss - want_loss) <= 1e-5 * abs(want_loss), (variant, schedule, P, V, m, cache)
        assert_grads_match(got["grads"], want_grads, rtol=1e-5)
        if P == 1:
            assert got["ledger"] == [], "a self-hop went through the transport"
        else:  # ranks of one host hand payloads over in shared memory unless told not to
            assert got["transports"] == {"DistTransport" if env else "SharedMemoryTransport"}


# D = 2 replicas of a P = 2, V = 2 pipeline: 4 processes, a ("dp", "pp") mesh over gloo; each
# replica's hops in shared memory, between global ranks. ZB-V: the I/W split under D x P too.
CASES_DP = [(v, "interleaved_1f1b", 2, 2, 2, True, 3) for v in ("block", "msar")] + [("block", "zbv", 2, 2, 3, True, 3)]


@pytest.fixture(scope="module")
def four_rank_runs(tmp_path_factory):
    """One group of four gloo ranks runs CASES_DP (D = 2 x P = 2), then the SPEC table's naive and
    cached runs (P = 4): the four processes start once for both tests."""
    dp_dicts = [run_dict(model_config(variant, 4, block_size=block_size), schedule, P, V, m, cache, D=2)
                for variant, schedule, P, V, m, cache, block_size in CASES_DP]
    # docs/spec.md section 4.1 row 1 (L=16, S=4, P=4, V=2)
    table_cfg = model_config("block", 8, block_size=4, d_model=8)
    table_dicts = [run_dict(table_cfg, "interleaved_1f1b", 4, 2, 4, cache) for cache in (False, True)]
    out = run_group(4, dp_dicts + table_dicts, tmp_path_factory.mktemp("four_ranks"))
    return (dp_dicts, [out[i] for i in range(len(dp_dicts))],
            [out[len(dp_dicts) + i] for i in range(len(table_dicts))])


FOUR_RANKS = pytest.mark.xdist_group("gloo-four-ranks")


@FOUR_RANKS
def test_gloo_data_parallel_pipeline_equals_single_process(four_rank_runs):
    D = 2
    run_dicts, out, _ = four_rank_runs
    for index, (variant, _schedule, _P, _V, m, _cache, _) in enumerate(CASES_DP):
        cfg = RunConfig.from_dict(run_dicts[index]).model
        want_loss, want_grads = reference_step(cfg, *batch(D * m), D * m)
        got = out[index]
        assert len(got["losses"]) == D * m, variant
        loss = sum(got["losses"]) / (D * m)
        assert abs(loss - want_loss) <= 1e-5 * abs(want_loss), variant
        assert_grads_match(got["grads"], want_grads, rtol=1e-5)
        assert got["transports"] == {"SharedMemoryTransport"}


@FOUR_RANKS
def test_gloo_measured_hop_counts_equal_spec_table(four_rank_runs):
    # docs/spec.md section 4.1 row 1 (L=16, S=4, P=4, V=2): naive 2,2,3,3,4,4,5 and cached 2,2,3,2,2,2,2
    _, _, out = four_rank_runs
    for index, want in ((0, [2, 2, 3, 3, 4, 4, 5]), (1, [2, 2, 3, 2, 2, 2, 2])):
        per_hop = {hop: n for d, hop, mb, n, _ in out[index]["ledger"] if d == "fwd" and mb == 0}
        assert [per_hop[h] for h in range(7)] == want


def test_lost_rank_gives_a_bounded_error_not_a_hang(tmp_path):
    cfg = model_config("block", 4, block_size=3)
    run_cfg = RunConfig.from_dict({**run_dict(cfg, "interleaved_1f1b", 2, 2, 4),
                                   "pipeline": {"stages": 2, "virtual": 2, "launcher": "local", "timeout_s": 10.0}})
    engine = make_engine(run_cfg, fail_at=(1, 1))
    procs = list(engine.ranks.procs)
    inputs, targets = batch(4)
    try:
        engine.train_step(0, inputs, targets, 1e-3)
        start = time.monotonic()
        with pytest.raises(WorkerLost, match="rank 1 (exited|closed its pipe)") as info:
            engine.train_step(1, inputs, targets, 1e-3)
        assert time.monotonic() - start < 40
        assert info.value.pp_rank == 1
    finally:
        engine.close()
    assert len(procs) == 2 and not any(p.is_alive() for p in procs)


# Every variant's hops cross processes in test_gloo_pipeline_equals_single_process; here every
# variant trains through the in-process ranks and two through the local launcher's processes.
@pytest.mark.parametrize(("variant", "launcher"), [(v, "inprocess") for v in sorted(VARIANTS)]
                         + [("block", "local"), ("msar", "local")])
def test_local_launcher_training_matches_single_process_losses(variant, launcher, tmp_path):
    """Three optimiser steps (AdamW, clipping, LR schedule) through 2 ranks x 2 chunks."""
    overrides = {} if variant in ("standard", "full") else {"block_size": 3}
    run_cfg = RunConfig.from_dict(run_dict(model_config(variant, 4, **overrides), "interleaved_1f1b", 2, 2, 2,
                                           steps=3, grad_clip=0.05, lr=1e-2))
    run_cfg = dataclasses.replace(run_cfg, pipeline=dataclasses.replace(run_cfg.pipeline, launcher=launcher))
    engine = make_engine(run_cfg, tmp_path)
    local = WholeModel(run_cfg.model, run_cfg.train)
    try:
        for step in range(3):
            inputs, targets = batch(2, seed=10 + step)
            got, want = engine.train_step(step, inputs, targets, 1e-2), local.train_step(step, inputs, targets, 1e-2)
            assert abs(got.loss - want.loss) <= 1e-5 * abs(want.loss), (step, got.loss, want.loss)
        inputs, targets = batch(2, seed=99)
        assert abs(engine.eval_loss(inputs, targets) - local.eval_loss(inputs, targets)) < 1e-4
    finally:
        engine.close()
    assert (tmp_path / "trace.json").exists()
