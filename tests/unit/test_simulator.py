"""The simulator against closed forms (docs/spec.md): section 4.1 golden counts, section 4.2 formulas,
section 5 bubbles; plus the engine's timing rules, metrics, trace export and calibration."""

from __future__ import annotations

import json

import pytest

from attnres_pp.comm.partition import make_partition
from attnres_pp.comm.plan import plan_payloads
from attnres_pp.schedule.ir import Action, Schedule
from attnres_pp.schedule.schedules import build_schedule
from attnres_pp.schedule.trace import read_chrome_trace, write_chrome_trace
from attnres_pp.schedule.validate import ScheduleError
from attnres_pp.simulator.calibrate import calibrate_from
from attnres_pp.simulator.comm import closed_form_cached, closed_form_naive, comm_report
from attnres_pp.simulator.costs import CostModel, unit_costs
from attnres_pp.simulator.engine import simulate
from attnres_pp.simulator.metrics import (
    closed_form_bubble_fraction,
    closed_form_bubble_ratio,
    peak_cache_tensors,
    peak_in_flight,
    summarize,
)


@pytest.fixture
def simulate_cli(monkeypatch):
    """`attnres_pp.cli.main`, which imports only the subcommand it runs (here: no torch import)."""
    from attnres_pp import cli

    return cli.main


# docs/spec.md section 4.1: (L sublayers, S, P, V, naive per hop, cached per hop)
GOLDEN = [
    (16, 4, 4, 2, [2, 2, 3, 3, 4, 4, 5], [2, 2, 3, 2, 2, 2, 2]),
    (16, 2, 4, 2, [2, 3, 4, 5, 6, 7, 8], [2, 3, 4, 3, 3, 3, 3]),
    (32, 4, 4, 4, [2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7, 8, 8, 9], [2, 2, 3] + [2] * 12),
    (16, 1, 4, 2, [3, 5, 7, 9, 11, 13, 15], [3, 5, 7, 6, 6, 6, 6]),
    (16, 16, 4, 2, [2] * 7, [2, 2, 2, 1, 1, 1, 1]),
]


