"""The transferred calibration (`simulator.units`, `simulator.transfer`) on synthetic traces: fitted
from one simulated "measured" run, it must reproduce the closed forms and the true costs of runs it
has not seen; the work of a chunk in units; the `simulate project` table against hand-computed
figures."""

from __future__ import annotations

import pytest

from attnres_lab.transfer_fit import fit_plane, fit_transfer, unit_times_from_probe
from attnres_pp.comm.link import LinkModel
from attnres_pp.comm.partition import make_partition
from attnres_pp.model.config import ModelConfig
from attnres_pp.schedule.schedules import build_schedule
from attnres_pp.simulator.costs import CostModel
from attnres_pp.simulator.engine import simulate
from attnres_pp.simulator.metrics import SPLIT_SCHEDULES
from attnres_pp.simulator.transfer import RunShape, TransferCalibration
from attnres_pp.simulator.units import MessageCosts, chunk_work

TOKENS_D = {"d_model": 32, "n_heads": 2, "seq_len": 16, "vocab_size": 64}


def _model(layers: int, mode: str, block_size: int = 4) -> ModelConfig:
    if mode == "standard":
        return ModelConfig(n_layers=layers, residual="standard", block_size=1, **TOKENS_D)
    return ModelConfig(n_layers=layers, residual="attnres", block_size=block_size, **TOKENS_D)


def _shape(schedule: str, virtual: int, m: int, mode: str, layers: int, *, stages: int = 2,
           link: LinkModel | None = None, block_size: int = 4, layer_counts: tuple[int, ...] | None = None) -> RunShape:
    return RunShape(model=_model(layers, mode, block_size), schedule=schedule, n_stages=stages, n_virtual=virtual,
                    n_microbatches=m, microbatch_size=2, cache=mode == "cached", link=link, layer_counts=layer_counts)


def _probe(*, layer=(1.0, 2.0), add=(0.0, 0.0), embed=(0.0, 0.0), head=(0.0, 0.0), merge=(0.0, 0.0),
           phase1=lambda n, k: (0.0, 0.0), pack=0.0) -> dict:
    def unit(pair):
        return {"fwd_s": pair[0], "bwd_s": pair[1]}

    return {"layer": unit(layer), "add": unit(add), "embed": unit(embed), "head": unit(head), "merge": unit(merge),
            "phase1": [{"sources": n, "queries": k, "fwd_s": phase1(n, k)[0], "bwd_s": phase1(n, k)[1]}
                       for n in (1, 2, 4, 8, 16) for k in (1, 2, 4)],
            "pack_s_per_byte": pack}


def _measured_steps(shape: RunShape, costs: CostModel, n_steps: int = 3) -> list[list]:
    """A "measured" run: the simulator's own events of `shape` under `costs`, as if traced."""
    result = simulate(build_schedule(shape.schedule, shape.n_stages, shape.n_virtual, shape.n_microbatches), costs)
    return [list(result.events())] * n_steps


def test_chunk_work_follows_forward_sublayers():
    cfg = _model(8, "cached")  # 16 sublayers, blocks of 4
    partition = make_partition(8, 2, 1)  # chunk 0: sublayers 0-7, chunk 1: 8-15
    first, last = chunk_work(cfg, partition, 0), chunk_work(cfg, partition, 1)
    assert first.segments == ((1, 4), (2, 4)) and first.n_merges == 6 and first.has_embed and not first.has_head
    assert last.segments == ((3, 4), (4, 4), (5, 1)) and last.has_head  # the final read: b_0..b_4, one query
    # A chunk starting mid-block: its first segment has the block's remaining sublayers and a merge.
    mid = chunk_work(cfg, make_partition(8, 2, 1, layer_counts=(3, 5)), 1)
    assert mid.segments == ((2, 2), (3, 4), (4, 4), (5, 1)) and mid.n_merges == 2 + 3 + 3
    full = chunk_work(_model(2, "cached", block_size=1), make_partition(2, 1, 1), 0)  # Full AttnRes
    assert full.segments == ((1, 1), (2, 1), (3, 1), (4, 1), (5, 1)) and full.n_merges == 0
    standard = chunk_work(_model(8, "standard"), partition, 1)
    assert standard.segments == () and standard.n_adds == 8 and standard.n_layers == 4


