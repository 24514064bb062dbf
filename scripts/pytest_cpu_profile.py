"""Where the test suite's CPU goes: a pytest plugin that records, per test, its wall seconds and the
machine's busy CPU seconds meanwhile (from /proc/stat, so Ray's daemons, rank processes and the
kernel count too), and per session the machine's busy CPU over the whole run.

    PYTHONPATH=scripts CPU_PROFILE_OUT=/tmp/cpu.jsonl python3 -m pytest -p no:benchmark -p pytest_cpu_profile \\
        -m "multihost or ray or distributed or subprocess"           # serial: each test's CPU is its own
    python3 scripts/pytest_cpu_profile.py /tmp/cpu.jsonl              # per file, most CPU first

Run the tests serially (no -n) for per-test figures: under xdist two tests share the machine and
each is charged the other's CPU. The session line (busy CPU seconds, the share of the cores busy)
is right either way, e.g. with `scripts/run_tests.sh -n 3 --dist loadgroup`. Linux only.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import time

import pytest


def _busy_s() -> float:
    """The machine's busy CPU seconds since boot, all cores (user + nice + system + irq + ...)."""
    with open("/proc/stat") as stat:
        ticks = [int(x) for x in stat.readline().split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # less idle and iowait


def _write(record: dict) -> None:
    path = os.environ.get("CPU_PROFILE_OUT")
    if path:
        with open(path, "a") as out:
            out.write(json.dumps(record) + "\n")


_SESSION: dict[str, float] = {}


def pytest_sessionstart(session) -> None:
    _SESSION.update(busy=_busy_s(), wall=time.monotonic())


def pytest_sessionfinish(session, exitstatus) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER") is None and _SESSION:  # the controller, or a serial run
        wall = time.monotonic() - _SESSION["wall"]
        busy = _busy_s() - _SESSION["busy"]
        _write({"session": True, "wall": wall, "cpu": busy, "busy_share": busy / (wall * os.cpu_count())})


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    busy, wall = _busy_s(), time.monotonic()
    yield
    _write({"id": item.nodeid, "wall": time.monotonic() - wall, "cpu": _busy_s() - busy})


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: pytest_cpu_profile.py RECORDS.jsonl", file=sys.stderr)
        return 2
    with open(argv[0]) as records:
        rows = [json.loads(line) for line in records if line.strip()]
    cpu, wall, count = collections.Counter(), collections.Counter(), collections.Counter()
    for row in rows:
        if row.get("session"):
            print(f"session: {row['wall']:.0f} s wall, {row['cpu']:.0f} busy CPU-s, "
                  f"{row['busy_share']:.1%} of the cores busy")
            continue
        path = row["id"].split("::")[0]
        cpu[path] += row["cpu"]
        wall[path] += row["wall"]
        count[path] += 1
    print(f"{'CPU-s':>8} {'wall s':>8} {'tests':>6}  file (tests: {sum(count.values())}, "
          f"{sum(cpu.values()):.0f} CPU-s)")
    for path, seconds in cpu.most_common():
        print(f"{seconds:8.1f} {wall[path]:8.1f} {count[path]:6d}  {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
