"""`attnres-pp bench comm`: bytes and time per step of the four hop payloads (standard, Full AttnRes
naive, Block AttnRes naive, Block AttnRes with the cross-stage cache), counted by the transport and
predicted by the simulator.

1. Counted bytes, across depth, P, V and block size: one step of each configuration through the
   runtime over the in-process loopback transport (the same runtime and byte ledger as gloo, a tiny
   model so the whole grid takes seconds), against `simulator.comm.comm_report` (the planner's
   prediction). Every counted figure must equal the prediction.
2. Time per step over gloo (local launcher, P = 2, one thread per rank) for the four modes on the
   benchmark model: bytes the DistTransport counted, the pipeline window, the time inside send and
   receive actions, the measured wire time (clean deliveries: receiver already waiting), the
   simulator's alpha-beta prediction of wire time ("cpu" link profile), and the simulated step on
   costs calibrated from the run.
3. A PNG of bytes per step against depth (planner lines, counted points).
4. Hop bytes per tensor-parallel rank at T = 1, 2, 4 with sequence parallelism (docs/spec.md
   section 10): predicted by the same planner (`comm.plan.shard_tokens`) for the counted grid's
   layouts, and counted on one training step of local rank processes (gloo, P x T of them) for
   one layout: each tp lane's ranks' sent bytes (`bytes_sent_per_step_per_rank`) must equal the
   prediction for every lane.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from pathlib import Path

from attnres_pp.bench.bubbles import calibrated_costs, simulate_each_step
from attnres_pp.bench.common import (
    BENCH_MODEL,
    MICROBATCH_SIZE,
    TimedEngine,
    markdown_table,
    median_accounting,
    message_pairs,
    random_batch,
    relative_link,
    run_config,
)
from attnres_pp.schedule.schedules import build_schedule
from attnres_pp.simulator.comm import COMM_MODES, comm_report
from attnres_pp.simulator.costs import PROFILES

MODE_LABELS = {"standard": "standard", "full_naive": "Full naive", "naive": "Block naive", "cached": "Block cached"}
TINY_MODEL = {"vocab_size": 64, "d_model": 32, "n_heads": 2, "seq_len": 16}
TINY_MICROBATCH = 2


def model_for_mode(mode: str, base: dict, block_size: int) -> tuple[dict, bool]:
    """(model dict, cache flag) that makes the runtime send `mode`'s payloads."""
    if mode == "standard":
        return {**base, "residual": "standard", "block_size": 1}, False
    if mode == "full_naive":
        return {**base, "residual": "attnres", "block_size": 1}, False
    return {**base, "residual": "attnres", "block_size": block_size}, mode == "cached"


def predicted_bytes_per_step(mode: str, *, n_layers: int, block_size: int, n_stages: int, n_virtual: int,
                             tokens: int, d_model: int, n_microbatches: int) -> int:
    """The simulator's bytes per step (fp32, forward and backward, m microbatches)."""
    report = comm_report(n_layers=n_layers, block_size=block_size, n_stages=n_stages, n_virtual=n_virtual,
                         tokens=tokens, d_model=d_model, source_width=d_model, dtype="fp32")
    return report.bytes_per_microbatch_both_directions[mode] * n_microbatches


def count_bytes(mode: str, n_layers: int, block_size: int, n_stages: int, n_virtual: int) -> dict:
    """One step of the in-process pipeline; its ledger's bytes against the prediction."""
    from attnres_pp.train.engines import make_engine

    n_microbatches = n_stages
    model, cache = model_for_mode(mode, {**TINY_MODEL, "n_layers": n_layers}, block_size)
    run_cfg = run_config(model, stages=n_stages, virtual=n_virtual, schedule="interleaved_1f1b",
                         microbatches=n_microbatches, microbatch_size=TINY_MICROBATCH, cache=cache,
                         launcher="inprocess")
    engine = make_engine(run_cfg)
    inputs_BT, targets_BT = random_batch(0, run_cfg.train.batch_size, model["seq_len"], model["vocab_size"])
    extras = engine.train_step(0, inputs_BT, targets_BT, 1e-3).extras
    predicted = predicted_bytes_per_step(
        mode, n_layers=n_layers, block_size=1 if mode == "full_naive" else block_size, n_stages=n_stages,
        n_virtual=n_virtual, tokens=TINY_MICROBATCH * model["seq_len"], d_model=model["d_model"],
        n_microbatches=n_microbatches)
    return {"mode": mode, "layers": n_layers, "block_size": block_size, "P": n_stages, "V": n_virtual,
            "m": n_microbatches, "fwd_hop_tensors": extras["fwd_hop_tensors"],
            "counted_bytes_per_step": extras["bytes_sent_per_step"], "predicted_bytes_per_step": predicted,
            "match": extras["bytes_sent_per_step"] == predicted}


