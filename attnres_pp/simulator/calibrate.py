"""Costs calibrated from a measured run: RUN_DIR/trace.json (Chrome trace, action names as the IR
prints them) and RUN_DIR/summary.json (its `config` holds `pipeline` and `model`).

Per chunk the median F and B durations (a split-backward run: B = median I + median W, and W's
share kept); per hop and direction the median transfer time. A
receive's duration mixes waiting for the sender's compute with the transfer, and a receive posted
after the data arrived shows neither. So a message is a clean sample of the transfer only when
the receiver was already waiting as the send was posted; its transfer time is then receive end -
send start. A hop with no clean sample falls back to the median receive duration (its transfers
were hidden behind compute). This needs one wall clock across ranks (one host, or synced clocks).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from attnres_pp.model.config import ModelConfig
from attnres_pp.schedule.ir import Action, ActionKind
from attnres_pp.schedule.timeline import account, bubble_fraction
from attnres_pp.schedule.trace import TimelineEvent, read_chrome_trace
from attnres_pp.simulator.costs import CostModel


@dataclass(frozen=True, kw_only=True)
class Calibration:
    schedule_name: str
    n_stages: int
    n_virtual: int
    n_microbatches: int
    cache: bool
    model: ModelConfig | None
    microbatch_tokens: int | None
    costs: CostModel
    measured_makespan_s: float
    measured_bubble_fraction: float


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def _read_summary(run_dir: Path) -> dict:
    path = run_dir / "summary.json"
    if not path.is_file():
        raise ValueError(f"{path} is missing: --calibrate-from needs a run directory written by `attnres-pp train`")
    try:
        summary = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON ({error}): point --calibrate-from at a finished run") from None
    config = summary.get("config", {}) if isinstance(summary, dict) else {}
    pipeline = config.get("pipeline") if isinstance(config, dict) else None
    if not isinstance(pipeline, dict) or not {"stages", "virtual"} <= set(pipeline):
        raise ValueError(f"{path} has no config.pipeline section with stages and virtual: is it a pipelined run?")
    return config


def _model_from(config: dict) -> ModelConfig | None:
    values = config.get("model")
    if not values:
        return None
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    return ModelConfig.from_dict({k: v for k, v in values.items() if k in known})


def calibrate_from(run_dir: str | Path, *, runtime_overhead: bool = True) -> Calibration:
    """Read a measured run and derive a CostModel for the same schedule.

    With `runtime_overhead` (the default) every F and B also carries the runtime's measured work per
    compute action (packing and posting sends, receive work, gaps between actions): the simulator
    knows only compute and links, and without it predicts steps 6-19% short on 2 CPU cores.
    """
    run_dir = Path(run_dir)
    config = _read_summary(run_dir)
    pipeline, train = config["pipeline"], config.get("train", {})
    n_stages, n_virtual = int(pipeline["stages"]), int(pipeline["virtual"])
    n_microbatches = int(pipeline.get("microbatches", train.get("microbatches", 0)))
    if n_microbatches < 1:
        raise ValueError(f"{run_dir / 'summary.json'}: no microbatch count in config.pipeline or config.train")
    trace_path = run_dir / "trace.json"
    if not trace_path.is_file():
        raise ValueError(f"{trace_path} is missing: run training with tracing enabled")
    try:
        events = read_chrome_trace(trace_path)
    except (ValueError, KeyError, TypeError) as error:  # JSONDecodeError is a ValueError
        raise ValueError(f"{trace_path} is not a Chrome trace written by `attnres-pp train` ({error!r})") from None
    if not events:
        raise ValueError(f"{trace_path} holds no complete ('X') events")
    n_chunks = n_stages * n_virtual
    costs = _costs_from_events(events, n_chunks, trace_path)
    if runtime_overhead:
        costs = with_overhead(costs, account(events, n_stages)["overhead_s_per_compute"],
                              split=costs.weight_s is not None)
    model = _model_from(config)
    tokens = None
    if model is not None and "batch_size" in train:
        tokens = int(train["batch_size"]) // n_microbatches * model.seq_len
    makespan = max(e.end_s for e in events) - min(e.start_s for e in events)
    bubble = bubble_fraction(events, n_stages)
    return Calibration(schedule_name=str(pipeline.get("schedule", "interleaved_1f1b")), n_stages=n_stages,
                       n_virtual=n_virtual, n_microbatches=n_microbatches, cache=bool(pipeline.get("cache", True)),
                       model=model, microbatch_tokens=tokens, costs=costs, measured_makespan_s=makespan,
                       measured_bubble_fraction=bubble)


def _costs_from_events(events: list[TimelineEvent], n_chunks: int, source: Path) -> CostModel:
    forward: list[list[float]] = [[] for _ in range(n_chunks)]
    backward: list[list[float]] = [[] for _ in range(n_chunks)]
    split = {ActionKind.I: [[] for _ in range(n_chunks)], ActionKind.W: [[] for _ in range(n_chunks)]}
    sends: dict[tuple[str, int, int], TimelineEvent] = {}
    receives: dict[tuple[str, int, int], TimelineEvent] = {}
    for event in events:
        try:
            action = Action.parse(event.name)
        except ValueError:
            continue  # other spans (optimizer step, all-reduce) do not enter the costs
        if not 0 <= action.chunk_index < n_chunks:
            raise ValueError(f"{source}: {event.name} names chunk {action.chunk_index}, "
                             f"but the run has {n_chunks} chunks")
        if action.kind is ActionKind.F:
            forward[action.chunk_index].append(event.end_s - event.start_s)
        elif action.kind is ActionKind.B:
            backward[action.chunk_index].append(event.end_s - event.start_s)
        elif action.kind in split:
            split[action.kind][action.chunk_index].append(event.end_s - event.start_s)
        else:
            (sends if action.is_send else receives)[action.message_id] = event
    weight = None
    if any(split[ActionKind.I]):  # a split-backward run: B = I + W, and W's share is kept
        weight = tuple(_median(w) for w in split[ActionKind.W])
        backward = [[_median(i) + w] if i else [] for i, w in zip(split[ActionKind.I], weight, strict=True)]
    missing = [c for c in range(n_chunks) if not forward[c] or not backward[c]]
    if missing:
        raise ValueError(f"{source}: no F and B (or I) events for chunks {missing}; is the trace complete?")
    # Per hop: (clean transfer samples, all receive durations), forward and backward direction.
    hop_fwd = [([], []) for _ in range(n_chunks - 1)]
    hop_bwd = [([], []) for _ in range(n_chunks - 1)]
    for message_id, receive in receives.items():
        direction, sending_chunk, _ = message_id
        clean, durations = hop_fwd[sending_chunk] if direction == "F" else hop_bwd[sending_chunk - 1]
        durations.append(receive.end_s - receive.start_s)
        send = sends.get(message_id)
        if send is not None and receive.start_s <= send.start_s:
            clean.append(max(0.0, receive.end_s - send.start_s))

    def hop_time(clean: list[float], durations: list[float]) -> float:
        return _median(clean) if clean else _median(durations)

    return CostModel(forward_s=tuple(_median(v) for v in forward), backward_s=tuple(_median(v) for v in backward),
                     hop_fwd_s=tuple(hop_time(*h) for h in hop_fwd), hop_bwd_s=tuple(hop_time(*h) for h in hop_bwd),
                     weight_s=weight, label=f"calibrated from {source.parent}")


def with_overhead(costs: CostModel, overhead_s: float, *, split: bool = False) -> CostModel:
    """`costs` with `overhead_s` added to every F and B (the runtime's per-action work); with
    `split` (a schedule of I and W) the backward is two actions, so I and W get it each."""
    weight = costs.weight_s
    if split:
        weight = tuple(w + overhead_s for w in costs.split_s[1])
    extra = 2 * overhead_s if split else overhead_s
    return dataclasses.replace(costs, forward_s=tuple(f + overhead_s for f in costs.forward_s),
                               backward_s=tuple(b + extra for b in costs.backward_s), weight_s=weight,
                               label=costs.label + " + measured runtime overhead")
