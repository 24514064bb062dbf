"""Metrics of a simulated step: makespan, bubbles in both conventions, in-flight microbatches,
block-cache memory and bytes per step.

Bubble conventions (docs/spec.md section 5):
    bubble_fraction = idle / (ranks x makespan)          -> (P-1)/(V m + P - 1) for unit costs
    bubble_ratio    = idle / compute (idle over ideal)   -> (P-1)/(V m)
Idle is every second of the makespan a rank is not running F or B (or I and W: waiting, or
sending when communication is not overlapped). With unit costs a zero-bubble schedule leaves idle
only P - 1 of 1F1B's 3 (P - 1) per rank: ZB-H1 (P-1)/(3m + P - 1) (the published figure),
interleaved with the split (P-1)/(3 V m + P - 1) and ZB-V, V = 2, (P-1)/(6m + P - 1). DualPipeV
(V = 2, m >= 2P) leaves (P - 1)/2 idle per rank as ZB-V does, so the same (P-1)/(6m + P - 1): unit
costs price its paired F&B slot as F + B, and the pairing gains only where the overlap makes F&B
cheaper than that.
"""

from __future__ import annotations

from attnres_pp.comm.plan import PayloadPlan
from attnres_pp.schedule import v_memory
from attnres_pp.schedule.ir import INPUT_GRAD_KINDS, ActionKind, Schedule
from attnres_pp.schedule.schedules import SPLIT_SCHEDULES
from attnres_pp.simulator.comm import format_bytes
from attnres_pp.simulator.engine import SimResult


def closed_form_bubble_fraction(n_stages: int, n_virtual: int, n_microbatches: int,
                                schedule: str = "1f1b") -> float:
    """(P-1)/(k V m + P - 1) with k = 3 for the split schedules (they hold for m >= P; ZB-V for
    m >= 2P - 1, DualPipeV for every m it runs, m >= 2P), k = 1 for GPipe, 1F1B and interleaved 1F1B.
    V-Half and V-Min: I / (3m + I), I their idle per rank (`v_memory.closed_form_idle_per_rank`)."""
    if schedule in v_memory.V_MEMORY_SCHEDULES:
        return v_memory.closed_form_bubble_fraction(schedule, n_stages, n_microbatches)
    k = 3 if schedule in SPLIT_SCHEDULES else 1
    return (n_stages - 1) / (k * n_virtual * n_microbatches + n_stages - 1)


def closed_form_bubble_ratio(n_stages: int, n_virtual: int, n_microbatches: int, schedule: str = "1f1b") -> float:
    """Idle over compute: (P-1)/(k V m), k as in `closed_form_bubble_fraction`; V-Half, V-Min I / (3m)."""
    if schedule in v_memory.V_MEMORY_SCHEDULES:
        return v_memory.closed_form_idle_per_rank(schedule, n_stages) / (3 * n_microbatches)
    k = 3 if schedule in SPLIT_SCHEDULES else 1
    return (n_stages - 1) / (k * n_virtual * n_microbatches)


def closed_form_min_microbatches(schedule: str, n_stages: int) -> int:
    """The fewest microbatches for which the closed forms are exact (ZB-V: 2P - 1; DualPipeV: 2P,
    the fewest it runs; zb_h1: P)."""
    if schedule == "zbv":
        return 2 * n_stages - 1
    if schedule == "dualpipev" or schedule in v_memory.V_MEMORY_SCHEDULES:
        return 2 * n_stages
    return n_stages if schedule in SPLIT_SCHEDULES else 1


def closed_form_label(schedule: str) -> tuple[str, str]:
    """How the closed forms of `schedule` print: (fraction, ratio)."""
    if schedule in v_memory.V_MEMORY_SCHEDULES:
        return "I/(3m+I) (I: idle per rank)", "I/(3m)"
    k = "3" if schedule in SPLIT_SCHEDULES else ""
    return f"(P-1)/({k}Vm+P-1)", f"(P-1)/({k}Vm)"


def peak_in_flight(schedule: Schedule) -> list[dict[str, int]]:
    """Per rank, the most activation sets alive at once: (chunk, mb) pairs between their F and B
    (or W, which frees the last of them), and distinct microbatches with any such pair. Depends
    only on each rank's order."""
    kind_f, kind_b, kind_w = ActionKind.F, ActionKind.B, ActionKind.W
    peaks = []
    for actions in schedule.rank_actions:
        live_pairs, peak_pairs, peak_microbatches = 0, 0, 0
        pairs_per_microbatch = [0] * schedule.n_microbatches
        live_microbatches = 0
        for action in actions:
            kind = action.kind
            if kind is kind_f:
                live_pairs += 1
                peak_pairs = max(peak_pairs, live_pairs)
                if pairs_per_microbatch[action.microbatch_index] == 0:
                    live_microbatches += 1
                    peak_microbatches = max(peak_microbatches, live_microbatches)
                pairs_per_microbatch[action.microbatch_index] += 1
            elif kind is kind_b or kind is kind_w:
                live_pairs -= 1
                pairs_per_microbatch[action.microbatch_index] -= 1
                if pairs_per_microbatch[action.microbatch_index] == 0:
                    live_microbatches -= 1
        peaks.append({"chunk_microbatches": peak_pairs, "microbatches": peak_microbatches})
    return peaks


