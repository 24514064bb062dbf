"""`attnres-pp train` end to end: a tiny local run writes its records; config mistakes are one
`error:` line and exit code 2."""

from __future__ import annotations

import json

import pytest

from attnres_pp.cli import main
from tests.run_helpers import summary

TINY = ["--layers", "2", "--d-model", "32", "--heads", "2", "--seq-len", "16", "--batch-size", "4",
        "--microbatches", "2"]


def test_train_writes_summary_and_metrics(tmp_path, capsys):
    out = tmp_path / "run"
    code = main(["train", "--launcher", "local", "--steps", "3", *TINY, "--residual", "lr_attnres",
                 "--key-mode", "sliced", "--key-rank", "4", "--block-size", "2", "--lr", "0.01",
                 "--seed", "3", "--eval-every", "2", "--out", str(out)])
    assert code == 0
    written = summary(out)
    for key in ("losses", "val_loss", "val_losses", "step_time_s", "tokens_per_s", "params", "config"):
        assert key in written, key
    assert len(written["losses"]) == 3 and written["params"] > 0
    config = written["config"]
    assert config["model"]["residual"] == "lr_attnres" and config["model"]["key_mode"] == "sliced"
    assert config["model"]["key_rank"] == 4 and config["train"]["seed"] == 3 and config["train"]["lr"] == 0.01
    assert config["pipeline"]["launcher"] == "local"
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 3 and json.loads(lines[-1])["step"] == 2
    printed = capsys.readouterr().out
    assert "step 3/3" in printed and "tok/s" in printed


def test_flags_override_the_toml_file(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text('[model]\nresidual = "standard"\nn_layers = 3\n[train]\nsteps = 50\n'
                      '[pipeline]\nlauncher = "local"\n')
    out = tmp_path / "run"
    assert main(["train", "--config", str(config), *TINY, "--steps", "2", "--quiet", "--out", str(out)]) == 0
    resolved = summary(out)["config"]
    assert resolved["model"]["residual"] == "standard"  # from the file
    assert resolved["model"]["n_layers"] == 2 and resolved["train"]["steps"] == 2  # flags win


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--batch-size", "10", "--microbatches", "4"], "TrainConfig.batch_size=10"),
        (["--steps", "0"], "TrainConfig.steps=0"),
        (["--lr", "-1"], "TrainConfig.lr=-1.0"),
        (["--residual", "bogus"], "ModelConfig.residual='bogus'"),
        (["--steps", "many"], "--steps 'many'"),
        (["--layer-counts", "1,x"], "--layer-counts '1,x' is invalid: expected comma-separated positive integers"),
        (["--data", "nowhere.txt"], "TrainConfig.data='nowhere.txt'"),
    ],
)
def test_config_errors_exit_2_with_one_line(tmp_path, capsys, argv, needle):
    code = main(["train", "--launcher", "local", *argv, "--out", str(tmp_path / "run")])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and needle in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_unknown_toml_key_exits_2(tmp_path, capsys):
    config = tmp_path / "run.toml"
    config.write_text("[train]\nbatchsize = 8\n")
    assert main(["train", "--config", str(config), "--launcher", "local", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "batchsize" in err and "batch_size" in err


def test_bin_data_larger_than_the_vocabulary_exits_2(tmp_path, capsys):
    import numpy as np

    path = tmp_path / "tokens.bin"
    np.arange(2000, dtype=np.uint16).tofile(path)
    assert main(["train", "--launcher", "local", "--data", str(path), *TINY, "--out", str(tmp_path / "r")]) == 2
    assert "vocab_size >= 2000" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [["--launcher", "local", "--stages", "2"], ["--launcher", "ray"], ["--launcher", "local", "--virtual", "2"]],
)
def test_only_one_local_chunk_trains_in_this_process(tmp_path, monkeypatch, capsys, argv):
    """Everything but stages = virtual = 1 with the local launcher goes to the pipeline engine."""
    import attnres_pp.train.engines as launch

    calls = []

    def refuse(run_cfg, out_dir=None, **options):
        calls.append((run_cfg.pipeline, out_dir))
        raise ValueError("stub engine refused")

    piped = []  # the one-process run (one rank in this process) never asks for the launcher's ranks
    pipeline_engine = launch.make_pipeline_engine
    monkeypatch.setattr(launch, "Engine", refuse)
    monkeypatch.setattr(launch, "make_pipeline_engine", lambda *a, **k: piped.append(1) or pipeline_engine(*a, **k))
    assert main(["train", *argv, *TINY, "--out", str(tmp_path / "run")]) == 2
    assert "stub engine refused" in capsys.readouterr().err
    assert piped == [1] and len(calls) == 1 and str(calls[0][1]) == str(tmp_path / "run")