def test_plane_fit_recovers_a_plane():
    points = [(n, k, 0.5 + 0.1 * n + 0.2 * k + 0.03 * n * k) for n in (1, 2, 4, 8) for k in (1, 2, 4)]
    assert fit_plane(points) == pytest.approx((0.5, 0.1, 0.2, 0.03))


@pytest.mark.parametrize(("schedule", "virtual", "m"), [("gpipe", 1, 4), ("1f1b", 1, 8), ("gpipe", 2, 4),
                                                        ("interleaved_1f1b", 2, 8), ("interleaved_1f1b", 4, 4),
                                                        ("zb_h1", 1, 4), ("interleaved_zb", 2, 5), ("zbv", 2, 4)])
def test_unit_cost_calibration_transfers_to_the_closed_forms(schedule, virtual, m):
    """Layers only, F = 1 and B = 2 per rank and microbatch, free links: calibrated on 1f1b V = 1 m = 4
    from a probe that is off by a factor (the fit must undo it), every other schedule's makespan is
    docs/spec.md section 5's 3 (m + (P - 1) / V), and the split schedules' (I = W = 1: the share the fused run
    cannot measure is taken as halves) 3 m + (P - 1) / V."""
    n_stages, layers = 2, 8
    truth = _probe(layer=(n_stages / layers, 2 * n_stages / layers))
    calibration_shape = _shape("1f1b", 1, 4, "standard", layers)
    measured = _measured_steps(calibration_shape, _truth_costs(truth, _FREE, calibration_shape))
    skewed = _probe(layer=(0.37 * n_stages / layers, 5.1 * n_stages / layers))
    calibration = fit_transfer(skewed, calibration_shape, measured)
    assert calibration.forward_scale == pytest.approx(1 / 0.37) and calibration.backward_scale == pytest.approx(2 / 5.1)
    target = _shape(schedule, virtual, m, "standard", layers)
    idle = (n_stages - 1) / virtual * (1 if schedule in SPLIT_SCHEDULES else 3)
    assert calibration.predict_step_s(target) == pytest.approx(3 * m + idle)


def test_a_split_calibration_run_keeps_its_weight_share():
    """Calibrated on a zb_h1 run whose W is 30% of each backward (I = 70%): the fit takes B = I + W and
    the share 0.3, and predicts other split and fused schedules exactly as the truth does."""
    truth_probe = _rich_probe()
    messages = MessageCosts(send_fixed_s=0.03, send_s_per_byte=1e-9, recv_fixed_s=0.01, link_latency_s=0.02,
                            link_s_per_byte=1e-9, dispatch_s=0.004)
    calibration_shape = _shape("zb_h1", 1, 4, "cached", 8)

    def truth_costs(shape: RunShape) -> CostModel:
        return TransferCalibration(forward=unit_times_from_probe(truth_probe, "fwd"),
                                   backward=unit_times_from_probe(truth_probe, "bwd"), messages=messages,
                                   forward_scale=1.0, backward_scale=1.0, calibrated_on=shape,
                                   weight_share=0.3).costs(shape)

    calibration = fit_transfer(truth_probe, calibration_shape,
                               _measured_steps(calibration_shape, truth_costs(calibration_shape)))
    assert calibration.weight_share == pytest.approx(0.3)
    assert TransferCalibration.from_dict(calibration.to_dict()).weight_share == pytest.approx(0.3)
    for schedule, virtual, m in (("zbv", 2, 4), ("interleaved_zb", 2, 6), ("1f1b", 1, 8)):
        target = _shape(schedule, virtual, m, "cached", 8)
        expected = simulate(build_schedule(schedule, 2, virtual, m), truth_costs(target)).makespan
        assert calibration.predict_step_s(target) == pytest.approx(expected, rel=1e-9), schedule


_FREE = MessageCosts(send_fixed_s=0.0, send_s_per_byte=0.0, recv_fixed_s=0.0, link_latency_s=0.0,
                     link_s_per_byte=0.0, dispatch_s=0.0)


def _truth_costs(probe: dict, messages: MessageCosts, shape: RunShape) -> CostModel:
    """The costs a probe and message costs imply, unscaled: the synthetic truth."""
    return TransferCalibration(forward=unit_times_from_probe(probe, "fwd"),
                               backward=unit_times_from_probe(probe, "bwd"), messages=messages, forward_scale=1.0,
                               backward_scale=1.0, calibrated_on=shape).costs(shape)


