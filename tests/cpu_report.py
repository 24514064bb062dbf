"""Per-test CPU seconds, for choosing what `make test-fast` leaves out (scripts/heavy_tests.py).

    bash scripts/run_tests.sh -q -n 2 -p tests.cpu_report --cpu-report /tmp/cpu.jsonl [-m ...] [FILES]

writes one JSON line per test: {"id", "cpu", "own", "wall", "scope", "markers"}. `own` is the CPU
(user + system, all threads) of the pytest process that ran the test, over its setup, call and
teardown; `cpu` adds every process the test started (rank processes, Ray, a CLI run) where this
process can put itself in a cgroup v1 cpuacct group of its own (root), and `scope` says which
(`cgroup`, or `process` where it cannot, and `cpu` is then `own`). Each xdist worker measures in its
own group, so two workers never charge each other; the group sits under the one the process was
started in, so a measurement of the whole run from outside (a cgroup around pytest) still counts
it. `id` is the test's node id without the `@group` suffix that `--dist loadgroup` appends, as
tests/heavy_tests.txt writes it. The workers hand their figures to the controller in the teardown
report, and the controller alone writes the file (rewritten each run).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

CPUACCT = Path("/sys/fs/cgroup/cpuacct")
PROPERTY = "cpu_report"


class CpuGroup:
    """This process (and what it starts from now on) in a cpuacct group of its own; None if it cannot."""

    def __init__(self, home: Path, group: Path) -> None:
        self.home, self.group = home, group

    @classmethod
    def enter(cls) -> CpuGroup | None:
        home = _own_cpuacct_group()
        if home is None or not os.access(home, os.W_OK):
            return None
        group = home / f"attnres-cpu-{os.getpid()}"
        try:
            group.mkdir(exist_ok=True)
            (group / "cgroup.procs").write_text(str(os.getpid()))
        except OSError:
            return None
        return cls(home, group)

    def usage_s(self) -> float:
        return int((self.group / "cpuacct.usage").read_text()) / 1e9

    def leave(self) -> None:
        """Back to the group it came from, with whatever it started that still runs; then the group goes."""
        try:
            for pid in (self.group / "cgroup.procs").read_text().split():
                (self.home / "cgroup.procs").write_text(pid)
            self.group.rmdir()
        except OSError:
            pass  # a process that exited meanwhile, or one still moving: the empty group may stay


def _own_cpuacct_group() -> Path | None:
    """The cpuacct v1 group this process is in (from /proc/self/cgroup), or None without one."""
    if not (CPUACCT / "cpuacct.usage").exists():
        return None
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "cpuacct" in controllers.split(","):
            return CPUACCT / path.lstrip("/")
    return None


def _own_cpu_s() -> float:
    times = os.times()
    return times.user + times.system


def plain_nodeid(item: pytest.Item) -> str:
    """The node id without the `@group` suffix that xdist's loadgroup appends to grouped tests."""
    names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                    for m in item.iter_markers("xdist_group")})
    suffix = "@" + "_".join(names)
    return item.nodeid[: -len(suffix)] if names and item.nodeid.endswith(suffix) else item.nodeid


class CpuReport:
    """Measures each test this process runs; writes the file where `out` is given (not in an xdist worker)."""

    def __init__(self, out: str | None, group: CpuGroup | None) -> None:
        self.group = group
        self.started: dict[str, tuple[float, float, float]] = {}
        self.out = None if out is None else open(out, "w")  # noqa: SIM115 (open for the whole session)

    def _usage(self, own_s: float) -> float:
        return self.group.usage_s() if self.group else own_s

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem):
        own_s = _own_cpu_s()
        self.started[item.nodeid] = (self._usage(own_s), own_s, time.monotonic())
        return (yield)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo):
        if call.when == "teardown" and item.nodeid in self.started:
            usage0, own0, wall0 = self.started.pop(item.nodeid)
            own_s = _own_cpu_s()
            item.user_properties.append((PROPERTY, {
                "id": plain_nodeid(item), "cpu": round(self._usage(own_s) - usage0, 3),
                "own": round(own_s - own0, 3), "wall": round(time.monotonic() - wall0, 3),
                "scope": "cgroup" if self.group else "process",
                "markers": sorted({m.name for m in item.iter_markers()} - {"parametrize", "usefixtures"}),
            }))
        return (yield)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if self.out is None or report.when != "teardown":
            return
        for name, record in report.user_properties:  # a (name, value) pair, or a list after xdist's transfer
            if name == PROPERTY:
                self.out.write(json.dumps(record) + "\n")
                self.out.flush()

    def close(self) -> None:
        if self.out is not None:
            self.out.close()
        if self.group is not None:
            self.group.leave()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--cpu-report", metavar="FILE", default=None,
                     help="write each test's CPU seconds to FILE, one JSON line per test (tests/cpu_report.py)")


def pytest_configure(config: pytest.Config) -> None:
    out = config.getoption("cpu_report")
    if out:
        writer = not hasattr(config, "workerinput")  # xdist's controller, or pytest without xdist
        config.pluginmanager.register(CpuReport(out if writer else None, CpuGroup.enter()), "cpu_report_plugin")


def pytest_unconfigure(config: pytest.Config) -> None:
    plugin = config.pluginmanager.get_plugin("cpu_report_plugin")
    if plugin is not None:
        plugin.close()
