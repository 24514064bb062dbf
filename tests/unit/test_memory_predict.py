"""`attnres-lab memory-predict`: the simulator's memory against a real run's counted
`memory_per_rank` (skipped, with the reason, on a tree whose runs do not count memory yet)."""

from __future__ import annotations

import statistics

import pytest

from attnres_lab.memory_predict import CASES, compare, measure_case, predict_argv, train_argv
from attnres_pp.cli import build_parser

from .lab_train_here import lab_runs_here  # noqa: F401 - a fixture


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
    from attnres_lab.memory_predict import case_flags

    flags = case_flags(case)
    parser = build_parser(["simulate"])
    parser.parse_args(predict_argv(flags))
    _train_args, unknown = build_parser(["train"]).parse_known_args(train_argv(flags, tmp_path))
    assert {a for a in unknown if a.startswith("--")} <= {"--dp-shard", "--activation-checkpoint"}


def test_fsdp_cases_run_on_every_launcher_but_the_in_process_one():
    from attnres_lab.memory_predict import ALL_LAUNCHERS, RAY_CASES, case_flags, launchers_of

    assert launchers_of(case_flags(_case("D=2 fsdp zb_h1 S=2")[1]), ALL_LAUNCHERS) == ("local", "ray")
    assert launchers_of(case_flags(_case("zbv lr_attnres")[1]), ALL_LAUNCHERS) == ALL_LAUNCHERS
    assert set(RAY_CASES) <= {name for name, _case_flags in CASES}  # a renamed case would drop its Ray row


def _case(name: str) -> tuple[str, dict]:
    return next((n, c) for n, c in CASES if n == name)


@pytest.mark.parametrize("name", ["interleaved V=2 S=2", "interleaved_zb full AttnRes", "zbv lr_attnres",
                                  "bf16 interleaved_zb S=2", "D=2 replicate P=4 V=2", "AC full 1f1b",
                                  "AC selective zb_h1",
                                  # Chunks of two layers under a split backward: I peaks while the
                                  # first is recomputed beside the second's W store (`input_peak_bytes`).
                                  "AC full interleaved_zb lr_attnres",
                                  "AC selective 1f1b msar", "AC full zbv standard bf16",
                                  "AC selective interleaved full AttnRes", "dualpipev attnres S=2",
                                  "AC selective dualpipev msar",
                                  # A rank's second chunk reads cached blocks its first chunk's
                                  # frames keep: one storage, counted once (`shared_cache_bytes`).
                                  "AC full interleaved V=2 P-LR S=2 seq 64",
                                  "AC selective zbv S-LR sliced bf16 m=6 seq 48", "AC full 1f1b msar S=4 m=3 seq 56",
                                  "interleaved V=4 attnres S=4 seq 48",
                                  # The layer recipe: grouped / multi-query kv heads, QK-norm, tied
                                  # embeddings, the legacy learned positions and GELU.
                                  "1f1b GQA kv=2 qk-norm", "zbv MQA tied S=2", "legacy recipe interleaved S=2",
                                  "AC full GQA qk-norm bf16 zb_h1", "AC selective gelu MQA interleaved_zb P-LR"])
def test_prediction_matches_hook_counts_of_a_real_step(name):
    """The runtime's own step (loopback, every rank in this process, the case's checkpointing
    policy) counted by the runtime's meter."""
    name, case = _case(name)
    (row,) = measure_case(name, case, progress=lambda line: None, runs=False)
    assert row["counted_by"] == "hooks"
    assert row["mismatches"] == []
    for key, errors in row["errors"].items():
        assert statistics.median(errors) <= 0.05 and max(errors) <= 0.10, (key, errors)


@pytest.mark.usefixtures("lab_runs_here")
def test_prediction_matches_a_real_run():
    rows = measure_case(*CASES[1], progress=lambda line: None, launchers=("inprocess",))
    row = next(r for r in rows if r["counted_by"] == "run inprocess")
    if "skipped" in row:
        pytest.skip(row["skipped"] + ": run `attnres-lab memory-predict` once runs write it")
    assert row["mismatches"] == []
    for key, errors in row["errors"].items():
        assert statistics.median(errors) <= 0.05 and max(errors) <= 0.10, (key, errors)


@pytest.mark.distributed
@pytest.mark.usefixtures("lab_runs_here")
def test_prediction_matches_a_real_fsdp_run_with_checkpointing():
    """FSDP2 over 2 replicas (the local launcher's processes) and full checkpointing: the activation
    term holds the all-gathered parameters the forwards save."""
    rows = measure_case(*_case("D=2 fsdp AC full 1f1b"), progress=lambda line: None)
    (row,) = rows
    assert row["counted_by"] == "run local" and "skipped" not in row, row.get("skipped")
    assert row["mismatches"] == []
    for key, errors in row["errors"].items():
        assert statistics.median(errors) <= 0.05 and max(errors) <= 0.10, (key, errors)
