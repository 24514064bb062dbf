"""The simulator's fast path against its slow twin: a compute-only schedule encoded (and lowered on
the fly) by `encode_compute_only` must give the same op streams and times as `passes.insert_comm`
+ `validate` + `encode_lowered`, and must refuse every schedule `validate` refuses."""

from __future__ import annotations

import random

import pytest

from attnres_pp.schedule.ir import B, F, I, Schedule, W
from attnres_pp.schedule.passes import insert_comm
from attnres_pp.schedule.schedules import SCHEDULES, build_schedule
from attnres_pp.schedule.validate import ScheduleError, validate
from attnres_pp.simulator.costs import CostModel, unit_costs
from attnres_pp.simulator.encode import encode_compute_only, encode_lowered
from attnres_pp.simulator.engine import simulate

V_SHAPED = ("zbv", "dualpipev", "v_half", "v_min")


def _grid():
    for name in sorted(SCHEDULES):
        for n_stages in (1, 2, 3, 4):
            for n_virtual in (1, 2, 3):
                if (name in ("1f1b", "zb_h1") and n_virtual > 1) or (name in V_SHAPED and n_virtual != 2):
                    continue
                for n_microbatches in (n_stages, 2 * n_stages, 3):
                    if name.startswith("interleaved") and n_virtual > 1 and n_microbatches < n_stages:
                        continue
                    if name in ("dualpipev", "v_half", "v_min") and n_microbatches < 2 * n_stages:
                        continue
                    yield name, n_stages, n_virtual, n_microbatches


def _random_costs(n_chunks: int, seed: int, *, runtime_work: bool, shared: bool) -> CostModel:
    rng = random.Random(seed)
    n_hops = n_chunks - 1

    def draw(n: int, low: float, high: float) -> tuple[float, ...]:
        return tuple(rng.uniform(low, high) for _ in range(n))

    hop_fwd, hop_bwd = draw(n_hops, 0.1, 0.6), draw(n_hops, 0.1, 0.6)
    extra = {}
    if runtime_work:
        extra = dict(send_fwd_s=draw(n_hops, 0, 0.1), send_bwd_s=draw(n_hops, 0, 0.1),
                     recv_fwd_s=draw(n_hops, 0, 0.1), recv_bwd_s=draw(n_hops, 0, 0.1), dispatch_s=0.01)
    if shared:
        extra.update(wire_fwd_s=tuple(h * 0.8 for h in hop_fwd), wire_bwd_s=tuple(h * 0.5 for h in hop_bwd))
    return CostModel(forward_s=draw(n_chunks, 0.5, 1.5), backward_s=draw(n_chunks, 1.0, 3.0), hop_fwd_s=hop_fwd,
                     hop_bwd_s=hop_bwd, **extra)


@pytest.mark.parametrize(("name", "n_stages", "n_virtual", "n_microbatches"), list(_grid()))
def test_fast_encoding_equals_insert_comm_then_encode(name, n_stages, n_virtual, n_microbatches):
    schedule = build_schedule(name, n_stages, n_virtual, n_microbatches)
    costs = _random_costs(schedule.n_chunks, n_stages * 100 + n_virtual * 10 + n_microbatches,
                          runtime_work=True, shared=True)
    fast = encode_compute_only(schedule, costs)
    slow = encode_lowered(insert_comm(schedule), costs)
    assert fast == slow
    fast_result, slow_result = simulate(schedule, costs), simulate(insert_comm(schedule), costs)
    assert fast_result.ends == slow_result.ends
    assert fast_result.compute_s == slow_result.compute_s
    assert [str(a) for a in fast_result.lowered.rank_actions[0]] == [
        str(a) for a in slow_result.lowered.rank_actions[0]]


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("runtime_work", [False, True])
def test_lean_and_general_loops_agree(runtime_work, shared):
    """With no runtime work and unshared links the engine takes a leaner loop; giving the general one
    the same costs through a zero-sized runtime term must not change a time."""
    schedule = build_schedule("interleaved_1f1b", 4, 3, 8)
    costs = _random_costs(12, 7, runtime_work=runtime_work, shared=shared)
    general = CostModel(**{**costs.__dict__, "send_fwd_s": costs.send_fwd_s or (0.0,) * 11})
    assert simulate(schedule, costs).ends == simulate(schedule, general).ends


