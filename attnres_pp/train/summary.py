"""Run records on disk: `metrics.jsonl` (one JSON object per step) and `summary.json` (written
atomically at the end), plus the one-line progress print and the one-line summary."""

from __future__ import annotations

import json
import math
import os
import statistics
from pathlib import Path


def write_json_atomic(path: str | Path, obj: dict) -> None:
    """Write `obj` as JSON to `path` via a temporary file and `os.replace`, so a reader never sees
    a half-written file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with tmp.open("w") as handle:
        json.dump(_jsonable(obj), handle, indent=2)
        handle.write("\n")
    os.replace(tmp, path)


class MetricsLog:
    """Appends one JSON object per line to `DIR/metrics.jsonl` (truncated when opened)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._handle = self.path.open("w")

    def write(self, record: dict) -> None:
        self._handle.write(json.dumps(_jsonable(record)) + "\n")
        self._handle.flush()

    def close(self) -> None:
        self._handle.close()


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def progress_line(step: int, steps: int, loss: float, lr: float, tokens_per_s: float) -> str:
    width = len(str(steps))
    return f"step {step + 1:>{width}}/{steps} | loss {loss:.4f} | lr {lr:.2e} | {tokens_per_s:,.0f} tok/s"


def describe_summary(summary: dict) -> str:
    """One line of a summary.json: first and last loss, final validation loss, median step time."""
    losses, step_s = summary["losses"], summary.get("step_time_s")
    steps = f"{len(losses)} steps, "
    timing = f", median step {step_s * 1e3:.1f} ms" if isinstance(step_s, int | float) else ""
    val = summary.get("val_loss")
    return (steps + f"loss {losses[0]:.4f} -> {losses[-1]:.4f}"
            + (f", val {val:.4f}" if isinstance(val, int | float) else "") + timing)


def _jsonable(value):
    """Plain JSON types only; non-finite floats become None (JSON has no NaN)."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, str | int | bool) or value is None:
        return value
    if hasattr(value, "item"):  # numpy / torch scalars
        return _jsonable(value.item())
    return str(value)