def grid(quick: bool) -> list[tuple[int, int, int, int]]:
    """(layers, block size, P, V) points of the counted-bytes grid."""
    layers = (8, 16) if quick else (8, 16, 32, 64)
    blocks = (2, 4) if quick else (2, 4, 8)
    virtuals = (1, 2) if quick else (1, 2, 4)
    return [(n, s, p, v) for n in layers for s in blocks for p in (2, 4) for v in virtuals if p * v <= n]


TP_SIZES_SHOWN = (1, 2, 4)


def tp_hop_rows(quick: bool) -> list[dict]:
    """Predicted forward + backward hop bytes per step of one tp rank's pair (d, p, t) -> (d, p + 1, t),
    at T = 1, 2, 4 with sequence parallelism, for the counted grid's layouts at its largest block size."""
    largest = max(s for _n, s, _p, _v in grid(quick))
    rows = []
    for n_layers, block_size, n_stages, n_virtual in grid(quick):
        if block_size != largest:
            continue
        tokens = TINY_MICROBATCH * TINY_MODEL["seq_len"]
        reports = {t: comm_report(n_layers=n_layers, block_size=block_size, n_stages=n_stages, n_virtual=n_virtual,
                                  tokens=tokens, d_model=TINY_MODEL["d_model"], source_width=TINY_MODEL["d_model"],
                                  dtype="fp32", tensor_parallel=t, sequence_parallel=True) for t in TP_SIZES_SHOWN}
        for mode in COMM_MODES:
            rows.append({"mode": mode, "layers": n_layers, "block_size": block_size, "P": n_stages, "V": n_virtual,
                         "m": n_stages, "bytes_per_step_per_tp_rank": {
                             str(t): r.bytes_per_microbatch_both_directions[mode] * n_stages
                             for t, r in reports.items()}})
    return rows


TP_MODEL = {**TINY_MODEL, "n_heads": 4}  # T = 4 must divide the heads
TP_COUNTED_LAYOUT = (8, 4, 2, 2)  # (layers, block size, P, V) of the counted tp runs
TP_COUNTED_MODES = ("naive", "cached")


def count_tp_hop_bytes(mode: str, tensor_parallel: int) -> dict:
    """One step of `mode` at `TP_COUNTED_LAYOUT` on P x T local rank processes with sequence
    parallelism: each tp lane's counted hop bytes (the sum over its P ranks of what each sent)
    against the planner's bytes per tp rank's lanes."""
    from attnres_pp.pipeline.mesh import RankCoords
    from attnres_pp.train.config import RunConfig
    from attnres_pp.train.engines import make_engine

    n_layers, block_size, n_stages, n_virtual = TP_COUNTED_LAYOUT
    model, cache = model_for_mode(mode, {**TP_MODEL, "n_layers": n_layers}, block_size)
    base = run_config(model, stages=n_stages, virtual=n_virtual, schedule="interleaved_1f1b",
                      microbatches=n_stages, microbatch_size=TINY_MICROBATCH, cache=cache).to_dict()
    base["train"]["device"] = "cpu"
    base["pipeline"]["tensor_parallel"] = tensor_parallel
    run_cfg = RunConfig.from_dict(base)
    engine = make_engine(run_cfg)
    try:
        inputs_BT, targets_BT = random_batch(0, run_cfg.train.batch_size, model["seq_len"], model["vocab_size"])
        per_rank = engine.train_step(0, inputs_BT, targets_BT, 1e-3).extras["bytes_sent_per_step_per_rank"]
    finally:
        engine.close()
    lanes = [sum(per_rank[RankCoords(t, 1, n_stages, tensor_parallel).global_rank(p)] for p in range(n_stages))
             for t in range(tensor_parallel)]
    report = comm_report(n_layers=n_layers, block_size=block_size, n_stages=n_stages, n_virtual=n_virtual,
                         tokens=TINY_MICROBATCH * TP_MODEL["seq_len"], d_model=TP_MODEL["d_model"],
                         source_width=TP_MODEL["d_model"], dtype="fp32", tensor_parallel=tensor_parallel,
                         sequence_parallel=True)
    predicted = report.bytes_per_microbatch_both_directions[mode] * n_stages
    return {"mode": mode, "layers": n_layers, "block_size": block_size, "P": n_stages, "V": n_virtual,
            "m": n_stages, "T": tensor_parallel, "counted_bytes_per_rank": per_rank,
            "counted_bytes_per_tp_lane": lanes, "predicted_bytes_per_tp_lane": predicted,
            "match": all(lane == predicted for lane in lanes)}


