"""`attnres-pp bench memory --predict`: the simulator's memory against a real run's counted
`memory_per_rank` (skipped, with the reason, on a tree whose runs do not count memory yet)."""

from __future__ import annotations

import statistics

import pytest

from attnres_pp.bench.memory_predict import CASES, compare, measure_case, predict_argv, train_argv
from attnres_pp.cli import build_parser


def _rank(**values) -> dict:
    base = {"param_bytes": 100, "grad_bytes": 100, "optimizer_bytes": 204, "activation_peak_bytes": 1000,
            "cache_peak_bytes": 0}
    return base | values


def test_compare_reports_exact_mismatches_and_relative_errors():
    result = compare([_rank(), _rank(activation_peak_bytes=1100)],
                     [_rank(optimizer_bytes=200), _rank(activation_peak_bytes=1000)])
    assert result["mismatches"] == ["rank 0 optimizer_bytes: predicted 204 counted 200"]
    assert result["errors"]["activation_peak_bytes"] == [0.0, pytest.approx(0.1)]
    with pytest.raises(ValueError, match="2 predicted ranks but 1 counted"):
        compare([_rank(), _rank()], [_rank()])


@pytest.mark.parametrize("name,case", CASES)
def test_every_case_is_a_valid_prediction_command(name, case, tmp_path):
    from attnres_pp.bench.memory_predict import case_flags

    flags = case_flags(case)
    parser = build_parser(["simulate"])
    parser.parse_args(predict_argv(flags))
    _train_args, unknown = build_parser(["train"]).parse_known_args(train_argv(flags, tmp_path))
    assert {a for a in unknown if a.startswith("--")} <= {"--dp-shard", "--activation-checkpoint"}


@pytest.mark.parametrize("index", [1, 3, 4, 9, 11])
def test_prediction_matches_hook_counts_of_a_real_step(index):
    """The runtime's own step (loopback, every rank in this process) counted by saved-tensor hooks."""
    name, case = CASES[index]
    (row,) = measure_case(name, case, progress=lambda line: None, runs=False)
    assert row["counted_by"] == "hooks"
    assert row["mismatches"] == []
    for key, errors in row["errors"].items():
        assert statistics.median(errors) <= 0.05 and max(errors) <= 0.10, (key, errors)


def test_prediction_matches_a_real_run():
    rows = measure_case(*CASES[1], progress=lambda line: None)
    row = next(r for r in rows if r["counted_by"] == "run")
    if "skipped" in row:
        pytest.skip(row["skipped"] + ": run `attnres-pp bench memory --predict` once runs write it")
    assert row["mismatches"] == []
    for key, errors in row["errors"].items():
        assert statistics.median(errors) <= 0.05 and max(errors) <= 0.10, (key, errors)
