"""`attnres-pp bench`: the command line, the cheap comm benchmark end to end (counted bytes equal
the planner's), the closed-form bubbles, the time accounting on synthetic events, and the peer
benchmark's stage modules against the whole model. No multi-process benchmark runs here."""

from __future__ import annotations

import json

import pytest
import torch

from attnres_pp.bench.bubbles import with_overhead
from attnres_pp.bench.common import BENCH_MODEL, account, analytic_bubble, message_pairs, random_batch
from attnres_pp.cli import build_parser, main
from attnres_pp.schedule.schedules import build_schedule
from attnres_pp.simulator.costs import unit_costs
from attnres_pp.simulator.engine import simulate
from attnres_pp.simulator.metrics import summarize


def test_bench_cli_parses():
    args = build_parser().parse_args(["bench", "bubbles", "--quick", "--json", "--out", "somewhere"])
    assert (args.name, args.quick, args.json, args.out) == ("bubbles", True, True, "somewhere")
    for name in ("comm", "overhead", "peer", "split"):
        assert build_parser().parse_args(["bench", name]).name == name
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "nonsense"])


def test_no_timing_is_for_comm_only(tmp_path, capsys):
    with pytest.raises(SystemExit) as refused:  # argparse's refusal: peer has no such flag
        main(["bench", "peer", "--no-timing", "--out", str(tmp_path)])
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unrecognized arguments: --no-timing") and "--no-timing applies to comm only" in err
    assert not list(tmp_path.iterdir())


def test_bench_comm_quick_json(tmp_path, capsys, monkeypatch):
    from attnres_pp.bench import comm

    # The quick grid at 8 layers only (24 of its 48 in-process steps): P = 2 and 4, V = 1 and 2, block
    # sizes 2 and 4, one to four layers a chunk. Its 16-layer half repeats those layouts deeper; the
    # planner's counts there are the spec's golden ones (test_simulator.py, 32 sublayers at P = 4,
    # V = 4) and the runtime counts the plan's hop tensors on every case of test_parity.py.
    quick_grid = comm.grid
    monkeypatch.setattr(comm, "grid", lambda quick: [point for point in quick_grid(quick) if point[0] == 8])
    assert main(["bench", "comm", "--quick", "--no-timing", "--json", "--out", str(tmp_path)]) == 0
    payload = json.loads(capsys.readouterr().out)
    for key in ("benchmark", "counted", "all_counted_match_predicted", "gloo", "machine", "command", "plot"):
        assert key in payload, key
    assert payload["all_counted_match_predicted"] is True
    modes = {row["mode"] for row in payload["counted"]}
    assert modes == {"standard", "full_naive", "naive", "cached"}
    for row in payload["counted"]:
        assert row["counted_bytes_per_step"] == row["predicted_bytes_per_step"] > 0
        if row["mode"] == "standard":
            assert row["fwd_hop_tensors"] == [1] * (row["P"] * row["V"] - 1)
    written = sorted(p.name for p in tmp_path.iterdir())
    stems = {name.rsplit(".", 1)[0] for name in written if name.startswith("comm_quick_")}
    assert len(stems) == 1, written
    stem = stems.pop()
    assert {f"{stem}.json", f"{stem}.md", stem} <= set(written)
    assert (tmp_path / stem / "comm_bytes_vs_depth.png").is_file()
    assert f"]({stem}/comm_bytes_vs_depth.png)" in (tmp_path / f"{stem}.md").read_text()
    assert json.loads((tmp_path / f"{stem}.json").read_text())["all_counted_match_predicted"] is True


@pytest.mark.parametrize("name,p,v,m", [("gpipe", 2, 1, 4), ("1f1b", 4, 1, 8), ("interleaved_1f1b", 4, 2, 8),
                                        ("interleaved_1f1b", 2, 4, 8), ("interleaved_1f1b", 4, 2, 7),
                                        ("zb_h1", 4, 1, 8), ("interleaved_zb", 2, 2, 5), ("zbv", 3, 2, 5),
                                        ("dualpipev", 3, 2, 6), ("dualpipev", 4, 2, 9)])
