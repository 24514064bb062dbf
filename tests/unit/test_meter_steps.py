"""The activation meter runs only while a step's figure can change (`pipeline.meter_steps`): a
fixed-shape run meters its first steps and reports their figure after them, and every per-step
`activation_peak_bytes` it reports equals the slow twin's, which meters every step; an MoE run, and
checkpointing under a split schedule, keep metering; a new batch shape is metered again."""

from __future__ import annotations

import pytest
import torch

from attnres_pp.comm.partition import make_partition
from attnres_pp.comm.plan import plan_for_model
from attnres_pp.model import ModelConfig
from attnres_pp.pipeline.chunk import build_rank_chunks
from attnres_pp.pipeline.loopback import make_loopback_runtimes, run_loopback_step
from attnres_pp.pipeline.memory_meter import ActivationMeter
from attnres_pp.pipeline.meter_steps import METERED_STEPS, MeterSteps
from attnres_pp.schedule.passes import insert_comm
from attnres_pp.schedule.schedules import build_schedule, schedule_placement
from tests.pipeline_helpers import batch, build_model, model_config

N_STEPS = 4


def test_a_fixed_shape_settles_after_two_agreeing_steps_and_a_new_shape_is_metered_again():
    steps = MeterSteps(every_step=False)
    assert [steps.start("a"), steps.finish(7), steps.start("a"), steps.finish(9)] == [True, 7, True, 9]
    assert steps.start("a") and steps.finish(9) == 9  # 7 then 9: not settled until two agree
    assert not steps.start("a") and steps.finish(None) == 9
    assert steps.start("b") and steps.finish(4) == 4  # another batch shape: its own first steps
    assert steps.start("b") and steps.finish(4) == 4
    assert not steps.start("b") and steps.finish(None) == 4
    twin = MeterSteps(every_step=True)
    assert all(twin.start("a") and twin.finish(3) == 3 for _ in range(4))
    with pytest.raises(ValueError, match="meter at least 2 steps"):
        MeterSteps(every_step=False, metered_steps=1)


class _Packs:
    """Counts the meter's packs (every runtime's), per step."""

    def __init__(self, monkeypatch) -> None:
        self.n = 0
        original = ActivationMeter.pack

        def pack(meter, t):
            self.n += 1
            return original(meter, t)

        monkeypatch.setattr(ActivationMeter, "pack", pack)


def _pipelined_run(cfg: ModelConfig, schedule_name: str, P: int, V: int, m: int, *, policy: str, every_step: bool,
                   packs: _Packs):
    """N_STEPS optimiser steps (AdamW) of a pipelined run in this process: per step, (each rank's
    activation_peak_bytes, the mean loss, the meter's packs)."""
    model = build_model(cfg)
    partition = make_partition(cfg.n_layers, P, V, placement=schedule_placement(schedule_name))
    chunks = [build_rank_chunks(model, partition, r, activation_checkpoint=policy) for r in range(P)]
    schedule = insert_comm(build_schedule(schedule_name, P, V, m))
    runtimes = make_loopback_runtimes(cfg, chunks, plan_for_model(cfg, partition, True), schedule, (2, cfg.seq_len))
    for runtime in runtimes:
        runtime.meter_every_step = every_step
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    steps = []
    for step in range(N_STEPS):
        inputs, targets = batch(m, seed=10 + step)
        before = packs.n
        records = run_loopback_step(runtimes, list(inputs.chunk(m)), list(targets.chunk(m)), 1.0 / m)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses = {mb: loss for r in records for mb, loss in r.losses.items()}
        steps.append(([r.activation_peak_bytes for r in records], sum(losses.values()) / m, packs.n - before))
    return steps


FIXED = [  # (variant, layers, schedule, P, V, checkpointing): fixed shapes, each a path of the meter
    ("block", 4, "interleaved_1f1b", 2, 2, "none"),  # the cache's reads and deposits
    ("standard", 2, "zb_h1", 2, 1, "none"),  # the split backward's W store
    ("block", 2, "1f1b", 2, 1, "full"),  # checkpointing's recomputation inside B
    ("lr_projected", 2, "1f1b", 2, 1, "selective"),
]


@pytest.mark.parametrize(("variant", "n_layers", "schedule", "P", "V", "policy"), FIXED)
def test_a_fixed_shape_run_reports_the_figures_of_metering_every_step(monkeypatch, variant, n_layers, schedule, P, V,
                                                                      policy):
    cfg = model_config(variant, n_layers=n_layers)
    packs = _Packs(monkeypatch)
    want = _pipelined_run(cfg, schedule, P, V, 2, policy=policy, every_step=True, packs=packs)
    got = _pipelined_run(cfg, schedule, P, V, 2, policy=policy, every_step=False, packs=packs)
    assert [peaks for peaks, _loss, _n in got] == [peaks for peaks, _loss, _n in want]
    assert all(p > 0 for peaks, _loss, _n in want for p in peaks)
    assert [loss for _p, loss, _n in got] == [loss for _p, loss, _n in want]  # the meter changes no number
    assert len({loss for _p, loss, _n in want}) == N_STEPS  # the steps are not one step repeated
    # The slow twin packs every step; the fast path its first METERED_STEPS steps, then nothing.
    assert all(n > 0 for _p, _l, n in want)
    assert [n for _p, _l, n in got] == [n for _p, _l, n in want[:METERED_STEPS]] + [0] * (N_STEPS - METERED_STEPS)


