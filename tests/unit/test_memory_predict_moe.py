"""`simulate memory` against a real run of a mixture of experts under expert parallelism (EP = 2,
D = 2, P = 2, thread ranks in this process, their all-to-alls real): held bytes equal, activation
peaks within 5% median and 10% max on every rank, out of sample (`attnres-lab memory-predict
--moe`), and the all-to-all bytes summary.json reports equal to docs/spec.md section 12's rule."""

from __future__ import annotations

import json
import statistics

import pytest

from attnres_lab.memory_predict import EXACT_KEYS, case_flags, fitted_overlap, predict, train_argv
from attnres_lab.memory_predict_moe import CASES, rows_over_m
from attnres_pp.cli import main
from attnres_pp.simulator.moe import all_to_all_bytes


def test_moe_cases_are_out_of_sample_and_pair_ep_2_with_ep_1():
    assert fitted_overlap(CASES) == []
    flags = [case_flags(case) for _name, case in CASES]
    assert {f["expert_parallel"] for f in flags} == {1, 2} and {f["stages"] for f in flags} == {1, 2}
    assert all(f["data_parallel"] == 2 and f["d_model"] >= 64 and f["moe_dense_layers"] == 1 for f in flags)


def test_rows_over_m_reads_each_ranks_share_of_the_token_choices():
    # P = 2 over 8 layers: layers 1-3 on stage 0, 4-7 on stage 1; E = 4 over EP = 2.
    flags = {"expert_parallel": 2, "stages": 2, "data_parallel": 2, "layers": 8}
    loads = {"1": [3, 1, 2, 2], "2": [1, 1, 1, 1], "4": [0, 2, 3, 3], "5": [2, 2, 2, 2]}
    shares = rows_over_m(flags, loads)
    # global rank dp x P + pp: (dp 0, pp 0), (0, 1), (1, 0), (1, 1); dp 0 holds experts 0-1
    assert [s["max"] for s in shares] == [1.0, 1.0, 1.0, 1.5]
    assert [s["mean"] for s in shares] == [1.0, 0.75, 1.0, 1.25]
    assert rows_over_m({**flags, "expert_parallel": 1}, loads) == [None] * 4


def test_ep_2_prediction_matches_a_real_run_and_all_to_all_bytes_are_the_rule(tmp_path):
    """Every token goes to every expert (K = E), so each EP rank receives exactly the M rows the
    prediction assumes: the error is the model's, not the router's."""
    flags = case_flags(dict(CASES)["MoE EP=2 D=2 P=2 K=E balanced"])
    argv = train_argv(flags, tmp_path / "run", "inprocess")
    argv[argv.index("--steps") + 1] = "1"
    assert main(argv) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    prediction = predict(flags, "inprocess")
    counted, predicted = summary["memory_per_rank"], prediction["memory_per_rank"]
    assert len(counted) == len(predicted) == 4
    for real, mine in zip(counted, predicted, strict=True):
        assert [mine[k] for k in EXACT_KEYS] == [real[k] for k in EXACT_KEYS]
        assert mine["cache_peak_bytes"] == real["cache_peak_bytes"]
    errors = [abs(p["activation_peak_bytes"] - r["activation_peak_bytes"]) / r["activation_peak_bytes"]
              for p, r in zip(predicted, counted, strict=True)]
    assert statistics.median(errors) <= 0.05 and max(errors) <= 0.10, errors
    # every rank sends half its rows off itself, forward (dispatch, combine) and backward (their gradients)
    cfg, tokens = prediction["model"], flags["batch_size"] // flags["data_parallel"] // flags["microbatches"]
    moved = all_to_all_bytes(cfg, tokens=tokens * flags["seq_len"], expert_parallel=2, dtype="fp32")
    per_step = flags["data_parallel"] * flags["microbatches"] * cfg.n_moe_layers * 2 * moved.off_rank_forward_bytes
    assert summary["expert_all_to_all_bytes_per_step"] == pytest.approx(per_step, rel=0, abs=0)