def counted_tp_rows(progress: Callable[[str], None]) -> list[dict]:
    rows = [count_tp_hop_bytes(mode, t) for mode in TP_COUNTED_MODES for t in TP_SIZES_SHOWN]
    progress(f"  tp hop bytes counted on {len(rows)} gloo runs, "
             f"{sum(r['match'] for r in rows)} equal to the planner's per-lane prediction")
    return rows


def counted_grid(quick: bool, progress: Callable[[str], None]) -> list[dict]:
    rows, seen = [], set()
    for n_layers, block_size, n_stages, n_virtual in grid(quick):
        for mode in COMM_MODES:
            # standard and Full naive do not depend on the block size: count them once
            key = (mode, n_layers, n_stages, n_virtual, block_size if mode in ("naive", "cached") else 0)
            if key in seen:
                continue
            seen.add(key)
            rows.append(count_bytes(mode, n_layers, block_size, n_stages, n_virtual))
    mismatches = [r for r in rows if not r["match"]]
    progress(f"  counted bytes: {len(rows)} runs, {len(rows) - len(mismatches)} equal to the planner's prediction")
    return rows


def _wire_samples(events) -> list[float]:
    """Clean deliveries (the receiver was already waiting when the send was posted): send start to
    receive end, seconds."""
    return [receive[3] - send[2] for send, receive in message_pairs(events) if receive[2] <= send[2]]


def time_mode(mode: str, *, n_virtual: int, block_size: int, n_microbatches: int, warmup: int, steps: int,
              progress: Callable[[str], None]) -> dict:
    n_stages = 2
    model, cache = model_for_mode(mode, BENCH_MODEL, block_size)
    run_cfg = run_config(model, stages=n_stages, virtual=n_virtual, schedule="interleaved_1f1b",
                         microbatches=n_microbatches, cache=cache)
    engine = TimedEngine(run_cfg)
    try:
        for _ in range(warmup + steps):
            engine.step()
    finally:
        engine.close()
    samples = engine.samples[warmup:]
    acc = median_accounting(samples, n_stages)
    tokens = MICROBATCH_SIZE * BENCH_MODEL["seq_len"]
    predicted = predicted_bytes_per_step(
        mode, n_layers=BENCH_MODEL["n_layers"], block_size=1 if mode == "full_naive" else block_size,
        n_stages=n_stages, n_virtual=n_virtual, tokens=tokens, d_model=BENCH_MODEL["d_model"],
        n_microbatches=n_microbatches)
    n_messages = 2 * n_microbatches * (n_stages * n_virtual - 1)
    link = PROFILES["cpu"]
    predicted_wire = n_messages * link.link_latency_s + predicted / link.link_bytes_per_s
    wire = [statistics.median(_wire_samples(s.events) or [0.0]) for s in samples]
    schedule = build_schedule("interleaved_1f1b", n_stages, n_virtual, n_microbatches)
    per_step = simulate_each_step(schedule, calibrated_costs(run_cfg, samples), samples, n_stages)
    simulated = statistics.median(r.makespan for r in per_step)
    capacity = n_stages * acc["step_s"]
    row = {
        "mode": mode, "label": MODE_LABELS[mode], "layers": BENCH_MODEL["n_layers"], "block_size": block_size,
        "P": n_stages, "V": n_virtual, "m": n_microbatches,
        "counted_bytes_per_step": statistics.median(s.bytes_sent for s in samples),
        "predicted_bytes_per_step": predicted,
        "messages_per_step": n_messages,
        "measured_step_s": acc["step_s"],
        "wall_step_s": statistics.median(s.wall_s for s in samples),
        "send_s_per_step": acc["send"] * capacity,
        "recv_s_per_step": acc["recv"] * capacity,
        "recv_wait_s_per_step": acc["idle"] * capacity,
        "wire_s_per_message": statistics.median(wire),
        "wire_s_per_step": statistics.median(wire) * n_messages,
        "predicted_wire_s_per_step": predicted_wire,
        "simulated_step_s": simulated,
        "step_time_error": simulated / acc["step_s"] - 1.0,
    }
    progress(f"  gloo {MODE_LABELS[mode]}: {row['counted_bytes_per_step'] / 2**20:.2f} MiB/step "
             f"(predicted {predicted / 2**20:.2f}), step {row['measured_step_s'] * 1e3:.0f} ms, "
             f"send {row['send_s_per_step'] * 1e3:.1f} ms, wire {row['wire_s_per_step'] * 1e3:.1f} ms "
             f"(alpha-beta {predicted_wire * 1e3:.1f} ms)")
    return row


