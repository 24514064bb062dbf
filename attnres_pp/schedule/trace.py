"""Chrome / Perfetto trace export and import for simulated and measured timelines.

Input and output are plain `TimelineEvent`s (rank, name, start_s, end_s, category), so the
runtime can hand its measured per-action timestamps to the same writers. Format:
    {"traceEvents": [{"name": "F3.1", "ph": "X", "ts": <us>, "dur": <us>, "pid": <rank>,
                      "tid": 0, "cat": "compute" | "comm"}, ...]}
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple


class TimelineEvent(NamedTuple):
    rank: int
    name: str
    start_s: float
    end_s: float
    category: str  # "compute" or "comm"


def to_chrome_trace(events: Iterable[tuple[int, str, float, float, str]]) -> dict:
    trace_events = []
    named_ranks: set[int] = set()
    for rank, name, start_s, end_s, category in events:
        if rank not in named_ranks:
            # Perfetto / chrome://tracing label each process row with this name: one row per rank.
            named_ranks.add(rank)
            trace_events.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
                                 "args": {"name": f"rank {rank}"}})
        trace_events.append({"name": name, "ph": "X", "ts": start_s * 1e6, "dur": (end_s - start_s) * 1e6,
                             "pid": rank, "tid": 0, "cat": category})
    return {"traceEvents": trace_events, "displayTimeUnit": "ms"}


def write_chrome_trace(events: Iterable[tuple[int, str, float, float, str]], path: str | Path) -> Path:
    """Write `events` as Chrome trace JSON (open in chrome://tracing or ui.perfetto.dev)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(to_chrome_trace(events)))
    return path


def read_chrome_trace(path: str | Path) -> list[TimelineEvent]:
    """Complete ("X") events of a trace file; other phases (metadata, counters) are skipped."""
    data = json.loads(Path(path).read_text())
    raw = data["traceEvents"] if isinstance(data, dict) else data
    return [TimelineEvent(int(e["pid"]), e["name"], e["ts"] / 1e6, (e["ts"] + e.get("dur", 0.0)) / 1e6,
                          e.get("cat", "compute"))
            for e in raw if e.get("ph") == "X"]
