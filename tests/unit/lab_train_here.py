"""`attnres_lab.memory_predict`'s training runs in the test's own process: the lab starts each run as
a fresh `python -m attnres_pp.cli` (an interpreter start and a torch import, ~2.5 CPU-s), where
`main(argv)` here writes the same summary.json. The counts the tests compare (held bytes, the
meter's activation and cache peaks, the transport's slots) are the runs' own tensors' bytes, not
the process's memory, so they do not depend on the process the driver runs in; rank processes
still fork from the fork server as under the CLI."""

from __future__ import annotations

import pytest

from attnres_pp.cli import main


def _train_here(argv: list[str], timeout_s: float) -> str:
    del timeout_s  # every rank wait in the run has its own timeout
    code = main(argv)
    if code:
        raise RuntimeError(f"attnres-pp {' '.join(argv[:2])} failed: exit {code}")
    return ""


@pytest.fixture()
def lab_runs_here(monkeypatch):
    """Patch the lab's CLI runner so that `measure_case` trains in this process."""
    from attnres_lab import memory_predict

    monkeypatch.setattr(memory_predict, "_cli", _train_here)
