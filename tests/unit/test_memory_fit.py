"""The training-state bound `train` checks before it builds a model (train/memory_fit.py)."""

from __future__ import annotations

import pytest

from attnres_pp.model.transformer import parameter_count
from attnres_pp.train.config import RunConfig
from attnres_pp.train.memory_fit import TRAINING_BYTES_PER_PARAMETER, check_training_fits


def _run(launcher: str = "local") -> RunConfig:
    return RunConfig.from_dict({"model": {"n_layers": 2, "d_model": 32, "n_heads": 2, "seq_len": 16},
                                "pipeline": {"launcher": launcher}})


def test_the_bound_is_sixteen_bytes_a_parameter_and_refuses_one_byte_short(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    cfg = _run()
    needed = parameter_count(cfg.model) * TRAINING_BYTES_PER_PARAMETER
    check_training_fits(cfg, address=None, memory_bytes=needed)  # exactly enough: accepted
    with pytest.raises(ValueError, match=r"^--d-model 32 --layers 2 .* choose a smaller --d-model"):
        check_training_fits(cfg, address=None, memory_bytes=needed - 1)


def test_a_ray_cluster_is_not_checked_against_this_machine(monkeypatch):
    cfg = _run("ray")
    check_training_fits(cfg, address="10.0.0.1:6379", memory_bytes=1)  # its hosts' memory is not ours to see
    monkeypatch.setenv("RAY_ADDRESS", "auto")
    check_training_fits(cfg, address=None, memory_bytes=1)
    monkeypatch.delenv("RAY_ADDRESS")
    with pytest.raises(ValueError):  # Ray's private instance runs the ranks here
        check_training_fits(cfg, address=None, memory_bytes=1)