def _rich_probe() -> dict:
    return _probe(layer=(1.0, 2.1), add=(0.01, 0.02), embed=(0.2, 0.1), head=(0.5, 0.7), merge=(0.05, 0.08),
                  phase1=lambda n, k: (0.02 + 0.01 * n + 0.005 * k + 0.001 * n * k, 0.05 + 0.02 * n + 0.01 * n * k),
                  pack=1e-9)


@pytest.mark.parametrize(("schedule", "virtual", "m", "mode", "layers", "block_size", "layer_counts"), [
    ("gpipe", 1, 4, "cached", 8, 4, None), ("interleaved_1f1b", 2, 4, "naive", 8, 4, None),
    ("interleaved_1f1b", 4, 8, "cached", 16, 4, None), ("1f1b", 1, 8, "standard", 16, 4, None),
    ("gpipe", 2, 4, "standard", 8, 4, None), ("1f1b", 1, 4, "cached", 8, 4, (3, 5)),
    ("interleaved_1f1b", 2, 4, "cached", 8, 2, (1, 3, 2, 2)), ("gpipe", 1, 2, "naive", 4, 1, None)])
def test_calibration_predicts_held_out_runs_of_known_costs(schedule, virtual, m, mode, layers, block_size,
                                                           layer_counts):
    """Synthetic truth with every unit and message cost nonzero: a run's trace is simulated from the
    truth, the calibration is fitted to it alone (probe right in shape, wrong by 3x in level), and
    predicts other runs (schedule, V, m, mode, depth, layer split, block size, Full AttnRes) exactly
    as the truth does."""
    truth_probe = _rich_probe()
    messages = MessageCosts(send_fixed_s=0.03, send_s_per_byte=1e-9, recv_fixed_s=0.01, link_latency_s=0.02,
                            link_s_per_byte=1e-9, dispatch_s=0.004)
    calibration_shape = _shape("1f1b", 1, 4, "cached", 8)

    def truth_costs(shape: RunShape) -> CostModel:
        return _truth_costs(truth_probe, messages, shape)

    measured = _measured_steps(calibration_shape, truth_costs(calibration_shape))
    level_off = {**truth_probe, **{k: {d: 3 * v for d, v in truth_probe[k].items()}
                                   for k in ("layer", "add", "embed", "head", "merge")},
                 "phase1": [{**p, "fwd_s": 3 * p["fwd_s"], "bwd_s": 3 * p["bwd_s"]} for p in truth_probe["phase1"]]}
    calibration = fit_transfer(level_off, calibration_shape, measured)
    assert calibration.messages.send_fixed_s == pytest.approx(0.03)
    assert calibration.messages.recv_fixed_s == pytest.approx(0.01)
    assert calibration.messages.link_latency_s == pytest.approx(0.02)
    assert calibration.messages.dispatch_s == pytest.approx(0.004)
    target = _shape(schedule, virtual, m, mode, layers, block_size=block_size, layer_counts=layer_counts)
    expected = simulate(build_schedule(schedule, 2, virtual, m), truth_costs(target)).makespan
    assert calibration.predict_step_s(target) == pytest.approx(expected, rel=1e-9)


def test_an_emulated_link_is_shared_and_priced_by_bytes():
    """Over an emulated link a message takes latency + bytes / bandwidth and messages to one peer queue:
    the cached run, with fewer bytes, is predicted faster than the naive one."""
    probe = _probe(layer=(0.001, 0.002))
    calibration_shape = _shape("1f1b", 1, 4, "cached", 8)
    measured = [[(0, "F0.0", 0.0, 0.004, "compute"), (0, "B0.0", 0.004, 0.012, "compute"),
                 (1, "F1.0", 0.0, 0.004, "compute"), (1, "B1.0", 0.004, 0.012, "compute")]]
    calibration = fit_transfer(probe, calibration_shape, measured)
    link = LinkModel(gbps=0.001, latency_s=1e-3)  # 125 kB/s
    cached = _shape("interleaved_1f1b", 2, 4, "cached", 8, link=link)
    naive = _shape("interleaved_1f1b", 2, 4, "naive", 8, link=link)
    costs = calibration.costs(cached)
    n_bytes = cached.hop_bytes()
    assert costs.hop_fwd_s == pytest.approx(tuple(1e-3 + b / 125e3 for b in n_bytes))
    assert costs.wire_fwd_s == pytest.approx(tuple(b / 125e3 for b in n_bytes)) and costs.shared_links
    assert calibration.predict_step_s(naive) > 1.5 * calibration.predict_step_s(cached)


