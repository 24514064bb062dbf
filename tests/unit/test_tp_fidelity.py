"""The simulator's tensor-parallel terms in the transferred calibration (`RunShape.tensor_parallel`,
`tensor_parallel.TensorParallelCosts`) and the analysis of `attnres-lab fidelity --tp` (`attnres_lab.fidelity_tp`,
`attnres_lab.tp_probe`'s fits). Synthetic numbers, no process: the probe and the runs are the benchmark's."""

from __future__ import annotations

import dataclasses
import gzip
import json
from pathlib import Path

import pytest

from attnres_lab.fidelity_tp import (
    CALIBRATION,
    CASES,
    LAYER_PROBE_LAYERS,
    LAYER_PROBE_PLANS,
    TpCase,
    analyse,
    layer_probe_case,
    reanalyse,
)
from attnres_lab.tp_probe import KINDS, fit_links, fit_ring_link, host_costs
from attnres_lab.transfer_fit import unit_times_from_probe
from attnres_pp.simulator.tensor_parallel import (
    TensorParallel,
    TensorParallelCosts,
    layer_collective_s,
    layer_collectives,
)
from attnres_pp.simulator.transfer import RunShape, TransferCalibration
from attnres_pp.simulator.units import chunk_work

from .test_sim_fidelity import _FREE, _measured_steps, _probe, _rich_probe, _shape

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
LINKS = {"all_gather": {"latency_s": 80e-6, "bytes_per_s": 1.2e9},
         "reduce_scatter": {"latency_s": 120e-6, "bytes_per_s": 0.6e9},
         "all_reduce": {"latency_s": 50e-6, "bytes_per_s": 2.0e9}}
HOST = {"sp": {"fwd": 6e-3, "bwd": 7e-3}, "no_sp": {"fwd": 2.5e-3, "bwd": 4.5e-3}}


def _calibration(probe: dict, shape: RunShape) -> TransferCalibration:
    return TransferCalibration(forward=unit_times_from_probe(probe, "fwd"),
                               backward=unit_times_from_probe(probe, "bwd"), messages=_FREE,
                               forward_scale=1.0, backward_scale=1.0, calibrated_on=shape)


