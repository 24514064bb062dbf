"""Resume after a crash keeps the run's settings: the driver is SIGKILLed while it writes a
checkpoint (the ATTNRES_PP_KILL_DURING_CHECKPOINT rehearsal hook), `--resume RUN` alone removes the
interrupted save, ends with the undisturbed run's losses and goes on saving checkpoints; flags given
with `--resume` override the saved settings."""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path

import numpy as np
import pytest
import torch

from attnres_pp.cli import build_parser, main
from attnres_pp.train.checkpoint import latest_checkpoint
from attnres_pp.train.cli import build_run_config, checkpoint_config
from attnres_pp.train.config import RunConfig, TrainConfig
from attnres_pp.train.faults import KILL_DURING_CHECKPOINT
from tests.run_helpers import assert_same_losses, metrics, summary

from .forked_cli import run_forked

TINY = ["--layers", "4", "--d-model", "32", "--heads", "2", "--seq-len", "16", "--batch-size", "4",
        "--microbatches", "2", "--eval-every", "3", "--steps", "8"]
# Non-default cadence and restart limit, so the resumed run can only have them from the checkpoint.
SETTINGS = ["--checkpoint-every", "2", "--max-restarts", "1"]


@pytest.mark.parametrize(
    "split",
    [
        pytest.param(["--launcher", "local", "--stages", "1", "--virtual", "1"], id="single-process"),
        pytest.param(["--launcher", "inprocess", "--stages", "2", "--virtual", "1"], id="pipelined"),
    ],
)
@pytest.mark.subprocess
def test_sigkill_during_a_checkpoint_then_resume_alone(tmp_path, split, capsys):
    """The crash is a child process (a fork of this one) SIGKILLed mid-save; the resume, from what it left on disk and
    `--resume` alone, runs the CLI's main in this process."""
    clean, run = tmp_path / "clean", tmp_path / "run"
    assert main(["train", *split, *TINY, "--quiet", "--out", str(clean)]) == 0

    crashed = run_forked([*split, *TINY, *SETTINGS, "--quiet", "--out", str(run)], **{KILL_DURING_CHECKPOINT: "4"})
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    root = run / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step_2", "step_4.tmp"]
    assert list((root / "step_4.tmp").glob("*.distcp")) and not (root / "step_4.tmp" / "meta.json").exists()

    capsys.readouterr()
    status = main(["train", "--resume", str(run)])
    resumed = capsys.readouterr()
    assert status == 0, resumed.err
    assert "removed step_4.tmp" in resumed.out
    assert (f"resuming from {root / 'step_2'} (continuing at step 3; checkpoint every 2 steps and at the end, "
            "keep 2, max restarts 1, eval every 3 steps, data builtin)") in resumed.out
    # Saving went on after the crash (--keep-checkpoints 2 leaves the newest two, the final step_8 among
    # them), and nothing stale is left.
    assert sorted(p.name for p in root.iterdir()) == ["step_6", "step_8"]
    meta = json.loads((root / "step_8" / "meta.json").read_text())
    assert meta["checkpointing"] == {"every": 2, "final": True, "max_restarts": 1, "async_save": False}
    assert meta["final"]

    got, want = summary(run), summary(clean)
    assert got["config"] == want["config"]  # model, train (eval cadence, data) and pipeline restored
    assert len(got["losses"]) == len(want["losses"]) == 8
    assert_same_losses(got["losses"], want["losses"])
    assert [entry[0] for entry in got["val_losses"]] == [entry[0] for entry in want["val_losses"]] == [2, 5, 7]


def write_checkpoint_meta(run_dir: Path, checkpointing: dict | None) -> None:
    """A step_2 folder with only meta.json: enough for the CLI's resume path to read the settings."""
    step_dir = run_dir / "checkpoints" / "step_2"
    step_dir.mkdir(parents=True)
    config = RunConfig(train=TrainConfig(steps=6, eval_every=3, data="corpus.txt")).to_dict()
    meta = {"format": 1, "steps_done": 2, "config": config, "losses": [5.0, 4.9], "step_times": [0.1, 0.1],
            "val_losses": [], "extras": {}, "restarts": 0}
    if checkpointing is not None:
        meta["checkpointing"] = checkpointing
    (step_dir / "meta.json").write_text(json.dumps(meta))


@pytest.mark.parametrize(
    ("flags", "every", "max_restarts", "eval_every", "data"),
    [
        ([], 2, 1, 3, "corpus.txt"),
        (["--checkpoint-every", "5", "--max-restarts", "0"], 5, 0, 3, "corpus.txt"),
        (["--checkpoint-every", "0"], 0, 1, 3, "corpus.txt"),  # 0 turns saving off, it is not "unset"
        (["--eval-every", "1", "--data", "other.txt"], 2, 1, 1, "other.txt"),
    ],
)
def test_resume_flags_override_the_saved_settings(tmp_path, flags, every, max_restarts, eval_every, data):
    write_checkpoint_meta(tmp_path, {"every": 2, "max_restarts": 1})
    args = build_parser().parse_args(["train", "--resume", str(tmp_path), *flags])
    ckpt, run_cfg = checkpoint_config(args), build_run_config(args)
    assert (ckpt.resume, ckpt.every, ckpt.max_restarts) == (True, every, max_restarts)
    assert (run_cfg.train.eval_every, run_cfg.train.data, run_cfg.train.steps) == (eval_every, data, 6)


def test_checkpoints_without_saved_settings_resume_with_the_defaults(tmp_path):
    write_checkpoint_meta(tmp_path, None)  # written before meta.json had a "checkpointing" table
    assert latest_checkpoint(tmp_path).name == "step_2"
    ckpt = checkpoint_config(build_parser().parse_args(["train", "--resume", str(tmp_path)]))
    assert (ckpt.every, ckpt.max_restarts) == (0, 3)


