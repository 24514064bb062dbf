"""`--expert-parallel` through the CLI: rank processes over gloo (`--launcher local`) and Ray actors,
whose all-to-alls are torch.distributed's. An MoE model (E = 4, K = 2, one shared expert, one dense
layer) at D = 2, P = 2: EP = 2 under fsdp equals the in-process EP = 1 run step for step, holds half
the routed experts per rank (the bytes `simulate memory` predicts), and its checkpoint resumes at
EP = 1 (and EP = 1's at EP = 2) to the uninterrupted losses. A bad setting is one `error:` line, exit
2, before any rank starts."""

from __future__ import annotations

import re

import pytest

from attnres_pp.cli import main
from attnres_pp.model.config import ModelConfig
from attnres_pp.simulator.memory import MemorySetup, predict_memory
from tests.run_helpers import assert_same_losses, metrics, summary

pytestmark = pytest.mark.distributed

MOE = ["--moe-experts", "4", "--moe-top-k", "2", "--moe-shared-experts", "1", "--moe-dense-layers", "1"]
TINY = ["--layers", "4", "--d-model", "32", "--heads", "2", "--seq-len", "16", "--batch-size", "8", "--microbatches",
        "2", "--eval-every", "0", "--quiet", "--data-parallel", "2", "--stages", "2", "--residual", "attnres",
        "--block-size", "3", "--steps", "3", *MOE]


def _expert_bytes(run: dict) -> list[int]:
    return [entry["param_bytes"] for entry in run["memory_per_rank"]]


def test_ep_over_gloo_under_fsdp_equals_ep1_and_checkpoints_move_between_eps(tmp_path):
    """EP = 2 with --dp-shard fsdp (expert slices and the selection bias kept whole by FSDP2) in rank
    processes: the losses of the in-process EP = 1 run; each run then resumes from its checkpoint of
    step 2 at the other EP, in rank processes, to the same losses (thread ranks' checkpoints:
    tests/parity/test_expert_parallel.py)."""
    ep1, ep2 = tmp_path / "ep1", tmp_path / "ep2"
    keep = ["--checkpoint-every", "2", "--no-final-checkpoint"]
    assert main(["train", *TINY, *keep, "--launcher", "inprocess", "--out", str(ep1)]) == 0
    assert main(["train", *TINY, *keep, "--launcher", "local", "--expert-parallel", "2", "--dp-shard", "fsdp",
                 "--out", str(ep2)]) == 0
    want, got = summary(ep1), summary(ep2)
    assert_same_losses(got["losses"], want["losses"], what="EP 2 over gloo vs EP 1")
    assert got["config"]["pipeline"]["expert_parallel"] == 2
    # every step's dispatch and combine, timed and counted; none without expert parallelism
    assert all(s["moe_all_to_all_s"] > 0 and s["moe_all_to_all_bytes"] > 0 for s in metrics(ep2))
    assert not any("moe_all_to_all_s" in s for s in metrics(ep1))
    # fsdp halves what it shards; the expert slices were halved by EP instead: each rank still holds less.
    assert all(g < w for g, w in zip(_expert_bytes(got), _expert_bytes(want), strict=True))
    # and `simulate memory` predicts each rank's parameter, gradient and AdamW bytes exactly: the routed
    # experts split over EP = 2, FSDP2 leaving the slices and the selection bias whole, the dense first
    # layer and the untied LM head sharded (V = 1 placement)
    pipe, train = got["config"]["pipeline"], got["config"]["train"]
    model = ModelConfig.from_dict(got["config"]["model"])
    rows = train["batch_size"] // (pipe["data_parallel"] * train["microbatches"])
    predicted = predict_memory(model, MemorySetup(
        schedule=pipe["schedule"], n_stages=pipe["stages"], n_virtual=pipe["virtual"],
        n_microbatches=train["microbatches"], tokens=rows * model.seq_len, dtype=train["dtype"],
        data_parallel=pipe["data_parallel"], dp_shard="fsdp", expert_parallel=2))
    held = ("param_bytes", "grad_bytes", "optimizer_bytes")
    assert [[e[k] for k in held] for e in got["memory_per_rank"]] == [[w.terms[k] for k in held] for w in predicted]
    # EP 2's slices were written as DTensor chunks of the whole tensors; EP 2 reads its rows of EP 1's.
    for run, ep in ((ep2, "1"), (ep1, "2")):
        (run / "summary.json").unlink()
        assert main(["train", "--resume", str(run), "--launcher", "local", "--expert-parallel", ep,
                     "--dp-shard", "replicate", "--quiet"]) == 0
        resumed = summary(run)
        assert resumed["config"]["pipeline"]["expert_parallel"] == int(ep)
        assert_same_losses(resumed["losses"], want["losses"], what=f"resumed at EP {ep}")


_ERROR_LINE = re.compile(r"^error: ")


@pytest.mark.parametrize("flags,needle", [
    (["--expert-parallel", "3", "--data-parallel", "3", "--batch-size", "6"], "does not divide --moe-experts 4"),
    (["--expert-parallel", "4"], "does not divide --data-parallel 2"),
    (["--expert-parallel", "two"], "--expert-parallel 'two'"),
    (["--tensor-parallel", "2", "--moe-balance", "aux_loss"], "aux_loss with --tensor-parallel 2 under sequence"),
    (["--fault-tolerance", "replicas", "--expert-parallel", "2"], "an expert-parallel group spans replicas"),
])
def test_bad_expert_parallel_flags_are_one_error_line(flags, needle, tmp_path, capsys):
    code = main(["train", *TINY, "--launcher", "local", *flags, "--out", str(tmp_path / "run")])
    said = capsys.readouterr()
    lines = (said.out + said.err).splitlines()
    errors = [line for line in lines if _ERROR_LINE.match(line)]
    assert code == 2 and len(errors) == 1 and "Traceback" not in said.err, lines
    assert needle in errors[0], errors[0]
    assert not (tmp_path / "run").exists()
