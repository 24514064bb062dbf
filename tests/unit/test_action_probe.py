"""The runtime's cost per action (`attnres_lab.action_probe`, `UnitTimes.action`): added to every chunk,
it prices a V = 2 run from a V = 1 calibration as a truth that has it does, where units alone
price it too cheap; the probe recovers it from V = 1 and V = 4 runs (stubbed engines that take
known seconds per unit and per action)."""

from __future__ import annotations

import pytest

from attnres_lab import action_probe
from attnres_lab.transfer_fit import fit_transfer, unit_times_from_probe
from attnres_pp.bench.common import BENCH_MODEL
from attnres_pp.comm.partition import make_partition
from attnres_pp.model.config import ModelConfig
from attnres_pp.schedule.schedules import build_schedule
from attnres_pp.simulator.engine import simulate
from attnres_pp.simulator.transfer import TransferCalibration
from attnres_pp.simulator.units import chunk_work

from .test_sim_fidelity import _FREE, _measured_steps, _probe, _shape

ACTION = {"fwd_s": 0.004, "bwd_s": 0.006}


def _unit_probe() -> dict:
    return _probe(layer=(0.001, 0.002), embed=(0.0005, 0.0004), head=(0.0008, 0.001),
                  phase1=lambda n, k: (1e-4 + 2e-5 * n, 2e-4 + 3e-5 * n))


def test_an_action_cost_is_added_to_every_chunk_and_scaled_with_it():
    units = unit_times_from_probe({**_unit_probe(), "action": ACTION}, "fwd")
    plain = unit_times_from_probe(_unit_probe(), "fwd")
    cfg = _shape("1f1b", 1, 4, "cached", 8).model
    work = chunk_work(cfg, make_partition(8, 2, 2), 1)
    assert units.chunk_s(work) == pytest.approx(plain.chunk_s(work) + 0.004)
    assert units.scaled(2.0).chunk_s(work) == pytest.approx(2 * units.chunk_s(work))
    assert type(units).from_dict(units.to_dict()) == units
    old_file = {k: v for k, v in plain.to_dict().items() if k != "action"}  # a calibration written before
    assert type(plain).from_dict(old_file) == plain


def test_a_v1_calibration_prices_v2_as_the_truth_only_with_the_action_cost():
    truth_probe = {**_unit_probe(), "action": ACTION}
    calibration_shape = _shape("1f1b", 1, 4, "cached", 8)

    def truth(shape):
        return TransferCalibration(forward=unit_times_from_probe(truth_probe, "fwd"),
                                   backward=unit_times_from_probe(truth_probe, "bwd"), messages=_FREE,
                                   forward_scale=1.0, backward_scale=1.0, calibrated_on=shape).costs(shape)

    measured = _measured_steps(calibration_shape, truth(calibration_shape))
    target = _shape("interleaved_1f1b", 2, 4, "cached", 8)
    expected = simulate(build_schedule("interleaved_1f1b", 2, 2, 4), truth(target)).makespan
    with_action = fit_transfer(truth_probe, calibration_shape, measured)
    assert with_action.predict_step_s(target) == pytest.approx(expected, rel=1e-9)
    units_only = fit_transfer(_unit_probe(), calibration_shape, measured)
    assert units_only.predict_step_s(target) < 0.97 * expected  # twice the actions, priced as units


def test_the_probe_recovers_a_known_action_cost(monkeypatch):
    """Engines stubbed to take exactly units + action seconds per action: the probe's V = 1 / V = 4
    difference, less the units' own difference, is the action cost."""
    probe = _unit_probe()
    cfg = ModelConfig.from_dict(BENCH_MODEL)
    forward, backward = unit_times_from_probe(probe, "fwd"), unit_times_from_probe(probe, "bwd")

    class StubEngine:
        def __init__(self, run_cfg) -> None:
            self.virtual = run_cfg.pipeline.virtual
            self.samples = []

        def step(self) -> None:
            partition = make_partition(cfg.n_layers, 1, self.virtual)
            events, clock = [], 0.0
            for c in range(partition.n_chunks):
                work = chunk_work(cfg, partition, c)
                for kind, units, extra in (("F", forward, ACTION["fwd_s"]), ("B", backward, ACTION["bwd_s"])):
                    seconds = units.chunk_s(work) + extra
                    events.append((0, f"{kind}{c}.0", clock, clock + seconds, "compute"))
                    clock += seconds
            self.samples.append(type("Sample", (), {"events": events})())

        def close(self) -> None:
            pass

    monkeypatch.setattr(action_probe, "TimedEngine", StubEngine)
    cost = action_probe.probe_action_cost(BENCH_MODEL, probe, steps=2, rounds=1)
    assert cost["fwd_s"] == pytest.approx(ACTION["fwd_s"]) and cost["bwd_s"] == pytest.approx(ACTION["bwd_s"])
