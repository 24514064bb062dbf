"""tests/cpu_report.py, the per-test CPU report scripts/heavy_tests.py reads: a test's record carries
the CPU it burnt (its process's, and its cgroup's where this process may make one), its plain node
id and its markers, and only the writing process (no xdist worker) writes the file."""

from __future__ import annotations

import json
import os
import time
from types import SimpleNamespace

import pytest

from tests import cpu_report

BURN_S = 0.1


def _burn(seconds: float) -> None:
    """Spends `seconds` of this process's CPU (a loop, so the figure is CPU, not a sleep)."""
    start = time.process_time()
    while time.process_time() - start < seconds:
        sum(range(1000))


class FakeItem:
    def __init__(self, nodeid: str, *marks: pytest.Mark) -> None:
        self.nodeid, self.marks, self.user_properties = nodeid, list(marks), []

    def iter_markers(self, name: str | None = None):
        return iter([m for m in self.marks if name is None or m.name == name])


def _measure(report: cpu_report.CpuReport, item: FakeItem) -> dict:
    """Runs `item`'s protocol through the plugin's hooks with BURN_S of CPU in it; returns its record."""
    protocol = report.pytest_runtest_protocol(item, None)
    next(protocol)
    _burn(BURN_S)
    makereport = report.pytest_runtest_makereport(item, SimpleNamespace(when="teardown"))
    next(makereport)
    for wrapper in (makereport, protocol):
        with pytest.raises(StopIteration):
            wrapper.send(None)
    [(name, record)] = item.user_properties
    assert name == cpu_report.PROPERTY
    return record


def test_the_suffix_loadgroup_appends_is_dropped_and_nothing_else():
    grouped = FakeItem("tests/unit/test_a.py::test_x[p@q]@tp-runs", pytest.mark.xdist_group("tp-runs").mark)
    assert cpu_report.plain_nodeid(grouped) == "tests/unit/test_a.py::test_x[p@q]"
    assert cpu_report.plain_nodeid(FakeItem("tests/unit/test_a.py::test_x[p@q]")) == "tests/unit/test_a.py::test_x[p@q]"


def test_without_a_cgroup_a_test_is_charged_its_process_cpu(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_report, "CPUACCT", tmp_path / "no-cpuacct")
    assert cpu_report.CpuGroup.enter() is None
    out = tmp_path / "cpu.jsonl"
    report = cpu_report.CpuReport(str(out), group=None)
    item = FakeItem("tests/unit/test_a.py::test_x[a b]", pytest.mark.matrix.mark,
                    pytest.mark.parametrize("a", [1]).mark)
    record = _measure(report, item)
    assert record["scope"] == "process" and record["cpu"] == record["own"] >= BURN_S - 0.02
    assert record["wall"] >= record["own"] * 0.5 and record["markers"] == ["matrix"]
    # The controller writes what a worker sent: after xdist's transfer the pair is a list.
    report.pytest_runtest_logreport(SimpleNamespace(when="teardown", user_properties=[[cpu_report.PROPERTY, record]]))
    report.pytest_runtest_logreport(SimpleNamespace(when="call", user_properties=[[cpu_report.PROPERTY, record]]))
    report.close()
    assert [json.loads(line) for line in out.read_text().splitlines()] == [record]
    assert record["id"] == "tests/unit/test_a.py::test_x[a b]"


def test_a_worker_measures_but_writes_nothing(tmp_path):
    report = cpu_report.CpuReport(None, group=None)
    record = _measure(report, FakeItem("tests/unit/test_a.py::test_y"))
    report.pytest_runtest_logreport(SimpleNamespace(when="teardown", user_properties=[(cpu_report.PROPERTY, record)]))
    report.close()
    assert record["own"] >= BURN_S - 0.02 and list(tmp_path.iterdir()) == []


def test_in_a_cgroup_of_its_own_the_group_counts_the_cpu_and_goes_away_after():
    home = cpu_report._own_cpuacct_group()
    group = cpu_report.CpuGroup.enter()
    if group is None:  # no cgroup v1 cpuacct here, or not root: the report degrades to the process's CPU
        assert home is None or not os.access(home, os.W_OK)
        return
    try:
        assert cpu_report._own_cpuacct_group() == group.group and group.home == home
        before = group.usage_s()
        _burn(BURN_S)
        assert group.usage_s() - before >= BURN_S - 0.02
    finally:
        group.leave()
    assert cpu_report._own_cpuacct_group() == home and not group.group.exists()