def peak_cache_tensors(schedule: Schedule, plan: PayloadPlan) -> list[int]:
    """Per rank, the most block-cache entries alive at once (tensors of one microbatch each).

    An entry is put by F(c, mb) (plan.chunks[c].cache_puts) and lives until B(c, mb) (or I): after
    the last reader's forward frees the value, the gradient deposits of the later chunks' reads stay
    until the backward reaches the chunk that put the entry and collects them.
    """
    puts = [len(io.cache_puts) for io in plan.chunks]
    kind_f = ActionKind.F
    peaks = []
    for actions in schedule.rank_actions:
        live, peak = 0, 0
        for action in actions:
            if action.kind is kind_f:
                live += puts[action.chunk_index]
                peak = max(peak, live)
            elif action.kind in INPUT_GRAD_KINDS:
                live -= puts[action.chunk_index]
        peaks.append(peak)
    return peaks


def summarize(result: SimResult, *, plan: PayloadPlan | None = None, tensor_bytes: int | None = None) -> dict:
    """Everything `simulate schedule` reports. Byte and cache figures need the plan and the bytes
    of one tensor (tokens x width x element size)."""
    schedule = result.schedule
    n_stages, n_virtual, n_microbatches = schedule.n_stages, schedule.n_virtual, schedule.n_microbatches
    makespan = result.makespan
    busy = result.compute_s
    idle = [makespan - b for b in busy]
    total_busy = sum(busy)
    in_flight = peak_in_flight(schedule)
    report = {
        "schedule": schedule.name, "stages": n_stages, "virtual": n_virtual, "microbatches": n_microbatches,
        "costs": result.costs.label, "overlap_comm": result.costs.overlap_comm,
        "makespan": makespan,
        "bubble_fraction": sum(idle) / (n_stages * makespan) if makespan else 0.0,
        "bubble_ratio": sum(idle) / total_busy if total_busy else 0.0,
        "closed_form_bubble_fraction": closed_form_bubble_fraction(n_stages, n_virtual, n_microbatches,
                                                                   schedule.name),
        "closed_form_bubble_ratio": closed_form_bubble_ratio(n_stages, n_virtual, n_microbatches, schedule.name),
        "per_rank": {
            "compute_s": busy,
            "idle_s": idle,
            "peak_in_flight_microbatches": [p["microbatches"] for p in in_flight],
            "peak_in_flight_chunk_microbatches": [p["chunk_microbatches"] for p in in_flight],
        },
        "simulated_actions": result.n_actions,
        "simulator_wall_s": result.wall_s,
    }
    if plan is not None and tensor_bytes is not None:
        per_direction = sum(plan.fwd_hop_tensors) * tensor_bytes * n_microbatches
        report["mode"] = plan.mode
        report["bytes_per_step"] = 2 * per_direction
        report["bytes_per_step_note"] = "forward activations plus the same again in backward gradients"
        cache = peak_cache_tensors(schedule, plan)
        report["per_rank"]["peak_cache_tensors"] = cache
        report["per_rank"]["peak_cache_bytes"] = [n * tensor_bytes for n in cache]
    return report


def format_summary(report: dict) -> str:
    """A few readable lines of the summary (the JSON form has everything)."""
    per_rank = report["per_rank"]
    fraction_form, ratio_form = closed_form_label(report["schedule"])
    fewest = closed_form_min_microbatches(report["schedule"], report["stages"])
    if report["microbatches"] < fewest:
        fraction_form = f"for m >= {fewest} only: {fraction_form}"
    lines = [
        f"{report['schedule']}: P={report['stages']} V={report['virtual']} m={report['microbatches']} "
        f"({report['costs']} costs{'' if report['overlap_comm'] else ', communication not overlapped'})",
        f"makespan            {report['makespan']:.6g}",
        f"bubble_fraction     {report['bubble_fraction']:.4f}  (idle / (ranks x makespan); "
        f"closed form {fraction_form} = {report['closed_form_bubble_fraction']:.4f})",
        f"bubble_ratio        {report['bubble_ratio']:.4f}  (idle / compute; "
        f"closed form {ratio_form} = {report['closed_form_bubble_ratio']:.4f})",
        f"peak in-flight mbs  per rank {_compact(per_rank['peak_in_flight_microbatches'])}",
        f"peak live (chunk,mb) per rank {_compact(per_rank['peak_in_flight_chunk_microbatches'])}",
    ]
    if "bytes_per_step" in report:
        lines.append(f"bytes per step      {format_bytes(report['bytes_per_step'])} ({report['mode']}, "
                     f"both directions)")
        lines.append(f"peak cache memory   per rank "
                     f"{_compact([format_bytes(b) for b in per_rank['peak_cache_bytes']])}")
    lines.append(f"simulated {report['simulated_actions']} actions in {report['simulator_wall_s']:.2f} s")
    return "\n".join(lines)


def _compact(values: list) -> str:
    """Short list text: long per-rank lists show the first and last few entries."""
    shown = [str(v) for v in values]
    if len(shown) > 12:
        shown = shown[:6] + ["..."] + shown[-3:]
    return "[" + ", ".join(shown) + "]"