def test_unknown_saved_settings_and_a_bad_kill_hook_exit_2_with_one_line(tmp_path, capsys, monkeypatch):
    write_checkpoint_meta(tmp_path / "run", {"every": 2, "keep": 5})
    assert main(["train", "--resume", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "checkpoint settings ['keep'] are unknown" in err and len(err.strip().splitlines()) == 1

    monkeypatch.setenv(KILL_DURING_CHECKPOINT, "soon")
    assert main(["train", "--launcher", "local", *TINY, "--out", str(tmp_path / "fresh")]) == 2
    err = capsys.readouterr().err
    assert f"{KILL_DURING_CHECKPOINT}='soon' is invalid" in err and len(err.strip().splitlines()) == 1


def _interrupted_copy(run: Path, again: Path, steps_done: int) -> None:
    """`again` as a run stopped after checkpoint step_{steps_done} would have left it."""
    shutil.copytree(run / "checkpoints" / f"step_{steps_done}", again / "checkpoints" / f"step_{steps_done}")
    lines = (run / "metrics.jsonl").read_text().splitlines(True)[:steps_done]
    (again / "metrics.jsonl").write_text("".join(lines))


SMALL = ["--layers", "2", "--d-model", "16", "--heads", "2", "--seq-len", "16", "--batch-size", "4",
         "--microbatches", "2", "--eval-every", "0", "--steps", "4", "--checkpoint-every", "2", "--quiet"]


def test_another_batch_size_at_resume_continues_at_the_step_and_counts_its_tokens(tmp_path):
    """Resumed from step_2 with --batch-size 8, steps 3 and 4 read batch 2 and 3 of the stream at 8
    rows (the twin below feeds exactly those), and tokens_seen adds 4 and then 8 sequences a step."""
    from attnres_pp.train.engines import make_engine
    from attnres_pp.train.optim import lr_at

    run, again = tmp_path / "run", tmp_path / "again"
    assert main(["train", "--launcher", "local", *SMALL, "--out", str(run)]) == 0
    _interrupted_copy(run, again, 2)
    assert main(["train", "--resume", str(again), "--batch-size", "8", "--quiet"]) == 0
    got, first = summary(again), summary(run)
    assert got["losses"][:2] == first["losses"][:2]
    assert got["tokens_seen"] == (2 * 4 + 2 * 8) * 16 and first["tokens_seen"] == 4 * 4 * 16
    records = metrics(again)
    assert [r["tokens_seen"] for r in records] == [64, 128, 256, 384]
    position = json.loads((again / "checkpoints" / "step_4" / "meta.json").read_text())["data_position"]
    assert {k: position[k] for k in ("next_step", "seed", "sequences_seen", "tokens_seen")} == {
        "next_step": 4, "seed": 0, "sequences_seen": 24, "tokens_seen": 384}
    # Each replica's position is recorded for the batch the resumed run reads.
    assert position["batch_size"] == 8 and position["replicas"] == [{"dp_rank": 0, "rows": [0, 8], "next_step": 4}]

    run_cfg = RunConfig.from_dict(json.loads((again / "checkpoints" / "step_4" / "meta.json").read_text())["config"])
    assert run_cfg.train.batch_size == 8
    twin = make_engine(run_cfg)
    try:
        twin.load_checkpoint(run / "checkpoints" / "step_2")
        want = [twin.train_step(step, None, None, lr_at(step, run_cfg.train)).loss for step in (2, 3)]
    finally:
        twin.close()
    assert_same_losses(got["losses"][2:], want, rtol=1e-6)


def test_another_data_parallel_at_resume_keeps_the_stream_and_the_tokens(tmp_path):
    """The global batch is split over the replicas by rows: resumed at D = 2 from a D = 1 checkpoint
    (P = 2, in-process ranks), the run ends with the uninterrupted D = 1 run's losses and tokens."""
    split = ["--launcher", "inprocess", "--stages", "2", "--virtual", "1"]
    run, again = tmp_path / "run", tmp_path / "again"
    assert main(["train", *split, *SMALL, "--out", str(run)]) == 0
    _interrupted_copy(run, again, 2)
    assert main(["train", "--resume", str(again), "--data-parallel", "2", "--quiet"]) == 0
    got, want = summary(again), summary(run)
    assert got["config"]["pipeline"]["data_parallel"] == 2 and want["config"]["pipeline"]["data_parallel"] == 1
    assert_same_losses(got["losses"], want["losses"])
    assert got["tokens_seen"] == want["tokens_seen"] == 4 * 4 * 16


def test_another_seed_at_resume_is_refused(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "--launcher", "local", *SMALL, "--steps", "2", "--out", str(run)]) == 0
    assert main(["train", "--resume", str(run), "--steps", "4", "--seed", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --seed 1 differs from the checkpoint's seed 0") and len(err.strip().splitlines()) == 1


def test_a_larger_batch_of_a_step_begins_with_the_smaller_batch():
    """What lets a resume change --batch-size and stay on the stream: batch `step` at 8 rows starts
    with that step's 4 rows (each row's start is drawn in order from the step's generator)."""
    from attnres_pp.data import batch_at

    tokens_N = np.arange(5000, dtype=np.int64) % 251
    for step in (0, 3, 17):
        small, large = batch_at(tokens_N, step, 4, 16, 0), batch_at(tokens_N, step, 8, 16, 0)
        assert all(torch.equal(s, big[:4]) for s, big in zip(small, large, strict=True))
        assert not torch.equal(large[0][4:], batch_at(tokens_N, step + 1, 4, 16, 0)[0])
