"""A bad mixture-of-experts option from the command line is one `error:` line, exit 2, nothing
written (the runs themselves: tests/distributed/test_moe_runs.py)."""

from __future__ import annotations

import pytest

from attnres_pp.cli import main
from tests.distributed.test_moe_runs import TINY


@pytest.mark.parametrize(("argv", "needle"), [
    (["--moe-top-k", "5"], "ModelConfig.moe_top_k=5 is invalid: must be in 1..4"),
    (["--moe-d-ff", "0"], "--moe-d-ff 0 is invalid: each expert needs a hidden width >= 1"),
    (["--moe-dense-layers", "3"], "ModelConfig.moe_dense_layers=3 is invalid: must be in 0..2"),
    (["--moe-router", "relu"], "ModelConfig.moe_router='relu' is invalid: choose one of softmax, sigmoid"),
    (["--moe-balance", "capacity"], "ModelConfig.moe_balance='capacity' is invalid: choose one of aux_free"),
    (["--moe-experts", "-1"], "ModelConfig.moe_experts=-1 is invalid"),
    (["--moe-aux-loss-coef", "nan"], "ModelConfig.moe_aux_loss_coef=nan is invalid"),
])
def test_a_bad_moe_option_is_one_error_line_and_nothing_written(tmp_path, capsys, argv, needle):
    out = tmp_path / "run"
    assert main(["train", *TINY, "--steps", "1", "--launcher", "local", *argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and needle in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1
    assert not out.exists()
