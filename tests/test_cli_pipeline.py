"""`attnres-pp train` pipelined through the local launcher: summary.json carries the measured hop
counts (equal to the payload plan), bytes, bubble and a Perfetto trace with one row per rank."""

from __future__ import annotations

import json

import pytest

from attnres_pp.cli import main
from attnres_pp.comm.partition import make_partition
from attnres_pp.comm.plan import plan_payloads

pytestmark = pytest.mark.distributed

SMALL = ["--layers", "4", "--d-model", "16", "--heads", "2", "--seq-len", "16", "--batch-size", "4",
         "--steps", "2", "--eval-every", "0", "--quiet"]


@pytest.mark.parametrize("cache", ["on", "off"])
def test_pipelined_train_writes_measured_hops_bytes_bubble_and_trace(tmp_path, cache):
    out = tmp_path / "run"
    argv = ["train", "--launcher", "local", "--stages", "2", "--virtual", "2", "--microbatches", "2",
            "--residual", "attnres", "--block-size", "3", "--cache", cache, *SMALL, "--out", str(out)]
    assert main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    plan = plan_payloads(n_sublayers=8, block_size=3, partition=make_partition(4, 2, 2),
                         mode="cached" if cache == "on" else "naive")
    assert summary["fwd_hop_tensors"] == plan.fwd_hop_tensors
    # Both directions, every microbatch, [2 sequences x 16 tokens, d = 16] fp32 tensors.
    assert summary["bytes_sent_per_step"] == 2 * 2 * sum(plan.fwd_hop_tensors) * 2 * 16 * 16 * 4
    assert 0.0 < summary["bubble_fraction"] < 1.0
    assert len(summary["losses"]) == 2
    trace = json.loads((out / "trace.json").read_text())["traceEvents"]
    assert {e["args"]["name"] for e in trace if e["ph"] == "M"} == {"rank 0", "rank 1"}
    names = {e["name"] for e in trace if e["ph"] == "X"}
    assert {"F0.0", "B3.1", "SF0.0", "RF1.0"} <= names