def _broken_schedules():
    ok = build_schedule("1f1b", 2, 1, 2)
    rank0, rank1 = list(ok.rank_actions[0]), list(ok.rank_actions[1])

    def make(r0, r1, m=2):
        return Schedule(name="broken", n_stages=2, n_virtual=1, n_microbatches=m,
                        rank_actions=(tuple(r0), tuple(r1)))

    yield "missing", make(rank0[:-1], rank1)
    yield "twice", make(rank0 + [F(0, 0)], rank1)
    yield "wrong rank", make(rank0 + [F(1, 1)], rank1[:1] + rank1[2:])
    yield "B before F", make(rank0, [B(1, 0), F(1, 0)] + rank1[2:])
    yield "microbatch out of range", make(rank0 + [F(0, 5)], rank1)
    yield "deadlock", make([F(0, 0), B(0, 0), F(0, 1), B(0, 1)], [F(1, 1), B(1, 1), F(1, 0), B(1, 0)])
    split = build_schedule("zb_h1", 2, 1, 2)
    split0, split1 = list(split.rank_actions[0]), list(split.rank_actions[1])
    w_of = split1.index(W(1, 0))
    swapped = list(split1)
    swapped[1], swapped[w_of] = swapped[w_of], swapped[1]
    yield "W before I", make(split0, swapped)
    yield "I without W", make(split0, split1[:w_of] + split1[w_of + 1:])
    yield "W twice", make(split0, split1 + [W(1, 0)])
    yield "B and I", make(split0, split1 + [B(1, 0)])
    yield "W of a fused B", make(rank0, rank1 + [W(1, 0)])
    # Two chunks on each rank: chunk 1's input gradients before chunk 3's, on rank 1 (the deposits).
    ok2 = build_schedule("interleaved_zb", 2, 2, 2)
    rank1 = [F(1, 0), F(1, 1), F(3, 0), F(3, 1), I(1, 0), I(3, 0), I(1, 1), I(3, 1), W(1, 0), W(1, 1), W(3, 0), W(3, 1)]
    yield "deposit order", Schedule(name="broken", n_stages=2, n_virtual=2, n_microbatches=2,
                                    rank_actions=(ok2.rank_actions[0], tuple(rank1)))


@pytest.mark.parametrize(("label", "schedule"), list(_broken_schedules()))
def test_fast_path_refuses_what_validate_refuses(label, schedule):
    with pytest.raises(ScheduleError) as from_validate:
        validate(insert_comm(schedule) if label == "deadlock" else schedule)
    with pytest.raises(ScheduleError) as from_simulator:
        simulate(schedule, unit_costs(2, schedule.n_virtual))
    if label == "deadlock":  # the simulator reports the compute-only schedule's table
        assert "deadlocks" in str(from_simulator.value) and "deadlocks" in str(from_validate.value)
    else:
        assert str(from_simulator.value) == str(from_validate.value)


def test_big_schedule_is_exact():
    """A schedule of 100k+ actions through the fast path keeps the closed-form bubble exactly."""
    n_stages, n_virtual, n_microbatches = 16, 4, 256
    result = simulate(build_schedule("interleaved_1f1b", n_stages, n_virtual, n_microbatches),
                      unit_costs(n_stages, n_virtual))
    n_chunks = n_stages * n_virtual  # 2 C m computes; 2 (C - 1) m messages, a send and a receive each
    assert result.n_actions == 2 * n_chunks * n_microbatches + 4 * (n_chunks - 1) * n_microbatches
    assert result.makespan == pytest.approx(3 * (n_microbatches + (n_stages - 1) / n_virtual))
