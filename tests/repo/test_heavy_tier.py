"""The `heavy` tier: tests/heavy_tests.txt names real tests, tests/conftest.py marks them before `-m`
selects and stops a run whose list names a test it did not collect, and scripts/heavy_tests.py
writes the list from a CPU report (each module's cheapest test stays in the fast tier)."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from scripts import heavy_tests
from tests import conftest, heavy_tier
from tests.run_helpers import REPO

# Node ids as pytest writes them for odd parameters: spaces, `::` and `#` inside the brackets, an
# escaped non-ASCII character, dashes and an empty string's id.
ODD_IDS = ["tests/unit/test_a.py::test_refused[window---window 0: give at least 1]",
           "tests/unit/test_a.py::test_refused[a::b # c]",
           "tests/unit/test_a.py::TestSome::test_case[caf\\xe9-]"]


def _defined_tests(module: Path) -> set[str]:
    """`name` and `Class::name` of every function the module defines at its top or in a class."""
    names = set()
    for node in ast.parse(module.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.ClassDef):
            names |= {f"{node.name}::{f.name}" for f in node.body if isinstance(f, ast.FunctionDef)}
    return names


def test_every_listed_heavy_test_is_a_test_of_an_existing_module():
    """A renamed module or function fails here; a renamed parameter fails the run's collection (tests/conftest.py)."""
    listed = heavy_tier.read_heavy_ids()
    assert listed and len(set(listed)) == len(listed)
    defined: dict[str, set[str]] = {}
    for nodeid in listed:
        module, name = nodeid.split("::", 1)
        if module not in defined:
            assert (REPO / module).is_file(), nodeid
            defined[module] = _defined_tests(REPO / module)
        assert name.split("[", 1)[0] in defined[module], nodeid


def test_the_list_leaves_out_only_in_process_tests():
    """The process markers already keep those tests out of test-fast: listing one would be noise."""
    listed = set(heavy_tier.read_heavy_ids())
    for module in {nodeid.split("::", 1)[0] for nodeid in listed}:
        text = (REPO / module).read_text()
        assert not any(f"pytestmark = pytest.mark.{m}" in text for m in conftest.PROCESS_MARKERS), module


def test_the_conftest_marks_each_test_as_it_is_collected(request):
    """pytest_itemcollected runs before `-m` selects (in pytest_collection_modifyitems): this test
    went through it, and the run's tier holds the committed list."""
    tier = request.config.stash[conftest.HEAVY_TIER]
    assert request.node.nodeid in tier.seen and tier.wanted == set(heavy_tier.read_heavy_ids())
    assert "not heavy" in (REPO / "Makefile").read_text().split("FAST_MARKERS :=", 1)[1].splitlines()[0]


class FakeItem:
    def __init__(self, nodeid: str) -> None:
        self.nodeid, self.markers = nodeid, []

    def add_marker(self, name: str) -> None:
        self.markers.append(name)


def _collect(listed: list[str], nodeids: list[str]) -> tuple[heavy_tier.HeavyTier, list[FakeItem]]:
    tier, items = heavy_tier.HeavyTier(listed), [FakeItem(nodeid) for nodeid in nodeids]
    for item in items:
        tier.mark(item)
    return tier, items


def test_the_listed_ids_get_the_marker_odd_characters_included():
    tier, items = _collect(ODD_IDS, ODD_IDS + ["tests/unit/test_a.py::test_refused[window]"])
    assert tier.unknown(REPO, narrowed=set()) == []
    assert [item.markers for item in items] == [["heavy"], ["heavy"], ["heavy"], []]


def test_a_listed_id_the_run_does_not_collect_is_an_error():
    listed = ["tests/unit/test_a.py::test_renamed", "tests/unit/test_b.py::test_gone[x]",
              "tests/unit/test_not_collected.py::test_x"]  # a module this run did not collect: not looked for
    tier, _ = _collect(listed, ["tests/unit/test_a.py::test_kept", "tests/unit/test_b.py::test_kept"])
    assert tier.unknown(REPO, narrowed=set()) == listed[:2]
    narrowed = heavy_tier.narrowed_modules(["tests/unit/test_a.py::test_kept", "tests/unit"], REPO)
    assert narrowed == {REPO / "tests/unit/test_a.py"}
    assert tier.unknown(REPO, narrowed) == listed[1:2]
    message = heavy_tier.unknown_ids_error(listed[:2])
    assert message.startswith("error: tests/heavy_tests.txt names 2 test(s)") and "\n" not in message
    assert listed[0] in message and "scripts/heavy_tests.py" in message


