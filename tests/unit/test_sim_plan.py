"""`attnres-pp simulate plan`: every row fits and rows come fastest first, the top row's command
parses with `attnres-pp train`, an impossible request says what is short, and the 48-layer
d = 7168 model on 64 x 80 GiB is planned in under 10 s of CPU time at T = 1."""

from __future__ import annotations

import json
import shlex
import time

import pytest

from attnres_pp.cli import build_parser, main
from attnres_pp.model.config import ModelConfig
from attnres_pp.simulator.plan import GIB, Infeasible, PlanRequest, plan


def _small(**overrides) -> PlanRequest:
    cfg = ModelConfig(vocab_size=32000, n_layers=8, d_model=1024, n_heads=8, seq_len=2048, block_size=1)
    values = dict(model=cfg, global_batch=32, gpus=8, gpu_memory_gib=12.0, top=8)
    values.update(overrides)
    return PlanRequest(**values)


def test_rows_fit_and_are_fastest_first():
    request = _small()
    rows = plan(request)
    assert rows
    assert all(row["peak_memory_bytes"] <= request.gpu_memory_gib * GIB for row in rows)
    assert all(max(row["peak_memory_per_rank"]) == row["peak_memory_bytes"] for row in rows)
    times = [row["step_time_s"] for row in rows]
    assert times == sorted(times)
    for row in rows:
        config = row["config"]
        assert config["n_stages"] * config["data_parallel"] == request.gpus
        assert row["tokens_per_s_per_gpu"] == pytest.approx(32 * 2048 / row["step_time_s"] / 8)


def test_less_memory_forces_savings():
    roomy = plan(_small(gpu_memory_gib=200.0))[0]
    tight_request = _small(gpu_memory_gib=6.0)
    tight = plan(tight_request)[0]
    assert tight["peak_memory_bytes"] <= 6.0 * GIB < roomy["peak_memory_bytes"]
    assert tight["step_time_s"] >= roomy["step_time_s"]


def test_top_command_parses_with_train():
    row = plan(_small())[0]
    argv = shlex.split(row["command"])
    assert argv[:2] == ["attnres-pp", "train"]
    args, unknown = build_parser(argv[1:]).parse_known_args(argv[1:])
    assert not [a for a in unknown if a.startswith("--")]  # every flag the plan prints is one of `train`'s
    assert args.command == "train"


def test_infeasible_says_what_is_short():
    short = r"needs [\d.]+ GiB per rank at best \(.*\), over the 0.5 GiB given: add GPUs$"
    with pytest.raises(Infeasible, match=short):
        plan(_small(gpu_memory_gib=0.5))
    with pytest.raises(Infeasible, match=r"add GPUs or enable fsdp \(it needs D > 1\)$"):
        plan(_small(gpus=1, global_batch=1, gpu_memory_gib=1.0))


def test_cli_json_and_errors(capsys):
    argv = ["simulate", "plan", "--layers", "8", "--d-model", "1024", "--heads", "8", "--seq-len", "2048",
            "--vocab-size", "32000", "--global-batch", "32", "--gpus", "8", "--gpu-memory-gib", "12", "--top", "3",
            "--json"]
    assert main(argv) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert 1 <= len(rows) <= 3
    assert {"config", "step_time_s", "peak_memory_bytes", "command"} <= set(rows[0])
    assert main(argv[:-1] + ["--gpu-memory-gib", "0.5"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error: needs" in err
    assert main(argv[:12] + argv[14:]) == 2  # --global-batch missing
    assert "--global-batch is required" in capsys.readouterr().err


def test_plans_the_48_layer_model_within_10_s(capsys):
    argv = ["simulate", "plan", "--layers", "48", "--d-model", "7168", "--heads", "56", "--seq-len", "4096",
            "--vocab-size", "32000", "--global-batch", "512", "--gpus", "64", "--gpu-memory-gib", "80",
            "--tensor-parallel", "1"]  # the T search takes about four times as long (docs/simulator.md)
    started = time.process_time()
    assert main(argv) == 0
    assert time.process_time() - started < 10.0
    out = capsys.readouterr().out
    assert "attnres-pp train --layers 48" in out


def test_pruning_keeps_the_exact_optimum():
    """Against every candidate simulated exactly: the planner's top row is the fastest that fits."""
    from attnres_pp.simulator.plan import Planner, candidates

    request = _small(gpus=4, global_batch=16)
    planner = Planner(request)
    exact = [planner.evaluate(c) for c in candidates(request)]
    fitting = [row for row in exact if row["peak_memory_bytes"] <= request.gpu_memory_gib * GIB]
    assert len(fitting) < len(exact)  # the memory limit binds here
    best = min(row["step_time_s"] for row in fitting)
    assert plan(request)[0]["step_time_s"] == pytest.approx(best)
