"""The stage runtime's own checks: the last chunk's losses stay on the device until the end of the
step (one read, not a host synchronisation per microbatch) and equal the single-process model's;
a backward hop that brings back another number of gradients than its forward hop sent raises."""

from __future__ import annotations

import pytest
import torch

from attnres_pp.comm.partition import make_partition
from attnres_pp.comm.plan import plan_for_model
from attnres_pp.pipeline.chunk import build_rank_chunks
from attnres_pp.pipeline.executor import ActionExecutor
from attnres_pp.pipeline.loopback import make_loopback_runtimes, run_in_turns
from attnres_pp.schedule.ir import ActionKind
from attnres_pp.schedule.passes import insert_comm
from attnres_pp.schedule.schedules import build_schedule
from tests.pipeline_helpers import MICRO, SEQ, batch, build_model, model_config

P, V, M = 2, 2, 3


def _started_runtimes(schedule_name: str = "interleaved_1f1b"):
    cfg = model_config("block", 4, block_size=3)
    model = build_model(cfg)
    partition = make_partition(cfg.n_layers, P, V)
    runtimes = make_loopback_runtimes(cfg, [build_rank_chunks(model, partition, r) for r in range(P)],
                                      plan_for_model(cfg, partition, True),
                                      insert_comm(build_schedule(schedule_name, P, V, M)), (MICRO, SEQ))
    inputs, targets = batch(M)
    for runtime in runtimes:
        runtime.start_step(list(inputs.chunk(M)), list(targets.chunk(M)), 1.0 / M)
    return cfg, runtimes, inputs, targets


@pytest.mark.parametrize("schedule_name", ["interleaved_1f1b", "interleaved_zb"])
def test_losses_are_read_once_at_the_end_of_the_step(schedule_name):
    cfg, runtimes, inputs, targets = _started_runtimes(schedule_name)
    run_in_turns(runtimes, "pipeline")
    last = runtimes[(P * V - 1) % P]
    # Every action has run, and no loss has reached the host yet: they wait on the device.
    assert last.record.losses == {}
    assert sorted(last._losses_on_device) == list(range(M))
    assert all(torch.is_tensor(t) and t.dim() == 0 for t in last._losses_on_device.values())
    records = [runtime.finish_step() for runtime in runtimes]
    model = build_model(cfg)
    with torch.no_grad():
        want = [float(model(i, t)) for i, t in zip(inputs.chunk(M), targets.chunk(M), strict=True)]
    got = records[(P * V - 1) % P].losses
    assert sorted(got) == list(range(M)) and all(isinstance(v, float) for v in got.values())
    for mb, loss in got.items():
        assert abs(loss - want[mb]) <= 1e-5 * abs(want[mb])
    assert records[0].losses == {}  # the first rank holds no last chunk


def test_a_backward_hop_short_of_a_gradient_raises(monkeypatch):
    _cfg, runtimes, _inputs, _targets = _started_runtimes()
    original = ActionExecutor._recv_backward

    def drop_one(self, action):
        original(self, action)
        grads = self.grads_back[(action.chunk_index, action.microbatch_index)]
        if len(grads) >= 2:
            grads.pop()

    monkeypatch.setitem(ActionExecutor._COMM_HANDLERS, ActionKind.RECV_B, drop_one)
    with pytest.raises(RuntimeError, match=r"got 1 gradients back for the 2 tensors chunk \d sent for microbatch"):
        run_in_turns(runtimes, "pipeline")