@pytest.mark.parametrize("sp", [True, False])
def test_a_tp_rank_does_its_share_of_each_unit_plus_its_layers_collectives_and_host_cost(sp):
    """T = 2: the layers' work halves; per-token work (depth reads, embedding, head, merges) halves
    under sequence parallelism and stays whole without it; every layer adds its collectives on the
    probed links and the probed host cost, forward and backward; the runtime's cost per action stays."""
    probe = {**_rich_probe(), "action": {"fwd_s": 0.3, "bwd_s": 0.4}}
    base = _shape("interleaved_1f1b", 2, 4, "cached", 8)
    calibration = _calibration(probe, base)
    costs = TensorParallelCosts(links=LINKS, layer_host_s=HOST)
    split = dataclasses.replace(base, tensor_parallel=2, sequence_parallel=sp, tp_costs=costs)
    whole, tp = calibration.costs(base), calibration.costs(split)
    units = unit_times_from_probe(probe, "fwd")
    token = 0.5 if sp else 1.0
    plan = "sp" if sp else "no_sp"
    tp_size = TensorParallel(2, sp)
    wire = layer_collective_s(base.tokens, base.model.d_model, 4, tp_size, bytes_per_s=0.0, latency_s=0.0, links=LINKS)
    partition = base.partition()
    for c in range(partition.n_chunks):
        work = chunk_work(base.model, partition, c)
        layers = work.n_layers
        expected = units.shares(0.5, token).chunk_s(work) + layers * (wire + HOST[plan]["fwd"])
        assert tp.forward_s[c] == pytest.approx(expected, rel=1e-12)
        assert tp.forward_s[c] != pytest.approx(whole.forward_s[c])
        # by hand: the layer halves, the action stays whole
        by_hand = (0.5 * layers * units.layer + token * (units.chunk_s(work) - layers * units.layer - units.action)
                   + units.action + layers * (wire + HOST[plan]["fwd"]))
        assert tp.forward_s[c] == pytest.approx(by_hand, rel=1e-12)
    # Under SP a tp rank's hop pair carries its sequence shard: half the bytes.
    assert split.hop_bytes() == [b // (2 if sp else 1) for b in base.hop_bytes()]
    # Without probed costs only the work is divided.
    bare = calibration.costs(dataclasses.replace(split, tp_costs=None))
    assert bare.forward_s[0] == pytest.approx(units.shares(0.5, token).chunk_s(chunk_work(base.model, partition, 0)))


def test_the_layer_collectives_follow_each_kind_s_own_link():
    tp = TensorParallel(2, True)
    tokens, d = 256, 128
    buffer = tokens * d * 4
    expected = sum(2 * (LINKS[kind]["latency_s"] + buffer / 2 / LINKS[kind]["bytes_per_s"])
                   for kind in ("all_gather", "reduce_scatter"))
    assert layer_collective_s(tokens, d, 4, tp, bytes_per_s=0.0, latency_s=0.0, links=LINKS) == pytest.approx(expected)
    assert [c["kind"] for c in layer_collectives(tokens, d, 4, TensorParallel(2, False))] == ["all_reduce"]


def test_the_ring_fit_recovers_each_kind_s_link_and_refuses_flat_times():
    group = 2
    points = []
    for kind in KINDS:
        passes = 2 if kind == "all_reduce" else 1
        link = LINKS[kind]
        points += [(kind, n, passes * ((group - 1) * link["latency_s"] + (group - 1) / group * n / link["bytes_per_s"]))
                   for n in (16 << 10, 256 << 10, 4 << 20)]
    fitted = fit_links(points, group)
    for kind in KINDS:
        assert fitted[kind]["latency_s"] == pytest.approx(LINKS[kind]["latency_s"], rel=1e-6)
        assert fitted[kind]["bytes_per_s"] == pytest.approx(LINKS[kind]["bytes_per_s"], rel=1e-6)
        assert fitted[kind]["max_rel_residual"] < 1e-9
    flat = [("all_gather", n, 1e-4 - n * 1e-12) for n in (16 << 10, 256 << 10, 4 << 20)]
    with pytest.raises(ValueError, match="do not grow with the buffer"):
        fit_ring_link(flat, group)


def test_the_host_cost_is_what_the_split_layer_takes_beyond_its_share_and_its_collectives():
    tokens, d, group = 256, 128, 2
    whole = {"fwd": 1.2e-3, "bwd": 3.4e-3}
    layer = {"whole": whole}
    for plan, sp in (("sp", True), ("no_sp", False)):
        wire = layer_collective_s(tokens, d, 4, TensorParallel(group, sp), bytes_per_s=0.0, latency_s=0.0, links=LINKS)
        layer[plan] = {k: whole[k] / group + wire + HOST[plan][k] for k in ("fwd", "bwd")}
    recovered = host_costs(layer, tokens, d, 4, group, LINKS)
    for plan in HOST:
        for k in ("fwd", "bwd"):
            assert recovered[plan][k] == pytest.approx(HOST[plan][k], rel=1e-9)


def test_the_analysis_predicts_runs_simulated_from_known_tp_costs():
    """Runs simulated from a known truth (units 3x the probe's level, the tp links and host cost):
    the analysis calibrates on the T = 1 run alone and predicts every run exactly with all three tp
    terms, too fast with the work divided alone; the controls are exact under every model."""
    # No adds: the layer probe's runs (standard residual) then differ by layers alone.
    probe = _probe(layer=(1e-3, 2.1e-3), embed=(2e-4, 1e-4), head=(5e-4, 7e-4),
                   merge=(5e-5, 8e-5), phase1=lambda n, k: (2e-5 + 1e-5 * n + 1e-6 * n * k, 5e-5 + 2e-5 * n))
    truth_probe = _probe(layer=(3e-3, 6.3e-3), embed=(6e-4, 3e-4), head=(1.5e-3, 2.1e-3),
                         merge=(1.5e-4, 2.4e-4),
                         phase1=lambda n, k: (6e-5 + 3e-5 * n + 3e-6 * n * k, 1.5e-4 + 6e-5 * n))
    tp_costs = TensorParallelCosts(links=LINKS, layer_host_s=HOST)
    calibration_shape = CALIBRATION.shape()
    truth = _calibration(truth_probe, calibration_shape)
    cases = [CASES[0], CASES[1], CASES[2], CASES[8]]
    alone = {"sp": {"fwd": 1.0, "bwd": 1.0}, "no_sp": {"fwd": 1.0, "bwd": 1.0}}  # the isolated probe: far off

    def runs(case: TpCase) -> list:
        return _measured_steps(case.shape(tp_costs), truth.costs(case.shape(tp_costs)))

    layer_runs = {plan: {str(n): runs(layer_probe_case(plan, n)) for n in LAYER_PROBE_LAYERS}
                  for plan in LAYER_PROBE_PLANS}
    kept = {"units": probe, "warmup": 0, "layer_runs": layer_runs,
            "tp_probe": {"links": LINKS, "layer_host_s": alone, "group": 2},
            "calibration": _measured_steps(calibration_shape, truth.costs(calibration_shape)),
            "runs": [[dataclasses.asdict(c), _measured_steps(c.shape(tp_costs), truth.costs(c.shape(tp_costs)))]
                     for c in cases]}
    result = analyse(json.loads(json.dumps(kept)), lambda line: None)  # through JSON, as a kept file
    for plan in HOST:  # the runtime probe recovers the truth's host cost from runs it never predicts
        for direction in ("fwd", "bwd"):
            assert result["layer_host_in_runs_s"][plan][direction] == pytest.approx(HOST[plan][direction], rel=1e-9)
    for row in result["cases"]:
        assert row["error"] == pytest.approx(0.0, abs=1e-6), row["label"]
        if row["tensor_parallel"] > 1:
            assert row["work_only_error"] < row["collectives_error"] < -0.05, row["label"]
            assert row["layer_alone_error"] > 1.0, row["label"]  # a host cost of 1 s per layer
    assert result["summary"]["full"]["max_abs"] < 1e-6 and result["summary"]["tp_runs"] == 3


def test_a_tp_case_runs_what_it_labels():
    case = TpCase("interleaved_1f1b", 2, 4, "cached", 8, 2, False)
    pipe = case.run_config().pipeline
    assert (pipe.tensor_parallel, pipe.sequence_parallel, pipe.stages, pipe.virtual) == (2, False, 1, 2)
    assert case.shape().tensor_parallel == 2 and not case.shape().tp.sp
    assert "T=2 no SP" in case.label()
    assert TpCase("1f1b", 1, 4, "cached", 8, 1).run_config().pipeline.tensor_parallel == 1


@pytest.mark.parametrize("date", sorted(p.name[len("fidelity_tp_runs_"):-len(".json.gz")]
                                        for p in RESULTS.glob("fidelity_tp_runs_*.json.gz")))
def test_the_committed_table_is_reproduced_from_its_kept_runs(date):
    """The committed measurements give the committed figures again (`reanalyse`, no runs)."""
    committed = json.loads((RESULTS / f"fidelity_tp_{date}.json").read_text())
    kept = RESULTS / f"fidelity_tp_runs_{date}.json.gz"
    again = reanalyse(kept, lambda line: None)
    for got, want in zip(again["cases"], committed["cases"], strict=True):
        assert got["label"] == want["label"]
        assert got["error"] == pytest.approx(want["error"], abs=1e-12)
        assert got["work_only_error"] == pytest.approx(want["work_only_error"], abs=1e-12)
        assert got["layer_alone_error"] == pytest.approx(want["layer_alone_error"], abs=1e-12)
    for model in ("work_only", "collectives", "layer_alone", "full", "controls"):
        assert again["summary"][model] == pytest.approx(committed["summary"][model], abs=1e-12), model
    assert gzip.decompress(kept.read_bytes())  # a real gzip file