def depth_plot(rows: list[dict], out_dir: Path) -> Path:
    """Bytes per step against depth at P = 2, V = 2, block size 4 of the tiny model: planner lines
    over every depth, the counted points of the grid on top."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    depths = (8, 16, 32, 64)
    tokens = TINY_MICROBATCH * TINY_MODEL["seq_len"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for index, mode in enumerate(COMM_MODES):
        predicted = [predicted_bytes_per_step(mode, n_layers=n, block_size=1 if mode == "full_naive" else 4,
                                              n_stages=2, n_virtual=2, tokens=tokens, d_model=TINY_MODEL["d_model"],
                                              n_microbatches=2) / 2**20 for n in depths]
        ax.plot(depths, predicted, linestyle=("-", "--", ":", "-.")[index], marker="o", label=MODE_LABELS[mode])
        counted = sorted((r["layers"], r["counted_bytes_per_step"] / 2**20) for r in rows
                         if r["mode"] == mode and r["P"] == 2 and r["V"] == 2
                         and (r["block_size"] == 4 or mode in ("standard", "full_naive")))
        if counted:
            ax.scatter(*zip(*counted, strict=True), marker="x", s=90, color="black", zorder=5)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(depths)
    ax.set_xticklabels([str(d) for d in depths])
    ax.set_xlabel("layers (2 sublayers each)")
    ax.set_ylabel("MiB per step (forward + backward)")
    ax.set_title(f"Bytes per step vs depth: P=2, V=2, block 4 sublayers, m=2, {tokens} tokens/mb, "
                 f"d={TINY_MODEL['d_model']}, fp32\nlines: simulator (planner); x: counted by the transport",
                 fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "comm_bytes_vs_depth.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def add_arguments(parser) -> None:
    parser.add_argument("--no-timing", action="store_true",
                        help="count and predict bytes, skip the multi-process timing runs")


def run_options(args) -> dict:
    return {"timing": not args.no_timing}


def run(quick: bool, out_dir: Path | None, progress: Callable[[str], None], *, timing: bool = True) -> dict:
    rows = counted_grid(quick, progress)
    timed = []
    if timing:
        warmup, steps = (2, 5) if quick else (3, 12)
        for mode in COMM_MODES:
            timed.append(time_mode(mode, n_virtual=4, block_size=2, n_microbatches=4, warmup=warmup, steps=steps,
                                   progress=progress))
    payload = {
        "counted": rows,
        "all_counted_match_predicted": all(r["match"] for r in rows),
        "tp_hop_bytes": tp_hop_rows(quick),
        "tp_hop_bytes_counted": counted_tp_rows(progress) if timing else [],
        "gloo": timed,
        "gloo_counted_match_predicted": all(r["counted_bytes_per_step"] == r["predicted_bytes_per_step"]
                                            for r in timed),
        "tiny_model": {**TINY_MODEL, "microbatch_size": TINY_MICROBATCH},
        "timing_model": {**BENCH_MODEL, "microbatch_size": MICROBATCH_SIZE},
    }
    if out_dir is not None:
        payload["plot"] = str(depth_plot(rows, out_dir))
    return payload


def to_markdown(payload: dict) -> str:
    counted = payload["counted"]
    grid_table = markdown_table(
        ["layers", "block size", "P", "V", "mode", "fwd tensors per hop", "counted B/step", "predicted B/step",
         "equal"],
        [[r["layers"], r["block_size"] if r["mode"] in ("naive", "cached") else "-", r["P"], r["V"],
          MODE_LABELS[r["mode"]], ",".join(map(str, r["fwd_hop_tensors"])), r["counted_bytes_per_step"],
          r["predicted_bytes_per_step"], "yes" if r["match"] else "NO"] for r in counted])
    lines = [
        "## Communication per step: counted by the transport vs predicted by the simulator", "",
        f"Tiny model {payload['tiny_model']}, interleaved 1F1B with m = P, fp32, forward + backward. "
        f"All {len(counted)} counted figures equal the prediction: "
        f"{'yes' if payload['all_counted_match_predicted'] else 'NO'}.", "",
        grid_table, "",
    ]
    if payload.get("tp_hop_bytes"):
        sizes = list(payload["tp_hop_bytes"][0]["bytes_per_step_per_tp_rank"])
        lines += [
            "## Hop bytes per tensor-parallel rank (predicted)", "",
            "Forward + backward bytes per step of one tp rank's hop pair (d, p, t) -> (d, p + 1, t) with sequence "
            "parallelism, same tiny model and m = P (docs/spec.md section 10: 1/T of the T = 1 bytes). Predicted by "
            "the payload planner; the counted runs are in the next table.", "",
            markdown_table(["layers", "block size", "P", "V", "mode", *(f"T = {t} B/step" for t in sizes)],
                           [[r["layers"], r["block_size"] if r["mode"] in ("naive", "cached") else "-", r["P"], r["V"],
                             MODE_LABELS[r["mode"]], *(r["bytes_per_step_per_tp_rank"][t] for t in sizes)]
                            for r in payload["tp_hop_bytes"]]),
            "",
        ]
    if payload.get("tp_hop_bytes_counted"):
        rows = payload["tp_hop_bytes_counted"]
        lines += [
            "## Hop bytes per tensor-parallel rank, counted (gloo, one training step)", "",
            f"Model {TP_MODEL} with sequence parallelism, interleaved 1F1B, m = P, fp32: one step on P x T "
            "local rank processes. Per rank: the pipeline hop bytes each global rank sent "
            "(`summary.json`'s `bytes_sent_per_step_per_rank`, rank = p T + t); per lane: the sum over the P "
            "ranks of tp lane t, against the planner's forward + backward bytes of one lane. All equal: "
            f"{'yes' if all(r['match'] for r in rows) else 'NO'}.", "",
            markdown_table(["layers", "block size", "P", "V", "mode", "T", "counted B/step per rank",
                            "counted B/step per lane", "predicted B/step per lane", "equal"],
                           [[r["layers"], r["block_size"], r["P"], r["V"], MODE_LABELS[r["mode"]], r["T"],
                             ", ".join(map(str, r["counted_bytes_per_rank"])),
                             ", ".join(map(str, r["counted_bytes_per_tp_lane"])), r["predicted_bytes_per_tp_lane"],
                             "yes" if r["match"] else "NO"] for r in rows]),
            "",
        ]
    if payload["gloo"]:
        timed = payload["gloo"]
        lines += [
            "## Time per step over gloo (P = 2, V = 4, block size 2 sublayers, m = 4)", "",
            f"Model {payload['timing_model']}. Wire time: median clean delivery (receiver already waiting, "
            "send start to receive end) x messages; alpha-beta: the simulator's 'cpu' link profile "
            "(50 us + bytes / 2 GB/s per message). Simulated step: calibrated links, each step's "
            "own F/B and runtime overhead, median over steps (as `bench bubbles`).", "",
            markdown_table(
                ["mode", "MiB/step counted", "MiB/step predicted", "messages", "step (ms)", "send (ms)",
                 "recv work (ms)", "waiting (ms)", "wire (ms)", "alpha-beta wire (ms)", "simulated step (ms)", "error"],
                [[r["label"], r["counted_bytes_per_step"] / 2**20, r["predicted_bytes_per_step"] / 2**20,
                  r["messages_per_step"], 1e3 * r["measured_step_s"], 1e3 * r["send_s_per_step"],
                  1e3 * r["recv_s_per_step"], 1e3 * r["recv_wait_s_per_step"], 1e3 * r["wire_s_per_step"],
                  1e3 * r["predicted_wire_s_per_step"], 1e3 * r["simulated_step_s"],
                  f"{r['step_time_error']:+.1%}"] for r in timed]),
            "",
        ]
    if "plot" in payload:
        lines.append(f"![bytes per step vs depth]({relative_link(payload['plot'])})")
    return "\n".join(lines)
