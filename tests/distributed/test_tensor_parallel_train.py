"""`attnres-pp train --tensor-parallel 2` end to end on local rank processes over gloo: the losses
(optimizer steps included) and validation losses of a T = 2 run equal the T = 1 run's (fp32; bf16
to its rounding), also with FSDP2 over the replicas, each rank's hop bytes are 1/T of the T = 1
rank's, and a checkpoint resumes at another T, also with P and D changed together and into and out
of FSDP2 shards, to the uninterrupted losses."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from attnres_pp.cli import main
from attnres_pp.model.config import ModelConfig
from tests.run_helpers import assert_same_losses, metrics, summary

# One worker holds the module's runs: under --dist loadgroup its tests would otherwise be handed to
# both workers, each training the six runs of `runs` again.
pytestmark = [pytest.mark.distributed, pytest.mark.xdist_group("tp-train-runs")]

RUN = ["train", "--launcher", "local", "--device", "cpu", "--steps", "3", "--layers", "2", "--d-model", "32",
       "--heads", "2", "--seq-len", "16", "--batch-size", "4", "--microbatches", "2", "--block-size", "3",
       "--eval-every", "2", "--checkpoint-every", "2", "--quiet"]


def _grad_norms(run_dir):
    return [record["grad_norm"] for record in metrics(run_dir)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same 3 steps at (T, P) = (1, 2) and (2, 2), each checkpointed at step 2; and MSAR's (its
    tied convolutions on every rank, its halos under sequence parallelism: shards of 16 tokens for
    kernels up to 12), without checkpoints. The T = 2 runs are local rank processes over gloo; the
    T = 1 references run on thread ranks (`--launcher inprocess`, whose losses, clipping norms, hop
    bytes, held bytes and checkpoint are the local processes' at T = 1), which start no process:
    the resumes from t1 load a checkpoint of the same format into local rank processes. bf16 at
    T = 2, P = 2 runs on thread ranks too (their losses and hop bytes are the local processes',
    `test_an_in_process_tensor_parallel_run_trains_as_the_local_one`); bf16 over gloo at T = 2 is
    the FSDP2 run `bf`, and bf16 hops between rank processes test_fsdp.py's bf16 run."""
    root = tmp_path_factory.mktemp("tp_train")
    msar = ["--residual", "msar", "--seq-len", "32", "--no-final-checkpoint", "--checkpoint-every", "0",
            "--eval-every", "0"]
    bf16 = ["--dtype", "bf16", "--no-final-checkpoint", "--checkpoint-every", "0", "--eval-every", "0"]
    threads = ["--launcher", "inprocess"]
    for name, flags in (("t1", threads), ("t2", ["--tensor-parallel", "2"]), ("m1", [*msar, *threads]),
                        ("m2", [*msar, "--tensor-parallel", "2"]), ("b1", [*bf16, *threads]),
                        ("b2", [*bf16, "--tensor-parallel", "2", *threads])):
        assert main([*RUN, "--stages", "2", *flags, "--out", str(root / name)]) == 0
    # FSDP2 over dp composed with the tp split (D = 2 replicas of T = 2 ranks, P = 1), checkpointed
    assert main([*RUN, "--stages", "1", *FSDP_TP, "--out", str(root / "f2")]) == 0
    assert main([*RUN, "--stages", "1", *bf16, *FSDP_TP, "--out", str(root / "bf")]) == 0
    return root


FSDP_TP = ["--tensor-parallel", "2", "--data-parallel", "2", "--dp-shard", "fsdp"]