def test_calibration_refuses_another_microbatch_shape():
    probe = _probe()
    shape = _shape("1f1b", 1, 4, "cached", 8)
    measured = [[(0, "F0.0", 0.0, 1.0, "compute"), (0, "B0.0", 1.0, 3.0, "compute"),
                 (1, "F1.0", 0.0, 1.0, "compute"), (1, "B1.0", 1.0, 3.0, "compute")]]
    calibration = fit_transfer(probe, shape, measured)
    wider = RunShape(model=ModelConfig(n_layers=8, d_model=64, n_heads=2, seq_len=16, vocab_size=64), schedule="gpipe",
                     n_stages=2, n_virtual=1, n_microbatches=4, microbatch_size=2, cache=True)
    with pytest.raises(ValueError, match="calibrate again"):
        calibration.costs(wider)


def test_the_benchmark_cases_cover_what_the_issue_asks():
    """`attnres-lab fidelity`: the calibration run is never predicted; >= 12 held-out runs (>= 8 quick) over
    the schedules, V, m, modes and depths, and a cached and a naive run over the slow link."""
    from attnres_lab.fidelity import CALIBRATION, CASES, QUICK_CASES, SLOW_LINK_GBPS

    assert CALIBRATION.to_dict() == {"schedule": "1f1b", "P": 2, "V": 1, "m": 4, "mode": "cached", "layers": 8}
    for groups, least in ((CASES, 12), (QUICK_CASES, 8)):
        cases = [case for group in groups for case in group]
        assert len(cases) >= least and CALIBRATION not in cases and len(set(cases)) == len(cases)
        assert {c.mode for c in cases} == {"standard", "naive", "cached"}
        assert {c.layers for c in cases} == {8, 16}
        assert {c.schedule for c in cases} >= {"gpipe", "1f1b", "interleaved_1f1b"}
        slow = {c.mode for c in cases if c.link_gbps == SLOW_LINK_GBPS}
        assert {"cached", "naive"} <= slow
    full = [case for group in CASES for case in group]
    assert {c.virtual for c in full} == {1, 2, 4} and {c.microbatches for c in full} == {4, 8, 16}
    link_case = next(c for c in full if c.link_gbps is not None)
    assert link_case.run_config().pipeline.link_gbps == SLOW_LINK_GBPS


def test_simulate_predict_reads_a_calibration_and_prices_another_run(tmp_path, capsys):
    import json

    from attnres_pp.cli import main

    shape = _shape("1f1b", 1, 4, "cached", 8)
    measured = _measured_steps(shape, _truth_costs(_rich_probe(), _FREE, shape))
    calibration = fit_transfer(_rich_probe(), shape, measured)
    path = tmp_path / "fidelity.json"
    path.write_text(json.dumps({"calibration": calibration.to_dict()}))
    argv = ["simulate", "predict", "--calibration", str(path), "--schedule", "interleaved_1f1b", "--virtual", "2",
            "--microbatches", "8", "--mode", "naive", "--layers", "16", "--block-size", "2", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    target = _shape("interleaved_1f1b", 2, 8, "naive", 16, block_size=2)
    assert out["predicted_step_s"] == pytest.approx(calibration.predict_step_s(target))
    assert out["mode"] == "naive" and out["layer_counts"] == [4, 4, 4, 4]
    bad = ((["--link-gbps", "0"], "link bandwidth 0.0"), (["--virtual", "x"], "--virtual 'x'"),
           (["--link-latency-us", "5"], "needs --link-gbps"), (["--microbatches", "1"], "needs m >= P=2"))
    for extra, needle in bad:
        assert main(argv[:-1] + extra) == 2
        err = capsys.readouterr().err
        assert "error: " in err and needle in err and len(err.strip().splitlines()) == 1, err
    (tmp_path / "other.json").write_text("{}")
    assert main(["simulate", "predict", "--calibration", str(tmp_path / "other.json")]) == 2
    assert "holds no calibration" in capsys.readouterr().err
