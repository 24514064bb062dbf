"""Run records on disk: `metrics.jsonl` (one JSON object per step, appended; a torn tail is dropped,
not fatal) and `summary.json` (written atomically at the end), plus the one-line progress print and
the one-line summary."""

from __future__ import annotations

import contextlib
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
    """Appends one JSON object per line to `DIR/metrics.jsonl`. Opening it first replaces the file,
    atomically, with `records` (what the run keeps: none for a fresh run, the steps of the checkpoint
    a resume or restart continues from), so a torn tail a crash left is gone before anything is
    appended. Each record is one `os.write` of its whole line; a write that fails (a full disk) is
    cut back to the last whole line before the error is raised."""

    def __init__(self, path: str | Path, records: list[dict] = ()) -> None:
        self.path = Path(path)
        tmp = self.path.with_name(f".{self.path.name}.tmp{os.getpid()}")
        try:
            tmp.write_text("".join(_line(record) for record in records))
            os.replace(tmp, self.path)
        finally:
            tmp.unlink(missing_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        self._size = os.fstat(self._fd).st_size

    def write(self, record: dict) -> None:
        data = _line(record).encode()
        try:
            write_all(self._fd, data)
        except OSError as error:
            with contextlib.suppress(OSError):  # best effort: the resume drops a torn tail anyway
                os.ftruncate(self._fd, self._size)
            raise OSError(error.errno, error.strerror, str(self.path)) from error
        self._size += len(data)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def write_all(fd: int, data: bytes) -> None:
    """`os.write` until every byte of `data` is written (a write may take fewer)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _line(record: dict) -> str:
    return json.dumps(_jsonable(record)) + "\n"


def read_metrics(path: str | Path) -> tuple[list[dict], str | None]:
    """The records of metrics.jsonl (none if it is missing) and a warning, or None. A line is a
    record when it ends with a newline and holds one JSON object. The last line without its
    newline, or not a record, is a write a crash cut short: ignored. Any other line that is not a
    record is damaged: ignored too. The warning names what was ignored, in one line."""
    path = Path(path)
    if not path.is_file():
        return [], None
    lines = path.read_bytes().split(b"\n")
    tail = lines.pop()  # b"" when the file ends with its newline
    records, damaged = [], []
    for number, line in enumerate(lines, start=1):
        record = _record(line)
        if record is not None:
            records.append(record)
        elif line.strip():
            damaged.append(number)
    torn = tail if tail.strip() else None
    if torn is None and damaged and damaged[-1] == len(lines):
        torn = lines[damaged.pop() - 1]
    notes = []
    if torn is not None:
        notes.append(f"its last line ({len(torn)} bytes), a write a crash cut short")
    if damaged:
        shown = ", ".join(str(n) for n in damaged[:5]) + (", ..." if len(damaged) > 5 else "")
        notes.append(f"{len(damaged)} damaged line(s) ({shown})")
    return records, (f"{path}: ignored {' and '.join(notes)}" if notes else None)


def _record(line: bytes) -> dict | None:
    try:
        value = json.loads(line)
    except (ValueError, RecursionError):  # not JSON, not UTF-8, or nested past the parser's depth
        return None
    return value if isinstance(value, dict) else None


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
