"""What tests read back from a training run's folder (`summary.json`, `metrics.jsonl`), the one rule
by which two runs' losses count as the same run, and the checkout's root for tests that read its
files or run its scripts."""

from __future__ import annotations

import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def summary(run_dir: Path | str) -> dict:
    """The run's summary.json."""
    return json.loads((Path(run_dir) / "summary.json").read_text())


def losses(run_dir: Path | str) -> list[float]:
    """The training loss of every step, from summary.json."""
    return summary(run_dir)["losses"]


def metrics(run_dir: Path | str) -> list[dict]:
    """metrics.jsonl: one record per line, in the order the run wrote them."""
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def assert_same_losses(got: list[float], want: list[float], *, rtol: float = 1e-5, what: object = "") -> None:
    """Step for step, |got - want| <= rtol * |want|; `what` names the comparison in the message."""
    assert len(got) == len(want), (what, len(got), len(want))
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert abs(g - w) <= rtol * abs(w), (what, step, g, w)