def test_an_moe_run_is_metered_every_step(monkeypatch):
    """Routing sets each expert's rows: the figure is counted, not carried, on every step."""
    cfg = model_config("block", n_layers=2, moe_experts=4, moe_top_k=1, moe_d_ff=16)
    packs = _Packs(monkeypatch)
    got = _pipelined_run(cfg, "1f1b", 2, 1, 2, policy="none", every_step=False, packs=packs)
    want = _pipelined_run(cfg, "1f1b", 2, 1, 2, policy="none", every_step=True, packs=packs)
    assert [n for _p, _l, n in got] == [n for _p, _l, n in want] and all(n > 0 for _p, _l, n in got)
    assert [peaks for peaks, _l, _n in got] == [peaks for peaks, _l, _n in want]


def test_checkpointing_under_a_split_schedule_is_metered_every_step(monkeypatch):
    """I's choice of weight store reads the meter's counts of the checkpoint inputs."""
    cfg = model_config("block", n_layers=2)
    packs = _Packs(monkeypatch)
    got = _pipelined_run(cfg, "zb_h1", 2, 1, 2, policy="full", every_step=False, packs=packs)
    assert all(n > 0 for _p, _l, n in got)


def _one_process_steps(monkeypatch, batches, every_step: bool, packs: _Packs, **train) -> list[tuple[int, int]]:
    """The one-process run's steps on `batches` (`--launcher local`, one chunk: the engine's lone
    rank): (activation_peak_bytes, the meter's packs) each."""
    from attnres_pp.pipeline.config import PipelineConfig
    from attnres_pp.pipeline.runtime import StageRuntime
    from attnres_pp.train.config import RunConfig, TrainConfig
    from attnres_pp.train.engines import make_engine

    monkeypatch.setattr(StageRuntime, "meter_every_step", every_step)
    run_cfg = RunConfig(model=model_config("block", n_layers=2), pipeline=PipelineConfig(launcher="local"),
                        train=TrainConfig(batch_size=8, microbatches=2, steps=len(batches), threads=1,
                                          warmup_steps=0, **train))
    engine = make_engine(run_cfg)
    out = []
    try:
        for step, (inputs, targets) in enumerate(batches):
            before = packs.n
            result = engine.train_step(step, inputs, targets, 1e-2)
            out.append((result.extras["memory_per_rank"][0]["activation_peak_bytes"], packs.n - before))
    finally:
        engine.close()
    return out


@pytest.mark.parametrize("policy", ["none", "full"])
def test_a_new_batch_shape_is_metered_again(monkeypatch, policy):
    """The one-process run takes sequences of any length up to the model's: steps 0-2 of full-length
    sequences, then 3-5 of half-length ones. The first steps of each shape are metered, and every
    step's figure is the slow twin's."""
    half = lambda t: t[:, : t.shape[1] // 2]  # noqa: E731
    batches = [batch(4, seed=10 + s) for s in range(3)] + [tuple(half(t) for t in batch(4, seed=20 + s))
                                                           for s in range(3)]
    packs = _Packs(monkeypatch)
    want = _one_process_steps(monkeypatch, batches, True, packs, activation_checkpoint=policy)
    got = _one_process_steps(monkeypatch, batches, False, packs, activation_checkpoint=policy)
    assert [peak for peak, _n in got] == [peak for peak, _n in want]
    assert want[3][0] < want[2][0]  # the shorter sequences save less: the figure did change
    assert [n > 0 for _p, n in got] == [True, True, False, True, True, False]
    assert all(n > 0 for _p, n in want)


def test_the_in_process_ranks_report_the_slow_twins_memory_per_rank(monkeypatch):
    """Through the engine (`--launcher inprocess`: StageWorker ranks on threads): each step's
    memory_per_rank, the entries summary.json writes, is the slow twin's on every rank."""
    from attnres_pp.bench.common import random_batch, run_config
    from attnres_pp.pipeline.runtime import StageRuntime
    from attnres_pp.train.engines import make_pipeline_engine

    model = dict(vocab_size=64, n_layers=4, d_model=16, n_heads=2, seq_len=8, residual="attnres", block_size=2)
    packs = _Packs(monkeypatch)
    runs = {}
    for every_step in (True, False):
        monkeypatch.setattr(StageRuntime, "meter_every_step", every_step)
        engine = make_pipeline_engine(run_config(model, stages=2, virtual=1, schedule="1f1b", microbatches=2,
                                                 microbatch_size=2, launcher="inprocess"), None)
        runs[every_step] = []
        try:
            for step in range(N_STEPS):
                before = packs.n
                result = engine.train_step(step, *random_batch(step, 4, 8, 64), 1e-2)
                runs[every_step].append((result.extras["memory_per_rank"], result.loss, packs.n - before))
        finally:
            engine.close()
    for (want, want_loss, _n), (got, loss, _m) in zip(runs[True], runs[False], strict=True):
        assert loss == want_loss
        assert [g["activation_peak_bytes"] for g in got] == [w["activation_peak_bytes"] for w in want]
        assert all(w["activation_peak_bytes"] > 0 for w in want)
    assert [n > 0 for _e, _l, n in runs[False]] == [True] * METERED_STEPS + [False] * (N_STEPS - METERED_STEPS)
    assert all(n > 0 for _e, _l, n in runs[True])
