"""The process markers' check of tests/conftest.py: a test phase that starts a process without one of
PROCESS_MARKERS fails and names what it started; a marked one passes. (This module starts processes
itself, so it carries `subprocess`.)"""

from __future__ import annotations

import multiprocessing
import os
import subprocess

import pytest

from tests import conftest

pytestmark = pytest.mark.subprocess


class FakeItem:
    """What the check reads of a test item: its id and its markers."""

    def __init__(self, *markers: str) -> None:
        self.nodeid = "tests/test_fake.py::test_fake"
        self.markers = set(markers)

    def get_closest_marker(self, name: str):
        return name if name in self.markers else None


def run_phase(item: FakeItem, body) -> str | None:
    """`body` inside one checked phase of `item`: the failure message, or None if it passed."""
    phase = conftest._checked_phase(item, "call")
    next(phase)
    body()
    try:
        next(phase)
    except StopIteration:
        return None
    except pytest.fail.Exception as failed:
        return str(failed)
    raise AssertionError("the phase yielded twice")


def test_the_check_is_the_one_pytest_loaded():
    # The conftest pytest loaded patched subprocess; this module must drive that one's state.
    assert subprocess.Popen._execute_child.__module__ == conftest.__name__


@pytest.mark.parametrize("start", [
    lambda: subprocess.run(["true"], check=True),
    lambda: os.system("true"),
    lambda: (lambda p: (p.start(), p.join()))(multiprocessing.get_context("fork").Process(target=int)),
], ids=["subprocess", "os.system", "multiprocessing"])
def test_an_unmarked_phase_that_starts_a_process_fails_naming_it(start):
    message = run_phase(FakeItem(), start)
    assert message is not None and "tests/test_fake.py::test_fake started a process in its call" in message
    assert "multihost, ray, distributed, subprocess" in message
    assert "true" in message or "multiprocessing" in message


@pytest.mark.parametrize("marker", conftest.PROCESS_MARKERS)
def test_a_marked_phase_may_start_processes(marker):
    assert run_phase(FakeItem(marker), lambda: subprocess.run(["true"], check=True)) is None


def test_a_tool_the_standard_library_or_a_jit_runs_is_not_the_tests_process():
    # platform.processor() runs `uname -p`; Triton runs ptxas and ldconfig on a GPU, by full path.
    assert run_phase(FakeItem(), lambda: subprocess.run(["uname", "-p"], capture_output=True)) is None
    assert run_phase(FakeItem(), lambda: subprocess.run(["/usr/bin/uname"], capture_output=True)) is None


def test_a_phase_that_starts_nothing_passes_unmarked():
    assert run_phase(FakeItem(), lambda: sum(range(10))) is None