@pytest.mark.parametrize(("n_sublayers", "block_size", "n_stages", "n_virtual", "naive", "cached"), GOLDEN)
def test_comm_json_matches_spec_golden_counts(simulate_cli, capsys, n_sublayers, block_size, n_stages,
                                              n_virtual, naive, cached):
    argv = ["simulate", "comm", "--layers", str(n_sublayers // 2), "--block-size", str(block_size),
            "--stages", str(n_stages), "--virtual", str(n_virtual), "--d-model", "64", "--tokens", "10",
            "--dtype", "fp32", "--json"]
    assert simulate_cli(argv) == 0
    out = json.loads(capsys.readouterr().out)
    hops = out["fwd_hop_tensors"]
    assert hops["naive"] == naive
    assert hops["cached"] == cached
    assert hops["standard"] == [1] * (n_stages * n_virtual - 1)
    n_chunks = n_stages * n_virtual  # Full AttnRes: b_0 and every earlier sublayer output
    assert hops["full_naive"] == [(c + 1) * n_sublayers // n_chunks + 1 for c in range(n_chunks - 1)]
    assert out["bytes_per_microbatch"]["cached"] == sum(cached) * 10 * 64 * 4
    assert out["bytes_per_microbatch_both_directions"]["naive"] == 2 * sum(naive) * 10 * 64 * 4


@pytest.mark.parametrize("n_stages", [1, 2, 3, 4])
@pytest.mark.parametrize("n_virtual", [1, 2, 3, 4])
def test_closed_forms_with_one_block_per_chunk(n_stages, n_virtual):
    n_chunks = n_stages * n_virtual
    n_layers = 2 * n_chunks  # 4 sublayers per chunk, S = L / C = 4
    report = comm_report(n_layers=n_layers, block_size=4, n_stages=n_stages, n_virtual=n_virtual,
                         tokens=1, d_model=8, source_width=8)
    assert report.fwd_hop_tensors["naive"] == closed_form_naive(n_stages, n_virtual)
    assert report.fwd_hop_tensors["cached"] == closed_form_cached(n_stages, n_virtual)
    if n_stages == 1:  # every hop joins two chunks of the one rank: nothing crosses a wire
        assert all(hops == [0] * (n_chunks - 1) for hops in report.fwd_hop_tensors.values())
        return
    assert sum(report.fwd_hop_tensors["naive"]) == (n_chunks - 1) * (n_chunks + 2) // 2
    # Full AttnRes: hop c carries b_0 and every one of the 4 (c + 1) earlier sublayer outputs.
    assert report.fwd_hop_tensors["full_naive"] == [4 * (c + 1) + 1 for c in range(n_chunks - 1)]


def test_projected_keys_widen_attnres_tensors_only(simulate_cli, capsys):
    argv = ["simulate", "comm", "--layers", "8", "--block-size", "4", "--stages", "4", "--virtual", "2",
            "--residual", "lr_attnres", "--key-mode", "projected", "--key-rank", "16", "--d-model", "64",
            "--tokens", "2", "--json"]
    assert simulate_cli(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["source_width"] == 80
    assert out["bytes_per_microbatch"]["standard"] == 7 * 2 * 64 * 2
    assert out["bytes_per_microbatch"]["cached"] == 15 * 2 * 80 * 2


def _unit_cases():
    for n_stages in (1, 2, 3, 4):
        for n_microbatches in (n_stages, 2 * n_stages, 3 * n_stages):
            yield "gpipe", n_stages, 1, n_microbatches
            yield "1f1b", n_stages, 1, n_microbatches
            for n_virtual in (1, 2, 3):
                yield "interleaved_1f1b", n_stages, n_virtual, n_microbatches


@pytest.mark.parametrize(("name", "n_stages", "n_virtual", "n_microbatches"), list(_unit_cases()))
def test_unit_cost_bubble_is_the_closed_form(name, n_stages, n_virtual, n_microbatches):
    result = simulate(build_schedule(name, n_stages, n_virtual, n_microbatches), unit_costs(n_stages, n_virtual))
    report = summarize(result)
    expected = (n_stages - 1) / (n_virtual * n_microbatches + n_stages - 1)
    assert abs(report["bubble_fraction"] - expected) < 1e-9
    assert abs(report["bubble_fraction"] - closed_form_bubble_fraction(n_stages, n_virtual, n_microbatches)) < 1e-9
    assert abs(report["bubble_ratio"] - closed_form_bubble_ratio(n_stages, n_virtual, n_microbatches)) < 1e-9
    assert abs(result.makespan - 3 * (n_microbatches + (n_stages - 1) / n_virtual)) < 1e-9


def _split_cases():
    for n_stages in (1, 2, 3, 4, 5):
        for n_microbatches in range(n_stages, 3 * n_stages + 2):
            yield "zb_h1", n_stages, 1, n_microbatches
            for n_virtual in (1, 2, 3):
                yield "interleaved_zb", n_stages, n_virtual, n_microbatches
            if n_microbatches >= 2 * n_stages - 1:
                yield "zbv", n_stages, 2, n_microbatches


@pytest.mark.parametrize(("name", "n_stages", "n_virtual", "n_microbatches"), list(_split_cases()))
def test_split_schedules_reach_their_closed_forms_with_unit_costs(name, n_stages, n_virtual, n_microbatches):
    """F = I = W = 1 per rank and microbatch: ZB-H1 reaches the published (P-1)/(3m+P-1), a third
    of 1F1B's idle time; interleaved with the split (P-1)/(3Vm+P-1), ZB-V (V = 2) the same."""
    result = simulate(build_schedule(name, n_stages, n_virtual, n_microbatches), unit_costs(n_stages, n_virtual))
    report = summarize(result)
    p, m, v = n_stages, n_microbatches, n_virtual
    assert abs(report["bubble_fraction"] - (p - 1) / (3 * v * m + p - 1)) < 1e-9
    assert abs(report["bubble_fraction"] - closed_form_bubble_fraction(p, v, m, name)) < 1e-9
    assert abs(report["bubble_ratio"] - closed_form_bubble_ratio(p, v, m, name)) < 1e-9
    assert abs(result.makespan - (3 * m + (p - 1) / v)) < 1e-9  # 1F1B: 3 (m + (P-1)/V)
    # The unit costs split B = 2 into I = W = 1 (per rank, over its V chunks).
    assert unit_costs(p, v).split_s == ((1 / v,) * p * v, (1 / v,) * p * v)


def test_zero_bubble_memory_is_1f1b_memory():
    """ZB-H1 holds at most P microbatches' activations (F to W) on a rank, as 1F1B does on its
    first; ZB-V holds 2P chunk-microbatches of half size: P microbatches' worth."""
    for p, m in ((2, 6), (4, 8), (4, 16)):
        ours = peak_in_flight(build_schedule("zb_h1", p, 1, m))
        theirs = peak_in_flight(build_schedule("1f1b", p, 1, m))
        assert max(x["microbatches"] for x in ours) == max(x["microbatches"] for x in theirs) == p
        assert max(x["chunk_microbatches"] for x in peak_in_flight(build_schedule("zbv", p, 2, m))) == 2 * p


def test_summary_prints_the_schedule_s_closed_form(simulate_cli, capsys):
    argv = ["simulate", "schedule", "--schedule", "zb_h1", "--stages", "4", "--microbatches", "8"]
    assert simulate_cli(argv) == 0
    out = capsys.readouterr().out
    assert "closed form (P-1)/(3Vm+P-1) = 0.1111" in out and "bubble_fraction     0.1111" in out
    assert simulate_cli(["simulate", "schedule", "--schedule", "zbv", "--stages", "4", "--virtual", "2",
                         "--microbatches", "4", "--layers", "8", "--block-size", "2", "--d-model", "64"]) == 0
    assert "for m >= 7 only" in capsys.readouterr().out
    with pytest.raises(ValueError, match="weight_s needs one entry per chunk"):
        CostModel(forward_s=(1.0,), backward_s=(2.0,), hop_fwd_s=(), hop_bwd_s=(), weight_s=(3.0,))


def test_larger_schedule_still_exact():
    result = simulate(build_schedule("interleaved_1f1b", 16, 4, 64), unit_costs(16, 4))
    assert abs(summarize(result)["bubble_fraction"] - 15 / (4 * 64 + 15)) < 1e-9


def _costs(forward, backward, link, overlap=True):
    n_hops = len(forward) - 1
    return CostModel(forward_s=tuple(forward), backward_s=tuple(backward), hop_fwd_s=(link,) * n_hops,
                     hop_bwd_s=(link,) * n_hops, overlap_comm=overlap)


def test_engine_timing_by_hand():
    # One microbatch over two ranks: F0, link, F1, B1, link, B0.
    result = simulate(build_schedule("1f1b", 2, 1, 1), _costs([1, 1], [2, 2], 0.5))
    assert result.makespan == pytest.approx(1 + 0.5 + 1 + 2 + 0.5 + 2)
    events = {e.name: e for e in result.events()}
    assert events["RF1.0"].start_s == 0 and events["RF1.0"].end_s == pytest.approx(1.5)
    assert events["SF0.0"].end_s == pytest.approx(1.0)  # overlapped: the sender is not held


def test_no_overlap_keeps_the_sender_busy():
    schedule = build_schedule("1f1b", 2, 1, 4)
    overlapped = simulate(schedule, _costs([1, 1], [2, 2], 0.5))
    serial = simulate(schedule, _costs([1, 1], [2, 2], 0.5, overlap=False))
    assert serial.makespan > overlapped.makespan
    assert {e.name: e for e in serial.events()}["SF0.0"].end_s == pytest.approx(1.5)


def test_simulating_a_deadlock_raises_with_the_table():
    lowered = Schedule.parse("schedule broken P=2 V=1 m=1\n"
                             "rank 0: F0.0 RB0.0 SF0.0 B0.0\n"
                             "rank 1: RF1.0 F1.0 B1.0 SB1.0")
    with pytest.raises(ScheduleError, match=r"(?s)deadlocks.*blocked \| \[RB0\.0\] \| \[RF1\.0\]"):
        simulate(lowered, unit_costs(2, 1))


def test_in_flight_and_cache_memory():
    # 1F1B keeps P - rank microbatches in flight (fewer if m is smaller).
    peaks = peak_in_flight(build_schedule("1f1b", 4, 1, 8))
    assert [p["microbatches"] for p in peaks] == [4, 3, 2, 1]
    assert [p["microbatches"] for p in peak_in_flight(build_schedule("1f1b", 4, 1, 2))] == [2, 2, 2, 1]
    # Entries put by F(c, mb) live until B(c, mb): under GPipe all m microbatches' entries coexist.
    partition = make_partition(8, 4, 2)  # one block (2 sublayers) per chunk
    plan = plan_payloads(n_sublayers=16, block_size=2, partition=partition, mode="cached")
    puts = [len(io.cache_puts) for io in plan.chunks]
    assert puts == [2, 3, 4, 5, 0, 0, 0, 0]  # b_0..b_{c+1} on the first chunks; last chunks store none
    assert peak_cache_tensors(build_schedule("gpipe", 4, 2, 3), plan) == [6, 9, 12, 15]


def test_trace_round_trip(tmp_path):
    result = simulate(build_schedule("interleaved_1f1b", 2, 2, 2), unit_costs(2, 2))
    path = write_chrome_trace(result.events(), tmp_path / "trace.json")
    trace_events = json.loads(path.read_text())["traceEvents"]
    raw = next(e for e in trace_events if e["ph"] == "X")
    assert set(raw) == {"name", "ph", "ts", "dur", "pid", "tid", "cat"}
    assert {e["pid"]: e["args"]["name"] for e in trace_events if e["ph"] == "M"} == {0: "rank 0", 1: "rank 1"}
    events = read_chrome_trace(path)
    assert [(e.rank, e.name, e.category) for e in events] == [(e.rank, e.name, e.category)
                                                              for e in result.events()]
    Action.parse(events[0].name)
    # Measured traces carry wall-clock timestamps: the timeline starts at the earliest event.
    from attnres_pp.simulator.plot import plot_timeline

    shifted = [e._replace(start_s=e.start_s + 1.7e9, end_s=e.end_s + 1.7e9) for e in events]
    assert plot_timeline(shifted, tmp_path / "measured.png").stat().st_size > 0


def test_calibration_recovers_costs_and_makespan(tmp_path):
    costs = CostModel(forward_s=(1e-3, 2e-3, 1.5e-3, 3e-3), backward_s=(2e-3, 4e-3, 3e-3, 6e-3),
                      hop_fwd_s=(1e-4, 2e-4, 3e-4), hop_bwd_s=(1e-4, 2e-4, 5e-4))
    measured = simulate(build_schedule("interleaved_1f1b", 2, 2, 4), costs)
    write_chrome_trace(measured.events(), tmp_path / "trace.json")
    summary = {"config": {"pipeline": {"stages": 2, "virtual": 2, "microbatches": 4,
                                       "schedule": "interleaved_1f1b", "cache": True},
                          "model": {"n_layers": 4, "d_model": 64, "block_size": 2},
                          "train": {"batch_size": 8, "microbatches": 4}}}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    calibration = calibrate_from(tmp_path)
    assert calibration.costs.forward_s == pytest.approx(costs.forward_s)
    assert calibration.costs.backward_s == pytest.approx(costs.backward_s)
    assert calibration.microbatch_tokens == 2 * 64
    assert calibration.measured_makespan_s == pytest.approx(measured.makespan)
    replay = simulate(build_schedule("interleaved_1f1b", 2, 2, 4), calibration.costs)
    assert replay.makespan == pytest.approx(measured.makespan)


def test_calibration_of_a_split_backward_run(tmp_path):
    costs = CostModel(forward_s=(1e-3, 2e-3, 1.5e-3, 3e-3), backward_s=(2e-3, 4e-3, 3e-3, 6e-3),
                      weight_s=(0.5e-3, 1e-3, 2e-3, 1e-3), hop_fwd_s=(1e-4,) * 3, hop_bwd_s=(1e-4,) * 3)
    measured = simulate(build_schedule("interleaved_zb", 2, 2, 4), costs)
    write_chrome_trace(measured.events(), tmp_path / "trace.json")
    summary = {"config": {"pipeline": {"stages": 2, "virtual": 2, "schedule": "interleaved_zb"},
                          "train": {"microbatches": 4}}}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    calibration = calibrate_from(tmp_path, runtime_overhead=False)
    assert calibration.costs.backward_s == pytest.approx(costs.backward_s)
    assert calibration.costs.weight_s == pytest.approx(costs.weight_s)
    replay = simulate(build_schedule("interleaved_zb", 2, 2, 4), calibration.costs)
    assert replay.makespan == pytest.approx(measured.makespan)


def test_cli_comm_table_and_errors(simulate_cli, capsys):
    assert simulate_cli(["simulate", "comm", "--layers", "8", "--block-size", "4", "--stages", "4",
                         "--virtual", "2"]) == 0
    out = capsys.readouterr().out
    assert "cached         2     2     3     2     2     2     2   15" in out
    assert "backward carries the same bytes again" in out
    assert simulate_cli(["simulate", "comm", "--layers", "3", "--block-size", "2", "--stages", "4",
                         "--virtual", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: 3 layers cannot fill") and "\n" not in err


def test_cli_schedule_json_trace_and_plot(simulate_cli, capsys, tmp_path):
    argv = ["simulate", "schedule", "--schedule", "interleaved_1f1b", "--stages", "4", "--virtual", "2",
            "--microbatches", "8", "--layers", "8", "--block-size", "2", "--d-model", "64", "--tokens", "16",
            "--json", "--trace", str(tmp_path / "t.json"), "--plot", str(tmp_path / "t.png")]
    assert simulate_cli(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["bubble_fraction"] == pytest.approx(3 / 19)
    assert report["bubble_ratio"] == pytest.approx(3 / 16)
    assert report["bytes_per_step"] == 2 * 8 * sum([2, 3, 4, 3, 3, 3, 3]) * 16 * 64 * 2
    assert len(report["per_rank"]["peak_cache_bytes"]) == 4
    assert read_chrome_trace(tmp_path / "t.json")
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"


def test_cli_schedule_model_costs_and_refusals(simulate_cli, capsys):
    base = ["simulate", "schedule", "--schedule", "1f1b", "--stages", "2", "--microbatches", "4"]
    assert simulate_cli(base + ["--costs", "model", "--layers", "4", "--block-size", "2", "--d-model", "64",
                                "--profile", "cpu", "--no-overlap"]) == 0
    assert "communication not overlapped" in capsys.readouterr().out
    assert simulate_cli(base + ["--costs", "model"]) == 2
    assert "needs the model" in capsys.readouterr().err
    bad_m = ["simulate", "schedule", "--schedule", "interleaved_1f1b", "--stages", "4", "--virtual", "2",
             "--microbatches", "3"]
    assert simulate_cli(bad_m) == 2
    assert "needs m >= P=4 microbatches" in capsys.readouterr().err


def test_cli_sweep_writes_tables_and_plots(simulate_cli, capsys, tmp_path):
    argv = ["simulate", "sweep", "--out", str(tmp_path), "--layers", "16", "--blocks", "4", "--stages", "2",
            "--microbatches", "4", "--tokens", "8", "--d-model", "16"]
    assert simulate_cli(argv) == 0
    captured = capsys.readouterr()
    assert "### Communication per step vs layers" in captured.out
    assert "### Bubble vs microbatches" in captured.out
    assert "sweep comm_vs_depth" in captured.err  # progress goes to stderr
    names = {p.name for p in tmp_path.iterdir()}
    assert {"comm_vs_depth.png", "comm_vs_blocks.png", "bubble_vs_virtual.png", "sweeps.md"} <= names


@pytest.mark.subprocess
def test_simulator_imports_no_torch():
    """`attnres-pp simulate` must start fast and run where torch is absent: the whole command, through
    the top-level CLI, runs with torch, ray and matplotlib made unimportable."""
    import subprocess
    import sys

    code = ("import sys\n"
            "for name in ('torch', 'ray', 'matplotlib'): sys.modules[name] = None  # import fails\n"
            "from attnres_pp.cli import main\n"
            "for argv in (['comm', '--layers', '8', '--block-size', '4', '--stages', '2', '--virtual', '2'],\n"
            "             ['schedule', '--schedule', 'interleaved_1f1b', '--stages', '2', '--virtual', '2',\n"
            "              '--microbatches', '4', '--layers', '8', '--block-size', '4', '--json']):\n"
            "    assert main(['simulate', *argv]) == 0\n"
            "print('loaded:', sorted(m for m, v in sys.modules.items() if v is not None\n"
            "                        and m.split('.')[0] in ('torch', 'ray', 'numpy')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "loaded: []", out.stdout[-500:]
