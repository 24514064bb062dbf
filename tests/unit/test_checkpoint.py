"""Checkpoints and resume without Ray: atomic step folders, weights-only loading, resuming ends
with the same losses as an uninterrupted run (also in another launcher and split), the flags'
error lines, and the local launcher's recovery from a lost rank with no checkpoint yet."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest

from attnres_pp.cli import main
from attnres_pp.train.checkpoint import latest_checkpoint
from attnres_pp.train.metadata_pickle import CheckpointRefused
from attnres_pp.train.shards import checkpoint_tensors
from tests.run_helpers import REPO, assert_same_losses, losses, metrics, summary

TINY = ["--layers", "4", "--d-model", "32", "--heads", "2", "--seq-len", "16", "--batch-size", "4",
        "--microbatches", "2", "--eval-every", "3", "--quiet"]


def test_resume_continues_with_the_same_losses_in_any_launcher(tmp_path):
    """A 2x2 in-process pipeline saves step_2, step_4 and the final step_6 (keeping the newest two);
    resuming from step_4 in the same launcher, and in the single-process engine, ends exactly like
    the uninterrupted run."""
    run = tmp_path / "run"
    pipe = ["--launcher", "inprocess", "--stages", "2", "--virtual", "2"]
    assert main(["train", *TINY, *pipe, "--steps", "6", "--checkpoint-every", "2", "--out", str(run)]) == 0
    full = losses(run)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_4", "step_6"]
    assert latest_checkpoint(run).name == "step_6"
    meta = json.loads((run / "checkpoints" / "step_4" / "meta.json").read_text())
    assert meta["steps_done"] == 4 and meta["losses"] == full[:4] and not meta["final"]
    assert json.loads((run / "checkpoints" / "step_6" / "meta.json").read_text())["final"]

    for name, launcher in (("same", pipe), ("single", ["--launcher", "local", "--stages", "1", "--virtual", "1"])):
        again = tmp_path / name  # the run as an interruption after step 5 would have left it
        shutil.copytree(run / "checkpoints" / "step_4", again / "checkpoints" / "step_4")
        (again / "metrics.jsonl").write_text("".join((run / "metrics.jsonl").read_text().splitlines(True)[:5]))
        assert main(["train", "--resume", str(again), *launcher, "--quiet"]) == 0
        got = summary(again)
        assert_same_losses(got["losses"], full)
        assert got["restarts"] == 0 and got["config"]["train"]["steps"] == 6
        records = metrics(again)
        assert [r["step"] for r in records] == list(range(6))


def test_incomplete_checkpoints_are_ignored_and_loading_unpickles_only_checkpoint_data(tmp_path):
    run = tmp_path / "run"
    assert main(["train", *TINY, "--launcher", "local", "--steps", "2", "--checkpoint-every", "1",
                 "--out", str(run)]) == 0
    root = run / "checkpoints"
    assert latest_checkpoint(run).name == "step_2"
    (root / "step_9.tmp").mkdir()  # a save that crashed before its rename
    (root / "step_8").mkdir()  # a folder without meta.json, the commit marker, is not a checkpoint
    assert latest_checkpoint(run).name == "step_2"

    saved = checkpoint_tensors(root / "step_2")  # keyed by whole-model names
    assert {"embed.tok.weight", "optim.embed.tok.weight.exp_avg", "optim.embed.tok.weight.step",
            "rng.dp0.layers0:4"} <= set(saved)
    # DCP reads .metadata with plain pickle; ours admits checkpoint metadata only.
    (root / "step_2" / ".metadata").write_bytes(pickle.dumps(_Unpicklable()))
    with pytest.raises(CheckpointRefused, match="refusing to load"):
        checkpoint_tensors(root / "step_2")


class _Unpicklable:
    """An arbitrary class: checkpoint loading must refuse to rebuild it."""


@pytest.mark.distributed
def test_resume_reshards_into_another_split(tmp_path):
    """Two local rank processes (P = 2, V = 2) each write their own shard; the run resumes at P = 1 in
    one process and at D = 2, P = 2, V = 1 in four processes, and both end like the uninterrupted run
    (the saving run itself: the local launcher's losses are the in-process launcher's in
    `test_local_launcher_restarts_from_scratch_without_a_checkpoint`)."""
    data = tmp_path / "corpus.txt"
    data.write_text("".join(p.read_text() for p in sorted((REPO / "attnres_pp" / "train").glob("*.py"))))
    common = [*TINY, "--batch-size", "8", "--steps", "5", "--data", str(data)]
    run = tmp_path / "run"
    assert main(["train", *common, "--launcher", "local", "--stages", "2", "--virtual", "2", "--checkpoint-every", "2",
                 "--keep-checkpoints", "0", "--out", str(run)]) == 0
    want = summary(run)
    assert len(want["losses"]) == 5 and len(want["val_losses"]) >= 1
    shard_files = sorted(p.name for p in (run / "checkpoints" / "step_4").glob("*.distcp"))
    assert shard_files == ["__0_0.distcp", "__1_0.distcp"]  # each rank wrote its own part

    for name, split in (("p1", ["--launcher", "inprocess", "--stages", "1", "--virtual", "1"]),
                        ("d2p2", ["--launcher", "local", "--stages", "2", "--virtual", "1", "--data-parallel", "2"])):
        again = tmp_path / name  # as an interruption after step 3 would have left it: resumes from step_2
        shutil.copytree(run / "checkpoints" / "step_2", again / "checkpoints" / "step_2")
        (again / "metrics.jsonl").write_text("".join((run / "metrics.jsonl").read_text().splitlines(True)[:3]))
        assert main(["train", "--resume", str(again), *split, "--quiet"]) == 0
        got = summary(again)
        assert_same_losses(got["losses"], want["losses"])
        assert_same_losses([v for _, v in got["val_losses"]], [v for _, v in want["val_losses"]])
        pipe = got["config"]["pipeline"]
        assert (pipe["stages"], pipe["virtual"], pipe["data_parallel"]) == ((1, 1, 1) if name == "p1" else (2, 1, 2))


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--inject-failure", "1"], "expected RANK:STEP"),
        (["--inject-failure", "2:1", "--stages", "2"], "RANK must be in 0..1"),
        (["--inject-failure", "0:9", "--steps", "3"], "STEP must be in 1..3"),
        (["--inject-failure", "0:1", "--launcher", "inprocess"], "--inject-failure needs rank workers"),
        (["--address", "auto", "--launcher", "local"], "--address is for --launcher ray"),
        (["--checkpoint-every", "x"], "--checkpoint-every 'x'"),
        (["--placement", "NEAR"], "PipelineConfig.placement='NEAR'"),
    ],
)
def test_flag_errors_exit_2_with_one_line(tmp_path, capsys, argv, needle):
    assert main(["train", "--launcher", "local", *TINY, *argv, "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and needle in err and len(err.strip().splitlines()) == 1


def test_run_dirs_with_and_without_checkpoints(tmp_path, capsys):
    empty = tmp_path / "empty"
    assert main(["train", "--resume", str(empty), *TINY]) == 2
    assert "no complete checkpoint" in capsys.readouterr().err
    run = tmp_path / "run"
    assert main(["train", *TINY, "--launcher", "local", "--steps", "2", "--checkpoint-every", "1",
                 "--out", str(run)]) == 0
    assert main(["train", *TINY, "--launcher", "local", "--steps", "2", "--out", str(run)]) == 2
    assert f"--resume {run}" in capsys.readouterr().err  # a fresh run must not adopt old checkpoints
    assert main(["train", "--resume", str(run), "--layers", "2"]) == 2
    assert "another model" in capsys.readouterr().err


@pytest.mark.distributed
def test_local_launcher_restarts_from_scratch_without_a_checkpoint(tmp_path, capsys):
    """Rank 1's process exits during step 2; fresh processes re-run from step 1 and end like the
    undisturbed pipeline (the in-process launcher computes the same steps, and fast); past
    --max-restarts a run stops instead."""
    split = ["--stages", "2", "--virtual", "2", "--steps", "3"]
    assert main(["train", *TINY, *split, "--launcher", "inprocess", "--out", str(tmp_path / "plain")]) == 0
    argv = ["train", *TINY, *split, "--launcher", "local", "--inject-failure", "1:2", "--out", str(tmp_path / "hit")]
    assert main([a for a in argv if a != "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "rank 1 lost at step 2/3; restarting from step 0 (no checkpoint yet) (restart 1/3)" in out
    assert_same_losses(losses(tmp_path / "hit"), losses(tmp_path / "plain"))
    assert summary(tmp_path / "hit")["restarts"] == 1

    # Past --max-restarts the run stops with a message naming the rank and the step, and writes no summary.
    argv = ["train", *TINY, *split, "--launcher", "local", "--inject-failure", "0:2", "--max-restarts", "0"]
    assert main([*argv, "--out", str(tmp_path / "stop")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: rank 0 lost at step 2/3 after 0 restart(s), the limit set by --max-restarts"), err
    assert not (tmp_path / "stop" / "summary.json").exists()


def test_a_rank_that_cannot_see_the_run_directory_stops_the_start(tmp_path):
    """Ranks write their shards into --out directly: the engines probe that every rank sees the
    driver's directory (a file the driver writes there) and name the ranks that do not."""
    from attnres_pp.train.engine import check_shared_out_dir

    seen = []

    def ask_ranks(path, token):  # rank 0 shares the driver's filesystem, rank 1 (another node) does not
        seen.append(Path(path).read_text() == token)
        return [(True, "node-a"), (False, "node-b")]

    with pytest.raises(RuntimeError, match=r"not visible to rank 1 on node-b: .* filesystem every node mounts"):
        check_shared_out_dir(tmp_path / "out", ask_ranks)
    assert seen == [True] and list((tmp_path / "out").iterdir()) == []  # the probe is removed


