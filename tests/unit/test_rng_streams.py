"""RNG state in checkpoints belongs to the stream a rank feeds (its replica and the layers it
holds), not to its global rank: a resume at another split restores the state of every stream the
two splits share and leaves (and names) the others; an in-process reshard resume ends like the
uninterrupted run."""

from __future__ import annotations

import shutil

import pytest
import torch

from attnres_pp.cli import main
from attnres_pp.train.config import RunConfig
from attnres_pp.train.shards import load_shard, rng_stream, save_shard, shard_state
from attnres_pp.train.stage_worker import StageWorker
from tests.run_helpers import assert_same_losses, summary

from .test_checkpoint import TINY

MODEL = {"vocab_size": 32, "n_layers": 4, "d_model": 16, "n_heads": 2, "seq_len": 8, "residual": "attnres",
         "block_size": 3}


def _workers(D: int, P: int, V: int) -> list[StageWorker]:
    run_cfg = RunConfig.from_dict({
        "model": MODEL, "train": {"steps": 2, "batch_size": 2 * D, "microbatches": 2, "seed": 0},
        "pipeline": {"stages": P, "virtual": V, "data_parallel": D, "launcher": "inprocess"}}).to_dict()
    return [StageWorker(run_cfg, rank) for rank in range(D * P)]


def test_a_stream_is_the_replica_and_the_layers_held():
    assert rng_stream(1, [range(2, 3), range(0, 1)]) == "dp1.layers0:1,2:3"
    assert rng_stream(0, [range(0, 2), range(2, 4)]) == "dp0.layers0:4"  # P = 1, V = 2: the whole model
    assert [w.rng_stream for w in _workers(2, 2, 2)] == ["dp0.layers0:1,2:3", "dp0.layers1:2,3:4",
                                                         "dp1.layers0:1,2:3", "dp1.layers1:2,3:4"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint of D = 2, P = 2, V = 2 in which every rank's RNG state is its own (seed 100 + rank)."""
    step_dir = tmp_path_factory.mktemp("ckpt") / "step_1"
    state, by_stream = {}, {}
    for worker in _workers(2, 2, 2):
        torch.manual_seed(100 + worker.rank)
        by_stream[worker.rng_stream] = torch.get_rng_state()
        state.update(shard_state(worker.model, worker.params, worker.optimizer, worker.rng_stream))
    save_shard(step_dir, state, distributed=False)
    return step_dir, by_stream


@pytest.mark.parametrize(("D", "P", "V", "restored"), [
    (2, 2, 2, [True, True, True, True]),  # the same split: every stream
    (1, 2, 2, [True, True]),  # one replica fewer: replica 0's streams
    (3, 2, 2, [True, True, True, True, False, False]),  # a new replica has no saved stream
    (1, 4, 1, [False] * 4),  # other holdings: global rank 1 now holds layer 1 alone, not layers 1 and 3
])
def test_a_resume_restores_each_stream_that_exists(saved, capsys, D, P, V, restored):
    step_dir, by_stream = saved
    for worker, want in zip(_workers(D, P, V), restored, strict=True):
        torch.manual_seed(7)
        seeded = torch.get_rng_state()
        note = worker.load_shard(str(step_dir))
        got = torch.get_rng_state()
        if want:
            assert note is None and torch.equal(got, by_stream[worker.rng_stream]), worker.rng_stream
        else:
            assert torch.equal(got, seeded)
            assert f"no RNG state for stream {worker.rng_stream}" in note and "keeps the RNG state its seed" in note
            assert f"note: rank {worker.rank}: checkpoint" in capsys.readouterr().err


def test_a_checkpoint_without_any_rng_state_says_so(tmp_path):
    worker = _workers(1, 1, 1)[0]
    state = {k: v for k, v in shard_state(worker.model, worker.params, worker.optimizer, "unused").items()
             if not k.startswith("rng.")}
    save_shard(tmp_path / "step_1", state, distributed=False)
    note = load_shard(tmp_path / "step_1", worker.model, worker.params, worker.optimizer, worker.rng_stream,
                      distributed=False)
    assert "no RNG state for stream dp0.layers0:4 (it holds none" in note


def test_an_inprocess_reshard_resume_ends_like_the_uninterrupted_run(tmp_path):
    """P = 2, V = 2 saves step 2; the run resumes at D = 2, P = 2, V = 1 (other streams: each says it
    keeps its seeded state) and ends with the uninterrupted run's losses."""
    common = [*TINY, "--steps", "4", "--launcher", "inprocess"]
    run = tmp_path / "run"
    assert main(["train", *common, "--stages", "2", "--virtual", "2", "--checkpoint-every", "2",
                 "--out", str(run)]) == 0
    want = summary(run)
    again = tmp_path / "again"
    shutil.copytree(run / "checkpoints" / "step_2", again / "checkpoints" / "step_2")
    (again / "metrics.jsonl").write_text("".join((run / "metrics.jsonl").read_text().splitlines(True)[:2]))
    assert main(["train", "--resume", str(again), "--launcher", "inprocess", "--stages", "2", "--virtual", "1",
                 "--data-parallel", "2", "--quiet"]) == 0
    got = summary(again)
    assert_same_losses(got["losses"], want["losses"])
    assert got["config"]["pipeline"]["data_parallel"] == 2
