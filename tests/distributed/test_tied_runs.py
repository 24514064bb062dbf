"""Tied embeddings on two pipeline ranks in the local launcher's rank processes (gloo): D = 2 replicas
of a P = 3 pipeline under FSDP2 (the embedding group a group of its own: first and last rank of each
replica) trains as the single process does, its checkpoint holds the one matrix once, resumes at
another P, V and D to the same losses, and exports the matrix once (`tie_word_embeddings`)."""

from __future__ import annotations

import json

import pytest

from attnres_pp.cli import main
from attnres_pp.train.shards import checkpoint_tensors
from tests.run_helpers import assert_same_losses, summary

pytestmark = pytest.mark.distributed

TIED = ["--layers", "6", "--d-model", "32", "--heads", "4", "--kv-heads", "2", "--seq-len", "16", "--batch-size", "8",
        "--microbatches", "2", "--eval-every", "0", "--quiet", "--tie-embeddings", "--residual", "attnres",
        "--block-size", "3", "--steps", "5"]


def test_tied_rank_processes_train_save_once_resume_at_another_split_and_export_once(tmp_path):
    assert main(["train", *TIED, "--launcher", "inprocess", "--out", str(tmp_path / "single")]) == 0
    want = summary(tmp_path / "single")["losses"]
    run = tmp_path / "run"
    assert main(["train", *TIED, "--launcher", "local", "--stages", "3", "--schedule", "1f1b", "--data-parallel", "2",
                 "--dp-shard", "fsdp", "--checkpoint-every", "3", "--no-final-checkpoint", "--keep-checkpoints", "0",
                 "--out", str(run)]) == 0
    assert_same_losses(summary(run)["losses"], want, what="D2 P3 fsdp")
    saved = checkpoint_tensors(run / "checkpoints" / "step_3")
    assert {"embed.tok.weight", "optim.embed.tok.weight.exp_avg"} <= set(saved)
    assert not [key for key in saved if "lm_head" in key]  # the one matrix, once
    (run / "summary.json").unlink()
    assert main(["train", "--resume", str(run), "--launcher", "local", "--stages", "2", "--virtual", "2",
                 "--schedule", "interleaved_1f1b", "--data-parallel", "1", "--dp-shard", "replicate", "--quiet"]) == 0
    resumed = summary(run)
    assert (resumed["config"]["pipeline"]["stages"], resumed["config"]["pipeline"]["data_parallel"]) == (2, 1)
    assert_same_losses(resumed["losses"], want, what="resumed at D1 P2 V2")

    out = tmp_path / "hf"
    assert main(["export", "--resume", str(run), "--out", str(out)]) == 0
    from safetensors import safe_open

    names = [n for f in out.glob("*.safetensors") for n in safe_open(str(f), "pt").keys()]
    assert "embed.tok.weight" in names and not [n for n in names if "lm_head" in n]
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