def test_shard_state_keeps_the_flat_layout_and_round_trips_msar_scalars(tmp_path):
    """torch's state_dict helpers fill the flat layout (whole-model names, optim.<name>.<key>,
    rng.<stream>); a fresh model and optimizer load every value back bit for bit, MSAR's 0-dim gate
    scales included."""
    import torch

    from attnres_pp.model import ModelConfig, Transformer
    from attnres_pp.train.config import TrainConfig
    from attnres_pp.train.optim import build_optimizer
    from attnres_pp.train.shards import load_shard, save_shard, shard_state

    cfg = ModelConfig(n_layers=2, d_model=16, n_heads=2, seq_len=8, residual="msar", block_size=2)

    def built(seed: int):
        model = Transformer(cfg, backend="torch", seed=seed)
        return model, build_optimizer(model, TrainConfig())

    model, optimizer = built(0)
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=torch.Generator().manual_seed(0))
    model(idx, idx).backward()
    optimizer.step()
    params = dict(model.named_parameters())
    state = shard_state(model, params, optimizer, "dp0.layers0:2")
    fields = ("step", "exp_avg", "exp_avg_sq")
    assert set(state) == {*params, *(f"optim.{n}.{f}" for n in params for f in fields), "rng.dp0.layers0:2"}
    scalars = [n for n, p in params.items() if p.dim() == 0]
    assert scalars and all(state[n].dim() == 0 for n in scalars)
    save_shard(tmp_path / "step_1", state, distributed=False)

    fresh, fresh_optimizer = built(1)
    assert not torch.equal(fresh.state_dict()["embed.tok.weight"], model.state_dict()["embed.tok.weight"])
    fresh_params = dict(fresh.named_parameters())
    assert load_shard(tmp_path / "step_1", fresh, fresh_params, fresh_optimizer, "dp0.layers0:2",
                      distributed=False) is None
    for name, p in params.items():
        assert torch.equal(fresh_params[name], p), name
        for field in fields:
            assert torch.equal(fresh_optimizer.state[fresh_params[name]][field], optimizer.state[p][field]), name
