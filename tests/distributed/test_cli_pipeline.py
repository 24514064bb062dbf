"""`attnres-pp train` pipelined through the local launcher: summary.json carries the measured hop
counts (equal to the payload plan), bytes, bubble and a Perfetto trace with one row per rank. The
split-backward schedules, DualPipeV and one stage with virtual stages from the command line run on
thread ranks (`--launcher inprocess`): the same runtime, summary and trace; the rank processes run
every one of those schedules, and P = 1 with V = 2, 3 and 4, for every variant with every gradient
compared in test_pipeline_distributed.py (CASES_ZB, CASES_P1)."""

from __future__ import annotations

import json

import pytest

from attnres_pp.cli import main
from attnres_pp.comm.partition import make_partition
from attnres_pp.comm.plan import plan_payloads

SMALL = ["--layers", "4", "--d-model", "16", "--heads", "2", "--seq-len", "16", "--batch-size", "4",
         "--steps", "2", "--eval-every", "0", "--quiet"]


@pytest.mark.distributed
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
    # Rank-local parameters and data: each rank holds its chunks only, and per step the driver
    # exchanges scalars with the ranks (the traced step also carries the timelines).
    assert summary["data_parallel"] == 1
    assert len(summary["params_per_rank"]) == 2 and sum(summary["params_per_rank"]) == summary["params"]
    assert 0 < summary["driver_bytes_per_step"] < 4096
    assert summary["driver_bytes_trace_step"] > summary["driver_bytes_per_step"]
    trace = json.loads((out / "trace.json").read_text())["traceEvents"]
    assert {e["args"]["name"] for e in trace if e["ph"] == "M"} == {"rank 0", "rank 1"}
    names = {e["name"] for e in trace if e["ph"] == "X"}
    assert {"F0.0", "B3.1", "SF0.0", "RF1.0"} <= names


def test_one_stage_with_virtual_stages_trains_like_the_single_process(tmp_path):
    """`--stages 1 --virtual 2`: every hop is a self-hop (in memory, zero bytes), and with blocks
    closing exactly at chunk edges a cached hop carries nothing at all. Same losses as one process."""
    model = ["--residual", "attnres", "--block-size", "4", "--microbatches", "2", *SMALL]
    assert main(["train", "--launcher", "local", "--stages", "1", "--virtual", "1", *model,
                 "--out", str(tmp_path / "single")]) == 0
    assert main(["train", "--launcher", "inprocess", "--stages", "1", "--virtual", "2", *model,
                 "--out", str(tmp_path / "piped")]) == 0
    single = json.loads((tmp_path / "single" / "summary.json").read_text())
    piped = json.loads((tmp_path / "piped" / "summary.json").read_text())
    for got, want in zip(piped["losses"], single["losses"], strict=True):
        assert abs(got - want) <= 1e-5 * abs(want)
    assert piped["fwd_hop_tensors"] == [0] and piped["bytes_sent_per_step"] == 0


@pytest.mark.parametrize(("schedule", "virtual"), [("zb_h1", 1), ("interleaved_zb", 2), ("zbv", 2)])
def test_zero_bubble_schedules_train_like_the_single_process(tmp_path, schedule, virtual):
    """`--schedule zb_h1|interleaved_zb|zbv` from the command line: the split backward (I, W) trains
    to the single process's losses; ZB-V's middle hop (two chunks of rank 1) sends nothing; the
    trace holds I and W actions."""
    model = ["--residual", "attnres", "--block-size", "3", "--microbatches", "3", *SMALL, "--batch-size", "6"]
    assert main(["train", "--launcher", "local", "--stages", "1", "--virtual", "1", *model,
                 "--out", str(tmp_path / "single")]) == 0
    assert main(["train", "--launcher", "inprocess", "--stages", "2", "--virtual", str(virtual), "--schedule", schedule,
                 *model, "--out", str(tmp_path / "piped")]) == 0
    single = json.loads((tmp_path / "single" / "summary.json").read_text())
    piped = json.loads((tmp_path / "piped" / "summary.json").read_text())
    for got, want in zip(piped["losses"], single["losses"], strict=True):
        assert abs(got - want) <= 1e-5 * abs(want)
    placement = "vshape" if schedule == "zbv" else "loop"
    plan = plan_payloads(n_sublayers=8, block_size=3, partition=make_partition(4, 2, virtual, placement=placement),
                         mode="cached")
    assert piped["fwd_hop_tensors"] == plan.fwd_hop_tensors
    if schedule == "zbv":
        assert plan.fwd_hop_tensors[1] == 0
    names = {e["name"] for e in json.loads((tmp_path / "piped" / "trace.json").read_text())["traceEvents"]
             if e["ph"] == "X"}
    assert {"I0.0", "W0.0"} <= names and not any(n.startswith("B") for n in names)


def test_dualpipev_trains_like_the_single_process(tmp_path):
    """`--schedule dualpipev` from the command line (m = 2P): fused B in the paired steady state, I
    and W in the drain, the single process's losses, and the V placement's hops (the middle one, two
    chunks of rank 1, sends nothing)."""
    model = ["--residual", "attnres", "--block-size", "3", "--microbatches", "4", *SMALL, "--batch-size", "8"]
    assert main(["train", "--launcher", "local", "--stages", "1", "--virtual", "1", *model,
                 "--out", str(tmp_path / "single")]) == 0
    assert main(["train", "--launcher", "inprocess", "--stages", "2", "--virtual", "2", "--schedule", "dualpipev",
                 *model, "--out", str(tmp_path / "piped")]) == 0
    single = json.loads((tmp_path / "single" / "summary.json").read_text())
    piped = json.loads((tmp_path / "piped" / "summary.json").read_text())
    for got, want in zip(piped["losses"], single["losses"], strict=True):
        assert abs(got - want) <= 1e-5 * abs(want)
    plan = plan_payloads(n_sublayers=8, block_size=3, partition=make_partition(4, 2, 2, placement="vshape"),
                         mode="cached")
    assert piped["fwd_hop_tensors"] == plan.fwd_hop_tensors and plan.fwd_hop_tensors[1] == 0
    names = {e["name"] for e in json.loads((tmp_path / "piped" / "trace.json").read_text())["traceEvents"]
             if e["ph"] == "X"}
    assert {"B3.1", "I0.3", "W0.3", "F0.3"} <= names
