"""The trained model is always on disk: a run saves its last step (unless --no-final-checkpoint),
`generate --resume RUN` reads exactly those weights, `--resume RUN --steps N2` extends a finished
run, `--keep-checkpoints` bounds what stays without ever deleting a final checkpoint, and the
settings survive a resume. All in the single-process engine, on a tiny model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from attnres_pp.cli import main
from attnres_pp.train import cli as train_cli
from attnres_pp.train.checkpoint import latest_checkpoint, read_meta
from attnres_pp.train.shards import read_parameters
from tests.run_helpers import assert_same_losses, metrics, summary

TINY = ["--launcher", "local", "--layers", "2", "--d-model", "16", "--heads", "2", "--seq-len", "16",
        "--batch-size", "4", "--microbatches", "2", "--eval-every", "0", "--quiet"]


def step_dirs(run: Path) -> list[str]:
    root = run / "checkpoints"
    return sorted((p.name for p in root.iterdir()), key=lambda n: int(n.split("_")[1])) if root.is_dir() else []


@pytest.fixture
def captured_engines(monkeypatch) -> list:
    """The engines `attnres-pp train` builds, kept after the run so a test can read the trained model."""
    engines, make = [], train_cli.make_run_engine
    monkeypatch.setattr(train_cli, "make_run_engine", lambda *a, **k: engines.append(make(*a, **k)) or engines[-1])
    return engines


def test_generate_reads_the_weights_of_the_last_step(tmp_path, captured_engines, capsys):
    """A default run (no --checkpoint-every) keeps step_3, holding exactly the parameters the model
    has after its last step (not step_2's), and `generate --resume RUN` loads it: it names step_3
    and its greedy tokens are the trained in-memory model's."""
    run = tmp_path / "run"
    assert main(["train", *TINY, "--steps", "3", "--keep-checkpoints", "0", "--checkpoint-every", "2",
                 "--out", str(run)]) == 0
    assert step_dirs(run) == ["step_2", "step_3"]
    assert summary(run)["final_checkpoint"] == str(run / "checkpoints" / "step_3")
    trained = {name: p.detach().clone() for name, p in captured_engines[0].model.named_parameters()}
    final, earlier = read_parameters(run / "checkpoints" / "step_3"), read_parameters(run / "checkpoints" / "step_2")
    assert set(final) == set(trained)
    for name, value in trained.items():
        assert torch.equal(final[name], value), name
    assert any(not torch.equal(earlier[name], value) for name, value in trained.items())
    meta = read_meta(run / "checkpoints" / "step_3")
    assert meta["final"] and meta["steps_done"] == 3
    assert meta["data_position"] == {"next_step": 3, "seed": 0, "sequences_seen": 12, "tokens_seen": 192,
                                     "data": "builtin", "tokenizer": "bytes", "tokenizer_sha256": "bytes",
                                     "batch_size": 4, "replicas": [{"dp_rank": 0, "rows": [0, 4], "next_step": 3}]}

    assert main(["generate", "--resume", str(run), "--prompt", "def ", "--max-new-tokens", "6",
                 "--temperature", "0", "--json"]) == 0
    payload = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert payload["checkpoint"] == str(run / "checkpoints" / "step_3")
    model, ids = captured_engines[0].model.eval(), list(b"def ")
    with torch.no_grad():
        for _ in range(6):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    assert payload["tokens"] == ids[4:]


def test_a_cadence_dividing_the_steps_saves_the_last_step_once(tmp_path):
    run = tmp_path / "run"
    assert main(["train", *TINY, "--steps", "4", "--checkpoint-every", "4", "--out", str(run)]) == 0
    assert step_dirs(run) == ["step_4"]  # before: no checkpoint at all (saves stopped short of the last step)
    assert read_meta(run / "checkpoints" / "step_4")["final"]


def test_no_final_checkpoint_is_kept_at_resume_and_can_be_turned_back_on(tmp_path):
    run = tmp_path / "run"
    assert main(["train", *TINY, "--steps", "3", "--no-final-checkpoint", "--out", str(run)]) == 0
    assert step_dirs(run) == [] and summary(run)["final_checkpoint"] is None
    assert main(["train", *TINY, "--steps", "3", "--no-final-checkpoint", "--checkpoint-every", "2",
                 "--out", str(tmp_path / "periodic")]) == 0
    periodic = tmp_path / "periodic"
    assert step_dirs(periodic) == ["step_2"]
    assert read_meta(periodic / "checkpoints" / "step_2")["checkpointing"] == {
        "every": 2, "final": False, "async_save": False, "max_restarts": 3}
    assert main(["train", "--resume", str(periodic), "--steps", "5", "--quiet"]) == 0
    assert step_dirs(periodic) == ["step_2", "step_4"]  # the saved "no final" held: no step_5
    assert main(["train", "--resume", str(periodic), "--steps", "7", "--final-checkpoint", "--quiet"]) == 0
    assert step_dirs(periodic) == ["step_6", "step_7"]
    assert read_meta(periodic / "checkpoints" / "step_7")["checkpointing"]["final"] is True


def test_keep_checkpoints_bounds_the_folders_but_never_deletes_a_final_one(tmp_path):
    run = tmp_path / "run"
    assert main(["train", *TINY, "--steps", "4", "--checkpoint-every", "1", "--keep-checkpoints", "1",
                 "--out", str(run)]) == 0
    assert step_dirs(run) == ["step_4"]
    # The setting is saved with the config; extending the run keeps leg one's final step_4.
    assert main(["train", "--resume", str(run), "--steps", "7", "--quiet"]) == 0
    assert step_dirs(run) == ["step_4", "step_7"]
    assert read_meta(run / "checkpoints" / "step_7")["config"]["train"]["keep_checkpoints"] == 1

    every = tmp_path / "all"
    toml = tmp_path / "keep.toml"
    toml.write_text("[train]\nkeep_checkpoints = 0\n")
    assert main(["train", *TINY, "--config", str(toml), "--steps", "3", "--checkpoint-every", "1",
                 "--out", str(every)]) == 0
    assert step_dirs(every) == ["step_1", "step_2", "step_3"]


def test_resume_extends_a_finished_run_to_the_uninterrupted_losses(tmp_path):
    """`--resume RUN --steps 6` after a finished 3-step run ends with the losses of a 6-step run. The
    schedule is flat after a 1-step warmup (min_lr_ratio = 1), so both runs train their first three
    steps at the same rates: under a decaying schedule the first leg would have decayed already."""
    toml = tmp_path / "flat.toml"
    toml.write_text("[train]\nmin_lr_ratio = 1.0\nwarmup_steps = 1\n")
    flat = [*TINY, "--config", str(toml)]
    assert main(["train", *flat, "--steps", "6", "--out", str(tmp_path / "whole")]) == 0
    run = tmp_path / "run"
    assert main(["train", *flat, "--steps", "3", "--out", str(run)]) == 0
    assert main(["train", "--resume", str(run), "--steps", "6", "--quiet"]) == 0
    got, want = summary(run), summary(tmp_path / "whole")
    assert_same_losses(got["losses"], want["losses"])
    assert got["val_loss"] == pytest.approx(want["val_loss"], rel=1e-5)
    assert got["tokens_seen"] == want["tokens_seen"] == 6 * 4 * 16
    assert step_dirs(run) == ["step_3", "step_6"] and latest_checkpoint(run).name == "step_6"
    records = metrics(run)
    assert [r["step"] for r in records] == list(range(6))


@pytest.mark.parametrize("steps", ["3", "2"])
def test_resume_with_no_steps_left_says_so_and_keeps_the_run(tmp_path, capsys, monkeypatch, steps):
    run = tmp_path / "run"
    assert main(["train", *TINY, "--steps", "3", "--out", str(run)]) == 0
    before = {name: (run / name).read_bytes() for name in ("summary.json", "metrics.jsonl")}
    capsys.readouterr()

    def no_engine(*_args, **_kwargs):
        raise AssertionError("a run with nothing to do started an engine")

    monkeypatch.setattr(train_cli, "make_run_engine", no_engine)
    assert main(["train", "--resume", str(run), "--steps", steps]) == 0
    out = capsys.readouterr().out
    assert f"nothing to do: {run / 'checkpoints' / 'step_3'} has 3 steps done and --steps {steps}" in out
    assert "the run's summary, kept: 3 steps, loss" in out
    assert {name: (run / name).read_bytes() for name in before} == before


def test_resume_with_nothing_to_do_and_no_summary(tmp_path, capsys):
    """A run that stopped after its step_2 checkpoint (no summary.json) and is asked for 2 steps."""
    run = tmp_path / "run"
    assert main(["train", *TINY, "--steps", "3", "--checkpoint-every", "2", "--out", str(run)]) == 0
    again = tmp_path / "again"
    shutil.copytree(run / "checkpoints" / "step_2", again / "checkpoints" / "step_2")
    capsys.readouterr()
    assert main(["train", "--resume", str(again), "--steps", "2"]) == 0
    assert "no readable" in capsys.readouterr().out and not (again / "summary.json").exists()