def _report(path: Path, records: list[tuple[str, float, list[str]]]) -> Path:
    path.write_text("".join(json.dumps({"id": i, "cpu": cpu, "own": cpu, "wall": cpu, "markers": m}) + "\n"
                            for i, cpu, m in records))
    return path


def test_the_script_lists_the_fast_tiers_heavy_tests_but_each_modules_cheapest(tmp_path):
    report = _report(tmp_path / "cpu.jsonl", [
        ("tests/unit/test_a.py::test_one", 0.9, []), ("tests/unit/test_a.py::test_two", 0.5, ["heavy"]),
        ("tests/unit/test_a.py::test_three", 0.49, []),
        ("tests/unit/test_b.py::test_alone", 3.0, []),  # its module's cheapest: stays
        ("tests/unit/test_b.py::test_ranks", 9.0, ["distributed"]),
        ("tests/unit/test_b.py::test_tail", 2.0, ["matrix"]),
        (ODD_IDS[0], 1.0, []), (ODD_IDS[1], 0.7, []), (ODD_IDS[2], 0.6, ["filterwarnings"]),
        ("tests/unit/test_c.py::test_x[a]", 2.0, []), ("tests/unit/test_c.py::test_x[b]", 2.0, []),
    ])
    out = tmp_path / "heavy_tests.txt"
    assert heavy_tests.main([str(report), "--out", str(out)]) == 0
    listed = heavy_tier.read_heavy_ids(out)
    assert listed == sorted(["tests/unit/test_a.py::test_one", "tests/unit/test_a.py::test_two",
                             *ODD_IDS, "tests/unit/test_c.py::test_x[b]"])
    assert out.read_text().startswith("# The in-process tests")
    assert heavy_tests.main([str(report), "--out", str(out), "--threshold", "0.95"]) == 0
    assert heavy_tier.read_heavy_ids(out) == [ODD_IDS[0], "tests/unit/test_c.py::test_x[b]"]


def test_the_script_reads_the_fast_tier_from_the_makefile():
    excluded = heavy_tests.fast_tier_exclusions(REPO / "Makefile")
    assert set(conftest.PROCESS_MARKERS) | {"matrix"} == excluded


@pytest.mark.parametrize("case, report_lines, flags, says", [
    ("not json", ["{"], [], "line 1 is not JSON"),
    ("no markers", [json.dumps({"id": "tests/t.py::t", "cpu": 1.0})], [], "lacks id, cpu or markers"),
    ("empty", [""], [], "holds no test"),
    ("threshold", None, ["--threshold", "0"], "must be a positive number"),
    ("listed test unmeasured", [json.dumps({"id": "tests/t.py::t", "cpu": 1.0, "markers": []})], [],
     "has no figure for 1 test(s)"),
    ("makefile", None, ["--makefile", "{tmp}/Makefile"], "has no FAST_MARKERS line"),
    ("makefile term", None, ["--makefile", "{tmp}/Makefile.or"], "is not `not NAME`"),
])
def test_the_script_refuses_bad_input_with_one_line_and_writes_nothing(tmp_path, capsys, case, report_lines,
                                                                      flags, says):
    report = tmp_path / "cpu.jsonl"
    report.write_text("\n".join(report_lines) + "\n" if report_lines is not None else
                      json.dumps({"id": "tests/u.py::u", "cpu": 1.0, "markers": []}) + "\n")
    (tmp_path / "Makefile").write_text("test-fast:\n\tpytest\n")
    (tmp_path / "Makefile.or").write_text("FAST_MARKERS := not ray or not matrix\n")
    out = tmp_path / "heavy_tests.txt"
    out.write_text("# a header\ntests/u.py::u\n")
    before = out.read_text()
    flags = [f.format(tmp=tmp_path) for f in flags]
    assert heavy_tests.main([str(report), "--out", str(out), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and says in err, err
    assert out.read_text() == before
