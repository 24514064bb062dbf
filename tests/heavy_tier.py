"""The `heavy` marker from tests/heavy_tests.txt: the in-process tests that cost about 0.3 CPU-s or
more, which `make test-fast` leaves out (`make test` runs them). scripts/heavy_tests.py writes the
list from a per-test CPU report (tests/cpu_report.py); tests/conftest.py marks what it names.

A listed id that the run does not collect is an error, not a silent no-op: after a rename the
renamed test would otherwise stay in the fast tier. The check covers every module the run collected
whole; a module narrowed on the command line (`FILE::test`) collects only part of itself, so its
other listed ids are not looked for.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import pytest

HEAVY_LIST = Path(__file__).with_name("heavy_tests.txt")
MARKER = "heavy"
LIST_NODEID = "tests/heavy_tests.txt"  # what a collection error of the list is reported as


def read_heavy_ids(path: Path = HEAVY_LIST) -> list[str]:
    """The listed node ids: one a line, exactly as pytest writes them; `#` lines and blank lines skipped."""
    lines = (line.rstrip() for line in path.read_text(encoding="utf-8").splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def narrowed_modules(args: Iterable[str], invocation_dir: Path) -> set[Path]:
    """The module files a command-line argument names with `::` (only part of them is collected)."""
    return {(invocation_dir / arg.split("::", 1)[0]).resolve() for arg in args if "::" in arg}


class HeavyTier:
    """Marks the listed tests as pytest collects them (before `-m` selects), and remembers what it saw."""

    def __init__(self, heavy_ids: Iterable[str]) -> None:
        self.wanted = frozenset(heavy_ids)
        self.seen: set[str] = set()

    def mark(self, item: pytest.Item) -> None:
        self.seen.add(item.nodeid)
        if item.nodeid in self.wanted:
            item.add_marker(MARKER)

    def unknown(self, rootdir: Path, narrowed: set[Path]) -> list[str]:
        """The listed ids that no collected test has, in the modules collected whole."""
        modules = {nodeid.split("::", 1)[0] for nodeid in self.seen}
        return sorted(nodeid for nodeid in self.wanted - self.seen
                      if nodeid.split("::", 1)[0] in modules
                      and (rootdir / nodeid.split("::", 1)[0]).resolve() not in narrowed)


def unknown_ids_error(unknown: list[str]) -> str:
    return (f"error: tests/heavy_tests.txt names {len(unknown)} test(s) this run collected no test for "
            f"(first: {unknown[0]}); remove or rename the line(s), or rewrite the list with "
            f"scripts/heavy_tests.py REPORT (docs/testing.md)")
