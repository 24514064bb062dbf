"""`simulate plan`'s search dimensions beyond layouts: the cache off (naive payloads), GPipe, fsdp's
all-gathers and reduce-scatters (reshard after forward never and always), and `--why ROW`, whose
terms sum to the row's figures."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shlex

import pytest

from attnres_pp.cli import build_parser, main
from attnres_pp.comm.plan import plan_for_model
from attnres_pp.model.config import ModelConfig
from attnres_pp.schedule.schedules import build_schedule
from attnres_pp.simulator.costs import (
    ring_all_gather_s,
    ring_all_reduce_s,
    ring_reduce_scatter_s,
    unit_costs,
)
from attnres_pp.simulator.engine import simulate
from attnres_pp.simulator.memory import rank_parameter_shapes, shard_numel
from attnres_pp.simulator.metrics import closed_form_bubble_fraction
from attnres_pp.simulator.plan import Candidate, Planner, PlanRequest, candidates, plan


def _request(residual: str = "attnres", **overrides) -> PlanRequest:
    cfg = ModelConfig(vocab_size=32000, n_layers=8, d_model=1024, n_heads=8, seq_len=2048, block_size=1,
                      residual=residual)
    values = dict(model=cfg, global_batch=16, gpus=4, gpu_memory_gib=12.0, top=8)
    values.update(overrides)
    return PlanRequest(**values)


def _candidate(**overrides) -> Candidate:
    values = dict(schedule="1f1b", n_stages=1, n_virtual=1, n_microbatches=4, data_parallel=4, block_size=4,
                  dp_shard="fsdp", activation_checkpoint="none")
    values.update(overrides)
    return Candidate(**values)


def _link(request: PlanRequest) -> tuple[float, float]:
    return request.intra_node_gbps * 1e9 / 8, request.latency_us * 1e-6  # 4 GPUs: one node


# ---- the cache off ----

def test_cache_off_is_searched_and_priced_by_the_payload_planner():
    request = _request(gpus=4, global_batch=4, gpu_memory_gib=200.0, top=400)
    rows = plan(request, evaluate_at_most=400)
    piped = [row for row in rows if row["config"]["n_stages"] * row["config"]["n_virtual"] > 1]
    assert {row["config"]["cache"] for row in piped} == {True, False}
    planner = Planner(request)
    for row in piped:
        c = row["config"]
        partition = planner.chunk_costs(Candidate(**{f.name: c[f.name] for f in dataclasses.fields(Candidate)}))[0]
        payloads = plan_for_model(dataclasses.replace(request.model, block_size=c["block_size"]), partition,
                                  c["cache"])
        assert row["payload_mode"] == payloads.mode == ("cached" if c["cache"] else "naive")
        tensor = c["tokens_per_microbatch"] * request.model.source_width * 2
        assert row["bytes_per_hop"] == max(payloads.fwd_hop_tensors) * tensor
    # Same layout, cache on vs off: the step follows the bytes the payload planner sends.
    by_layout: dict = {}
    for row in piped:
        key = tuple(v for k, v in sorted(row["config"].items()) if k != "cache")
        by_layout.setdefault(key, {})[row["config"]["cache"]] = row
    pairs = [pair for pair in by_layout.values() if len(pair) == 2]
    assert pairs
    fewer = 0
    for pair in pairs:
        on, off = pair[True], pair[False]
        if on["bytes_per_hop"] < off["bytes_per_hop"]:
            fewer += 1
            assert on["step_time_s"] < off["step_time_s"]
        elif on["bytes_per_hop"] == off["bytes_per_hop"]:  # V = 1: the cache saves nothing on the wire
            assert on["step_time_s"] == pytest.approx(off["step_time_s"])
        assert on["command"].count("--cache on") == 1 and off["command"].count("--cache off") == 1
    assert fewer  # interleaved layouts, where the cache keeps blocks off the wire


def test_cache_off_wins_memory_where_hops_are_free():
    """P = 1, V = 2: every hop is a self-hop, so the cache saves no bytes and only costs memory."""
    planner = Planner(_request())
    on = planner.evaluate(_candidate(schedule="interleaved_1f1b", n_virtual=2, dp_shard="replicate"))
    off = planner.evaluate(_candidate(schedule="interleaved_1f1b", n_virtual=2, dp_shard="replicate", cache=False))
    assert on["bytes_per_hop"] == off["bytes_per_hop"] == 0
    assert on["step_time_s"] == pytest.approx(off["step_time_s"])
    assert off["peak_memory_bytes"] < on["peak_memory_bytes"]


def test_standard_residual_has_no_cache_to_turn_off():
    assert {c.cache for c in candidates(_request("standard"))} == {True}
    assert {c.cache for c in candidates(_request())} == {True, False}


# ---- GPipe ----

def test_gpipe_is_a_candidate_with_the_closed_form_bubble():
    request = _request()
    found = [c for c in candidates(request) if c.schedule == "gpipe"]
    assert found and {c.n_virtual for c in found} == {1}
    n_stages, m = 4, 4
    closed = closed_form_bubble_fraction(n_stages, 1, m, "gpipe")
    assert closed == pytest.approx((n_stages - 1) / (m + n_stages - 1))  # docs/spec.md section 5
    result = simulate(build_schedule("gpipe", n_stages, 1, m), unit_costs(n_stages, 1))
    assert 1 - sum(result.compute_s) / (n_stages * result.makespan) == pytest.approx(closed)
    # Priced as 1F1B (the same bubble), but it holds every microbatch's activations.
    planner = Planner(request)
    gpipe = _candidate(schedule="gpipe", n_stages=4, data_parallel=1, n_microbatches=8, dp_shard="replicate")
    one_f = dataclasses.replace(gpipe, schedule="1f1b")
    (gpipe_step, gpipe_peak), (one_f_step, one_f_peak) = planner.estimate(gpipe), planner.estimate(one_f)
    assert gpipe_step == pytest.approx(one_f_step)
    assert gpipe_peak > one_f_peak
    row = planner.evaluate(gpipe)
    assert row["peak_memory_bytes"] > planner.evaluate(one_f)["peak_memory_bytes"]
    assert "--schedule gpipe" in row["command"]


# ---- the controllable-memory V schedules ----

def test_v_half_and_v_min_are_candidates_holding_less_than_zbv():
    request = _request(gpus=8, global_batch=32)
    found = [c for c in candidates(request) if c.schedule in ("v_half", "v_min")]
    assert {c.schedule for c in found} == {"v_half", "v_min"}
    assert {c.n_virtual for c in found} == {2}
    assert all(c.n_microbatches >= 2 * c.n_stages for c in found)  # the fewest they run (v_memory)
    assert {c.n_stages for c in found} >= {2, 4}
    # One layout under each V-shaped schedule: the same step's compute, fewer activation sets held.
    planner = Planner(request)
    base = _candidate(schedule="zbv", n_stages=4, n_virtual=2, n_microbatches=8, data_parallel=2,
                      dp_shard="replicate", block_size=2)
    estimates = {name: planner.estimate(dataclasses.replace(base, schedule=name))
                 for name in ("zbv", "v_half", "v_min")}
    assert estimates["v_min"][1] < estimates["v_half"][1] < estimates["zbv"][1]
    rows = {name: planner.evaluate(dataclasses.replace(base, schedule=name)) for name in ("zbv", "v_half", "v_min")}
    assert rows["v_min"]["peak_memory_bytes"] < rows["v_half"]["peak_memory_bytes"] < rows["zbv"]["peak_memory_bytes"]
    # The bubble they pay for it: the simulated one is above ZB-V's.
    assert rows["v_min"]["bubble_fraction"] > rows["zbv"]["bubble_fraction"]
    assert "--schedule v_min" in rows["v_min"]["command"] and "--virtual 2" in rows["v_min"]["command"]


# ---- fsdp ----

def test_fsdp_prices_all_gather_and_reduce_scatter_replicate_the_all_reduce():
    request = _request()
    planner = Planner(request)
    bandwidth, latency = _link(request)
    shapes = rank_parameter_shapes(dataclasses.replace(request.model, block_size=4),
                                   planner.chunk_costs(_candidate())[0], 0)
    numel = sum(math.prod(s) for s in shapes)
    padded = sum(shard_numel(s, 4, "fsdp") for s in shapes) * 4
    fsdp = planner.evaluate(_candidate())["dp_collectives"]
    replicate = planner.evaluate(_candidate(dp_shard="replicate"))["dp_collectives"]
    assert fsdp["all_gathers"] == 1 and fsdp["all_reduce_s"] == 0.0
    assert fsdp["all_gather_s"] == pytest.approx(ring_all_gather_s(2 * padded, 4, bandwidth, latency))  # bf16
    assert fsdp["reduce_scatter_s"] == pytest.approx(ring_reduce_scatter_s(4 * padded, 4, bandwidth, latency))
    assert replicate["all_gather_s"] == replicate["reduce_scatter_s"] == 0.0
    assert replicate["all_reduce_s"] == pytest.approx(ring_all_reduce_s(4 * numel, 4, bandwidth, latency))
    # The cost model's direction: gathering bf16 parameters is cheaper than the fp32 half of the all-reduce.
    expected = (ring_all_gather_s(2 * padded, 4, bandwidth, latency) + ring_reduce_scatter_s(4 * padded, 4, bandwidth,
                latency)) - ring_all_reduce_s(4 * numel, 4, bandwidth, latency)
    assert expected < 0
    assert (fsdp["total_s"] - replicate["total_s"]) == pytest.approx(expected)


def test_reshard_after_forward_always_gathers_again_and_costs_time():
    planner = Planner(_request())
    base = _candidate(n_stages=2, data_parallel=2, n_microbatches=4)
    never = planner.evaluate(base)
    always = planner.evaluate(dataclasses.replace(base, reshard_after_forward="always"))
    assert never["dp_collectives"]["all_gathers"] == 1  # rank with one chunk: gathered once a step
    # Every F reshards: the next action of the chunk (its backward, or the next F) gathers again.
    assert always["dp_collectives"]["all_gathers"] > never["dp_collectives"]["all_gathers"] + 1
    per_gather = never["dp_collectives"]["all_gather_s"]
    assert always["dp_collectives"]["all_gather_s"] == pytest.approx(
        always["dp_collectives"]["all_gathers"] * per_gather)
    assert always["step_time_s"] > never["step_time_s"]
    # One chunk a rank: each of its actions gathers it, so every moment holds the copy, as never does.
    assert always["peak_memory_bytes"] == never["peak_memory_bytes"]
    argv = shlex.split(always["command"])
    assert "--fsdp-reshard-after-forward" in argv and argv[argv.index("--fsdp-reshard-after-forward") + 1] == "always"
    args, unknown = build_parser(argv[1:]).parse_known_args(argv[1:])
    assert not [a for a in unknown if a.startswith("--")]
    assert {c.reshard_after_forward for c in candidates(_request()) if c.dp_shard == "fsdp"} == {"never", "always"}
    assert {c.reshard_after_forward for c in candidates(_request()) if c.dp_shard == "replicate"} == {"never"}


# ---- --why ----

@pytest.mark.parametrize("candidate", [
    _candidate(schedule="zb_h1", n_stages=2, data_parallel=2, n_microbatches=4, activation_checkpoint="selective"),
    _candidate(schedule="interleaved_1f1b", n_stages=2, n_virtual=2, data_parallel=2, dp_shard="replicate"),
    _candidate(schedule="1f1b", n_stages=4, data_parallel=1, dp_shard="replicate", cache=False),
    _candidate(schedule="interleaved_zb", n_stages=2, n_virtual=2, data_parallel=2, reshard_after_forward="always"),
])
def test_why_terms_sum_to_the_row(candidate):
    terms = Planner(_request()).explain(candidate)
    row = terms["row"]
    assert sum(value for _label, value in terms["memory"]) == row["peak_memory_bytes"]
    assert sum(value for _label, value in terms["time"]) == pytest.approx(row["step_time_s"], rel=1e-12)
    assert all(value >= -1e-12 for label, value in terms["time"])


_ARGV = ["simulate", "plan", "--layers", "8", "--d-model", "1024", "--heads", "8", "--seq-len", "2048",
         "--global-batch", "16", "--gpus", "4", "--gpu-memory-gib", "12", "--top", "3"]


def test_cli_why_prints_terms_that_sum(capsys):
    assert main([*_ARGV, "--why", "2"]) == 0
    out = capsys.readouterr().out
    why = out[out.index("why row 2"):].splitlines()
    memory = [int(m.group(1)) for line in why if (m := re.search(r"\((-?\d+) B\)$", line))]
    assert len(memory) == 8  # six terms, the overlap correction, the per rank max
    assert sum(memory[:-1]) == memory[-1]
    seconds = [float(m.group(1)) for line in why[why.index("time per step:") + 1:]
               if (m := re.search(r"(-?[\d.]+) s$", line))]
    assert len(seconds) == 7  # compute, bubble, hops, all-reduce, all-gather, reduce-scatter; per step
    assert sum(seconds[:-1]) == pytest.approx(seconds[-1], abs=1e-3)
    assert main([*_ARGV, "--why", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    row = report["rows"][1]
    assert sum(report["why"]["memory_bytes"].values()) == row["peak_memory_bytes"]
    assert sum(report["why"]["time_s"].values()) == pytest.approx(row["step_time_s"])


@pytest.mark.parametrize("value, message", [("4", "error: --why 4: the plan has 3 rows"),
                                            ("-1", "error: --why"), ("x", "error: --why")])
def test_cli_bad_why_is_one_error_line(capsys, value, message):
    assert main([*_ARGV, "--why", value]) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and captured.err.startswith(message)
    assert captured.out == ""
