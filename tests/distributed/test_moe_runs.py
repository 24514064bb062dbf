"""Mixtures of experts from the command line: the flags reach the model and its checkpoint, the
expert loads reach summary.json and metrics.jsonl, the aux-free bias moves the same on every
replica as in one process (it is summed over the data-parallel group) and resumes from a
checkpoint."""

from __future__ import annotations

import shutil

import pytest

from attnres_pp.cli import main
from attnres_pp.model import ModelConfig
from attnres_pp.model.transformer import active_parameter_count, parameter_count
from tests.run_helpers import assert_same_losses, losses, metrics, summary

pytestmark = pytest.mark.distributed  # rank processes of the local launcher

TINY = ["--layers", "3", "--d-model", "16", "--heads", "2", "--seq-len", "8", "--batch-size", "4", "--microbatches",
        "2", "--quiet", "--moe-experts", "4", "--moe-top-k", "2", "--moe-shared-experts", "1", "--moe-d-ff", "8",
        "--moe-dense-layers", "1"]
# A large bias step, so that a bias moved from other loads than the global batch's routes otherwise.
STRONG_BIAS = ["--moe-bias-gamma", "0.5"]


def test_the_aux_free_bias_moves_alike_on_every_replica_and_as_in_one_process(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    assert main(["train", *TINY, *STRONG_BIAS, "--steps", "4", "--launcher", "local", "--out", str(one)]) == 0
    assert main(["train", *TINY, *STRONG_BIAS, "--steps", "4", "--launcher", "local", "--data-parallel", "2",
                 "--stages", "2", "--out", str(two)]) == 0
    assert_same_losses(losses(two), losses(one), what="D2 x P2 against one process")
    model = summary(one)["config"]["model"]
    assert summary(one)["active_params"] == active_parameter_count(ModelConfig.from_dict(model))
    assert summary(one)["active_params"] < summary(one)["params"] == parameter_count(ModelConfig.from_dict(model))
    assert (model["moe_experts"], model["moe_top_k"], model["moe_shared_experts"], model["moe_dense_layers"]) == (
        4, 2, 1, 1)
    for run in (one, two):
        loads = summary(run)["moe_expert_loads"]
        assert sorted(loads) == ["1", "2"] and all(sum(per_expert) == 4 * 8 * 2 for per_expert in loads.values())
        step = metrics(run)[-1]
        assert step["moe_load_max_over_mean"] == max(step["moe_load_max_over_mean/1"], step["moe_load_max_over_mean/2"])


def test_a_resumed_moe_run_ends_as_the_uninterrupted_one(tmp_path):
    """The selection bias moves every step and decides the routing: only a checkpoint that carries it
    resumes to the same losses."""
    run, again = tmp_path / "run", tmp_path / "again"
    assert main(["train", *TINY, *STRONG_BIAS, "--steps", "4", "--checkpoint-every", "2", "--launcher", "local",
                 "--stages", "2", "--out", str(run)]) == 0
    shutil.copytree(run / "checkpoints" / "step_2", again / "checkpoints" / "step_2")
    (again / "metrics.jsonl").write_text("".join((run / "metrics.jsonl").read_text().splitlines(True)[:2]))
    assert main(["train", "--resume", str(again), "--quiet"]) == 0
    assert_same_losses(losses(again), losses(run))