def test_analytic_bubble_matches_the_unit_cost_simulator(name, p, v, m):
    analytic = analytic_bubble(name, p, v, m)
    k = 3 if name in ("zb_h1", "interleaved_zb", "zbv", "dualpipev") else 1  # the split's idle is a third of 1F1B's
    assert analytic["fraction"] == pytest.approx((p - 1) / (k * v * m + p - 1))
    assert analytic["ratio"] == pytest.approx((p - 1) / (k * v * m))
    simulated = summarize(simulate(build_schedule(name, p, v, m), unit_costs(p, v)))
    assert simulated["bubble_fraction"] == pytest.approx(analytic["fraction"])


def _synthetic_step():
    """Two ranks over [0, 10] s: rank 0 computes F0.0 (0-2), sends SF0.0 (2-2.5), idles in RB0.0
    (3-6: it was sent at 5.5-6), computes B0.0 (6-9); rank 1 waits in RF1.0 (0-2.6), computes
    F1.0 (3-5) and B1.0 (5-5.5), sends SB1.0 (5.5-6), then its flush (6-6.2) ends at 6.2, idle to 10."""
    return [
        (0, "F0.0", 0.0, 2.0, "compute"), (0, "SF0.0", 2.0, 2.5, "comm"), (0, "RB0.0", 3.0, 6.0, "comm"),
        (0, "B0.0", 6.0, 9.0, "compute"), (0, "flush", 9.0, 10.0, "comm"),
        (1, "RF1.0", 0.0, 2.6, "comm"), (1, "F1.0", 3.0, 5.0, "compute"), (1, "B1.0", 5.0, 5.5, "compute"),
        (1, "SB1.0", 5.5, 6.0, "comm"), (1, "flush", 6.0, 6.2, "comm"),
    ]


def test_account_splits_the_bubble_into_idle_recv_send_and_dispatch():
    acc = account(_synthetic_step(), 2)
    capacity = 2 * 10.0
    assert acc["step_s"] == pytest.approx(10.0)
    assert acc["compute_s_per_rank"] == pytest.approx((2 + 3 + 2 + 0.5) / 2)
    assert acc["bubble"] == pytest.approx(1 - 7.5 / capacity)
    # gaps: rank 0 2.5 -> 3.0; rank 1 2.6 -> 3.0
    assert acc["dispatch"] == pytest.approx(0.9 / capacity)
    assert acc["dispatch_us_per_action"] == pytest.approx(1e6 * 0.9 / 8)
    assert acc["send"] == pytest.approx(1.0 / capacity)
    # No message was complete before its receive began (SF0.0 ended 2.5, RF1.0 began 0), so no
    # receive work is charged: every second in receives and flushes is idle, plus rank 1's tail.
    assert acc["recv"] == 0.0
    assert acc["idle"] == pytest.approx((3.0 + 1.0 + 2.6 + 0.2 + 3.8) / capacity)
    parts = acc["idle"] + acc["recv"] + acc["send"] + acc["dispatch"]
    assert parts == pytest.approx(acc["bubble"])
    assert acc["overhead_s_per_compute"] == pytest.approx((0.9 + 1.0) / 4)


def test_receive_work_is_charged_from_receives_whose_message_was_already_there():
    events = [
        (0, "F0.0", 0.0, 1.0, "compute"), (0, "SF0.0", 1.0, 1.1, "comm"),
        (1, "RF1.0", 2.0, 2.2, "comm"), (1, "F1.0", 2.2, 3.0, "compute"),
    ]
    assert [(s[1], r[1]) for s, r in message_pairs(events)] == [("SF0.0", "RF1.0")]
    acc = account(events, 2)
    assert acc["recv"] == pytest.approx(0.2 / (2 * 3.0))
    assert acc["idle"] + acc["recv"] + acc["send"] + acc["dispatch"] == pytest.approx(acc["bubble"])


