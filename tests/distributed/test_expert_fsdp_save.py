"""Saving FSDP2-sharded expert slices without gathering them (`train.expert_shards`): at D = 4, EP = 2
under `--dp-shard fsdp` with E = 6 (3 experts per slice, split 2 + 1 over its D / EP = 2 edp
holders, torch.chunk's rows as FSDP2's), each of the four ranks writes its own rows of every routed
expert tensor and of its AdamW moments: the checkpoint holds the whole [E, ...] tensors as four
chunks of 2, 1, 2, 1 rows at offsets 0, 2, 3, 5 (a gathered save wrote two chunks of 3). The run
(rank processes) equals EP = 1, D = 4 on thread ranks; its step-2 checkpoint resumes at EP = 1,
D = 2 (replicate, thread ranks) and at EP = 2, D = 4 (fsdp), and the EP = 1 run's at EP = 2, D = 4,
fsdp (whole experts read into uneven FSDP2 slices), each to the uninterrupted run's losses."""

from __future__ import annotations

import pytest

from attnres_pp.cli import main
from attnres_pp.train.shards import SafeReader
from tests.run_helpers import assert_same_losses, summary

pytestmark = pytest.mark.distributed

TINY = ["--layers", "2", "--d-model", "32", "--heads", "2", "--seq-len", "16", "--batch-size", "8", "--microbatches",
        "2", "--eval-every", "0", "--quiet", "--stages", "1", "--residual", "attnres", "--block-size", "2",
        "--steps", "3", "--moe-experts", "6", "--moe-top-k", "2", "--moe-shared-experts", "1",
        "--moe-dense-layers", "1", "--checkpoint-every", "2", "--no-final-checkpoint"]


def test_sharded_slices_are_written_as_they_are_and_resume_into_another_ep_and_d(tmp_path):
    run, ep1 = tmp_path / "ep2", tmp_path / "ep1"
    assert main(["train", *TINY, "--data-parallel", "4", "--launcher", "local", "--expert-parallel", "2",
                 "--dp-shard", "fsdp", "--out", str(run)]) == 0
    assert main(["train", *TINY, "--data-parallel", "4", "--launcher", "inprocess", "--out", str(ep1)]) == 0
    want = summary(run)["losses"]
    assert_same_losses(want, summary(ep1)["losses"], what="EP 2 D 4 fsdp vs EP 1")
    metadata = SafeReader(run / "checkpoints" / "step_2").read_metadata().state_dict_metadata
    expert_keys = [k for k in metadata if ".experts." in k]
    assert expert_keys and any(k.startswith("optim.") for k in expert_keys)
    for key in expert_keys:
        if len(metadata[key].size) == 0:  # AdamW's step counter
            continue
        assert metadata[key].size[0] == 6
        chunks = sorted((c.offsets[0], c.sizes[0]) for c in metadata[key].chunks)
        assert chunks == [(0, 2), (2, 1), (3, 2), (5, 1)], key
    for source, (d, ep, shard, launcher) in ((run, (2, 1, "replicate", "inprocess")), (run, (4, 2, "fsdp", "local")),
                                             (ep1, (4, 2, "fsdp", "local"))):
        (source / "summary.json").unlink()
        assert main(["train", "--resume", str(source), "--launcher", launcher, "--data-parallel", str(d),
                     "--expert-parallel", str(ep), "--dp-shard", shard, "--quiet"]) == 0
        resumed = summary(source)
        pipe = resumed["config"]["pipeline"]
        assert (pipe["data_parallel"], pipe["expert_parallel"], pipe["dp_shard"]) == (d, ep, shard)
        assert_same_losses(resumed["losses"], want, what=f"{source.name} resumed at D {d}, EP {ep}, {shard}")