def test_a_tensor_parallel_run_trains_as_the_unsplit_one(runs):
    t1, t2 = summary(runs / "t1"), summary(runs / "t2")
    assert t2["config"]["pipeline"]["tensor_parallel"] == 2 and t2["config"]["pipeline"]["sequence_parallel"] is None
    assert_same_losses(t2["losses"], t1["losses"])
    # the clipping norm (clipping acts: it is > 1) counts every split weight's shards and each replicated
    # parameter once
    assert_same_losses(_grad_norms(runs / "t2"), _grad_norms(runs / "t1"))
    assert min(_grad_norms(runs / "t1")) > 1.0
    assert_same_losses([v for _step, v in t2["val_losses"]], [v for _step, v in t1["val_losses"]])
    # Ranks (pp, tp) = (0, 0), (0, 1), (1, 0), (1, 1): each tp rank sends its sequence shard's half.
    per_rank_t1, per_rank_t2 = t1["bytes_sent_per_step_per_rank"], t2["bytes_sent_per_step_per_rank"]
    assert len(per_rank_t2) == 4 and per_rank_t1[0] > 0
    assert per_rank_t2 == [b // 2 for b in per_rank_t1 for _ in range(2)]
    assert t2["bytes_sent_per_step"] == t1["bytes_sent_per_step"] == sum(per_rank_t1)
    # the tp collectives' bytes (their per-rank count is checked against the simulator's terms in
    # tests/distributed/test_tensor_parallel_gloo.py)
    assert t1["tp_bytes_per_step"] == 0 < t2["tp_bytes_per_step"]
    # memory_per_rank counts each rank's shards: the split matrices halve, the rest is held whole.
    for rank, entry in enumerate(t2["memory_per_rank"]):
        whole = t1["memory_per_rank"][rank // 2]
        for key in ("param_bytes", "grad_bytes", "optimizer_bytes"):
            assert whole[key] / 2 < entry[key] < whole[key], (rank, key, entry[key], whole[key])
    # params_per_rank: one entry per (pp, tp) rank, each the rank's layer with its split matrices
    # (q, k, v and the attention output: 4 d^2; SwiGLU's gate, up and down: 3 d f) halved, the rest whole
    model = ModelConfig.from_dict(t1["config"]["model"])
    split = 4 * model.d_model**2 + 3 * model.d_model * model.ff_dim
    held = [whole - split // 2 for whole in t1["params_per_rank"] for _ in range(2)]
    assert len(t1["params_per_rank"]) == 2 and t2["params_per_rank"] == held
    assert [4 * n for n in t2["params_per_rank"]] == [e["param_bytes"] for e in t2["memory_per_rank"]]


def test_fsdp_over_tensor_parallel_ranks_trains_as_the_unsplit_one(runs, capsys):
    """FSDP2 shards the tp-split weights over the replicas (the fused qkv weight by its columns):
    the losses, the clipping norms (each shard counted once over dp and tp) and the validation
    losses equal the unsplit run's, and each rank holds about 1 / (D T) of a split matrix."""
    t1, f2 = summary(runs / "t1"), summary(runs / "f2")
    pipe = f2["config"]["pipeline"]
    assert [pipe["tensor_parallel"], pipe["data_parallel"], pipe["dp_shard"]] == [2, 2, "fsdp"]
    assert_same_losses(f2["losses"], t1["losses"])
    assert_same_losses(_grad_norms(runs / "f2"), _grad_norms(runs / "t1"))
    assert_same_losses([v for _step, v in f2["val_losses"]], [v for _step, v in t1["val_losses"]])
    # the whole model (both t1 ranks) split over D x T = 4 ranks: the shards are disjoint, padding aside
    whole_bytes = sum(entry["param_bytes"] for entry in t1["memory_per_rank"])
    for entry in f2["memory_per_rank"]:
        assert whole_bytes / 4 <= entry["param_bytes"] < whole_bytes / 2, (entry["param_bytes"], whole_bytes)
    # and the memory model predicts each rank's parameters, gradients and AdamW moments exactly
    capsys.readouterr()
    assert main(["simulate", "memory", "--json", "--schedule", "1f1b", "--microbatches", "2", "--layers", "2",
                 "--d-model", "32", "--heads", "2", "--seq-len", "16", "--block-size", "3", "--dtype", "fp32",
                 "--stages", "1", *FSDP_TP]) == 0
    predicted = json.loads(capsys.readouterr().out)["memory_per_rank"]
    keys = ("param_bytes", "grad_bytes", "optimizer_bytes")
    assert [[row[k] for k in keys] for row in predicted] == [[entry[k] for k in keys]
                                                            for entry in f2["memory_per_rank"][::2]]


def test_msar_under_sequence_parallelism_trains_as_the_unsplit_one(runs):
    m1, m2 = summary(runs / "m1"), summary(runs / "m2")
    assert m2["config"]["pipeline"]["tensor_parallel"] == 2 and m2["config"]["model"]["seq_len"] == 32
    assert_same_losses(m2["losses"], m1["losses"])
    assert_same_losses(_grad_norms(runs / "m2"), _grad_norms(runs / "m1"))


def test_bf16_trains_as_the_unsplit_one(runs):
    """bf16 autocast (fp32 master weights, bf16 hops): the split sums in another order, so the losses
    agree to bf16's rounding rather than fp32's."""
    b1, b2 = summary(runs / "b1"), summary(runs / "b2")
    assert b2["config"]["train"]["dtype"] == "bf16"
    assert_same_losses(b2["losses"], b1["losses"], rtol=1e-3)
    assert b2["bytes_sent_per_step_per_rank"] == [b // 2 for b in b1["bytes_sent_per_step_per_rank"] for _ in range(2)]
    # under FSDP2 too: bf16 all-gathered weights, fp32 shards, reduce-scatter and moments
    bf = summary(runs / "bf")
    assert bf["config"]["pipeline"]["dp_shard"] == "fsdp" and bf["config"]["train"]["dtype"] == "bf16"
    assert_same_losses(bf["losses"], b1["losses"], rtol=1e-3)


# Out of a tp split, T, P and D all changing at once: (2, 2, 1) -> (1, 1, 2). Each replica loads the
# whole checkpoint into its own ranks, so this carries the resume at D = 1 ((2, 2) -> (1, 1)) as its
# replica 0. Into replicated tp-split weights with P and D changed ((2, 2, 1) -> (2, 1, 2)) is the
# thread ranks' resume in test_an_in_process_tensor_parallel_run_trains_as_the_local_one (the same
# StageWorker load of the same whole checkpoint format); from T = 1 into tp-split weights of rank
# processes is the FSDP2 resume's.
@pytest.mark.parametrize(("source", "launcher", "flags"), [
    ("t2", "local", ["--tensor-parallel", "1", "--stages", "1", "--data-parallel", "2"]),
    # into and out of FSDP2 shards of tp-split weights
    ("t1", "local", ["--tensor-parallel", "2", "--stages", "1", "--data-parallel", "2", "--dp-shard", "fsdp"]),
    ("f2", "local", ["--tensor-parallel", "1", "--stages", "2", "--data-parallel", "1", "--dp-shard", "replicate"]),
], ids=["t2p2d1-to-t1p1d2", "t1-to-fsdp-t2d2", "fsdp-t2d2-to-t1p2"])
def test_a_checkpoint_resumes_at_another_tensor_parallel_size(runs, tmp_path, source, launcher, flags):
    run_dir = tmp_path / "resumed"
    shutil.copytree(runs / source, run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "step_3")  # resume from step 2
    assert main(["train", "--resume", str(run_dir), "--launcher", launcher, "--quiet", *flags]) == 0
    resumed, uninterrupted = summary(run_dir), summary(runs / "t1")
    pipe = resumed["config"]["pipeline"]
    assert [pipe["tensor_parallel"], pipe["stages"], pipe["data_parallel"]] == [
        int(flags[1]), int(flags[3]), int(flags[5]) if len(flags) > 4 else 1]
    assert_same_losses(resumed["losses"], uninterrupted["losses"])
    # The one resumed step's training loss reads only the loaded weights; the validation loss after it
    # (step index 2) follows that step's AdamW update, so it checks the loaded moments too.
    assert_same_losses([v for _step, v in resumed["val_losses"]], [v for _step, v in uninterrupted["val_losses"]])
    assert_same_losses(_grad_norms(run_dir), _grad_norms(runs / "t1"))


def test_an_in_process_tensor_parallel_run_trains_as_the_local_one(runs, tmp_path):
    """`--launcher inprocess --tensor-parallel 2`: rank threads over torch's threaded process group give
    the local rank processes' losses, clipping norms, validation losses, hop bytes and checkpoint, and
    that checkpoint resumes in-process, at P = 1 and D = 2 (each replica loading the whole checkpoint
    into its tp-split weights), to the uninterrupted losses, clipping norms and validation losses."""
    from attnres_pp.train.shards import read_parameters

    run_dir = tmp_path / "inprocess"
    assert main([*RUN, "--stages", "2", "--tensor-parallel", "2", "--launcher", "inprocess",
                 "--out", str(run_dir)]) == 0
    threads, local = summary(run_dir), summary(runs / "t2")
    assert threads["config"]["pipeline"]["launcher"] == "inprocess"
    assert_same_losses(threads["losses"], local["losses"])
    assert_same_losses(_grad_norms(run_dir), _grad_norms(runs / "t2"))
    assert_same_losses([v for _step, v in threads["val_losses"]], [v for _step, v in local["val_losses"]])
    assert threads["bytes_sent_per_step_per_rank"] == local["bytes_sent_per_step_per_rank"]
    # the tp collectives' bytes too: the threads' sums of partial gradients pass no dispatcher
    assert threads["tp_bytes_per_step"] == local["tp_bytes_per_step"] > 0
    assert threads["params_per_rank"] == local["params_per_rank"]
    # rank 0 writes every thread rank's state, each split weight made whole
    got = read_parameters(run_dir / "checkpoints" / "step_3")
    want = read_parameters(runs / "t2" / "checkpoints" / "step_3")
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert torch.allclose(got[name], value, rtol=1e-5, atol=1e-6), name
    shutil.rmtree(run_dir / "checkpoints" / "step_3")  # resume from step 2, in-process
    assert main(["train", "--resume", str(run_dir), "--launcher", "inprocess", "--quiet", "--stages", "1",
                 "--data-parallel", "2"]) == 0
    resumed = summary(run_dir)
    pipe = resumed["config"]["pipeline"]
    assert [pipe["tensor_parallel"], pipe["stages"], pipe["data_parallel"]] == [2, 1, 2]
    assert_same_losses(resumed["losses"], local["losses"])
    # the validation loss after the resumed step (step index 2) follows its AdamW update: the loaded moments
    assert_same_losses([v for _step, v in resumed["val_losses"]], [v for _step, v in local["val_losses"]])
    assert_same_losses(_grad_norms(run_dir), _grad_norms(runs / "t2"))


def test_in_process_msar_counts_its_halos_as_the_local_ranks_do(runs, tmp_path):
    """MSAR under SP on thread ranks: its halos' all-gathers go over the threaded process group, whose
    c10d ops reach no dispatcher; they are counted all the same, so `tp_bytes_per_step` equals the
    local rank processes' (and the losses theirs)."""
    run_dir = tmp_path / "msar"
    assert main([*RUN, "--stages", "2", "--tensor-parallel", "2", "--launcher", "inprocess", "--residual", "msar",
                 "--seq-len", "32", "--no-final-checkpoint", "--checkpoint-every", "0", "--eval-every", "0",
                 "--out", str(run_dir)]) == 0
    threads, local = summary(run_dir), summary(runs / "m2")
    assert_same_losses(threads["losses"], local["losses"])
    assert threads["tp_bytes_per_step"] == local["tp_bytes_per_step"] > 0