def test_with_overhead_adds_to_every_forward_and_backward():
    costs = with_overhead(unit_costs(2, 2), 0.25)
    assert costs.forward_s == (0.75,) * 4 and costs.backward_s == (1.25,) * 4
    assert costs.hop_fwd_s == unit_costs(2, 2).hop_fwd_s


def test_step_costs_of_a_split_step_keep_w_apart():
    """A measured zb_h1 step (P = 2, one microbatch): B = I + W per chunk, W's share kept; no
    runtime overhead here (actions back to back, no sends), so the costs are the durations."""
    from attnres_pp.bench.bubbles import step_costs
    from attnres_pp.bench.common import StepSample

    events = [(0, "F0.0", 0.0, 1.0, "compute"), (0, "RB0.0", 1.0, 2.5, "comm"), (1, "F1.0", 1.0, 2.0, "compute"),
              (1, "I1.0", 2.0, 2.5, "compute"), (1, "W1.0", 2.5, 3.5, "compute"),
              (0, "I0.0", 2.5, 3.25, "compute"), (0, "W0.0", 3.25, 3.5, "compute")]
    costs = step_costs(unit_costs(2, 1), StepSample(3.5, events, 0, 0.0), 2)
    assert costs.forward_s == (1.0, 1.0) and costs.backward_s == (1.0, 1.5) and costs.weight_s == (0.25, 1.0)


def test_random_batch_is_a_pure_function_of_seed_and_step():
    a_inputs, a_targets = random_batch(3, 4, 8, 50, seed=1)
    b_inputs, _ = random_batch(3, 4, 8, 50, seed=1)
    assert torch.equal(a_inputs, b_inputs) and a_inputs.shape == (4, 8) and int(a_inputs.max()) < 50
    assert torch.equal(a_inputs[:, 1:], a_targets[:, :-1])
    assert not torch.equal(random_batch(4, 4, 8, 50, seed=1)[0], a_inputs)


def test_torch_stage_modules_chain_to_the_whole_model():
    """The peer benchmark's stages (our chunks as torch.distributed.pipelining modules) compute the
    single-process model's logits and loss."""
    from attnres_pp.bench.torch_pipe import TorchStageModule, lm_loss_fn
    from attnres_pp.comm.partition import make_partition
    from attnres_pp.model import ModelConfig, Transformer
    from attnres_pp.pipeline.chunk import build_rank_chunks

    cfg = ModelConfig.from_dict({**BENCH_MODEL, "d_model": 32, "n_layers": 4, "seq_len": 16,
                                 "residual": "standard"})
    torch.manual_seed(0)
    model = Transformer(cfg)
    partition = make_partition(cfg.n_layers, 2, 2)
    chunks = {**build_rank_chunks(model, partition, 0), **build_rank_chunks(model, partition, 1)}
    inputs_BT, targets_BT = random_batch(0, 2, cfg.seq_len, cfg.vocab_size)
    x = inputs_BT
    for c in range(partition.n_chunks):
        x = TorchStageModule(chunks[c])(x)
    torch.testing.assert_close(x, model(inputs_BT), rtol=0, atol=0)
    torch.testing.assert_close(lm_loss_fn(x, targets_BT), model(inputs_BT, targets_BT), rtol=0, atol=0)


def test_split_benchmark_measures_b_and_i_plus_w_per_chunk():
    from attnres_pp.bench.split import MODELS, measure

    rows = measure(MODELS["block_cached"], rounds=2, warmup=0)
    assert [r["chunk"] for r in rows] == [0, 1, 2, 3]
    assert all(r["B_ms"] > 0 and r["W_ms"] > 0 and r["ratio"] > 0 for r in rows)
    # Chunk 0 has no inputs to send gradients for: its I is empty and W does the whole backward.
    assert rows[0]["I_ms"] < rows[0]["W_ms"] and all(r["I_ms"] > 0.1 * r["B_ms"] for r in rows[1:])
