"""Process-wide test settings, the process markers' check, and the order tests are handed out in.

- One thread per test process: two xdist workers share the machine's two cores.
- Without CUDA the Triton kernels run under the interpreter; TRITON_INTERPRET must be set before
  anything imports triton (torch._dynamo does), so it is set here, before any test module loads.
- A test that starts a process (a subprocess, a multiprocessing child, a fork) must carry one of
  PROCESS_MARKERS: `make test-fast` deselects those, so it runs in one process only what needs no
  other. The check runs in every run, so an unmarked test fails the full suite too, naming the
  command it started; the process itself is let run (the test's own result is unchanged). The
  tools a JIT compiler or the standard library runs for itself (TOOLCHAIN: Triton's ptxas and
  ldconfig on a GPU, a C compiler, `uname`, and `fc-list`, which matplotlib runs once per
  machine to build its font cache) are not a test's processes: on a GPU every kernel test
  compiles, and on a fresh machine whichever test plots first builds the cache.
- The in-process tests that tests/heavy_tests.txt lists get the `heavy` marker (tests/heavy_tier.py)
  as they are collected, before `-m` selects: `make test-fast` leaves them out. A listed id the run
  does not collect is a collection error, so a renamed heavy test cannot slip into the fast tier.
- The long tests go first (see `pytest_collection_modifyitems`), so that under `--dist loadgroup`
  the two workers start on them and the short ones fill in at the end.
"""

from __future__ import annotations

import multiprocessing.process
import os
import subprocess

import pytest
import torch

from tests import heavy_tier

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(1)

# What `make test-fast` deselects; each names what a test starts (pyproject.toml has the texts).
PROCESS_MARKERS = ("multihost", "ray", "distributed", "subprocess")

TOOLCHAIN = frozenset({"ptxas", "nvdisasm", "cuobjdump", "nvlink", "fatbinary", "ldconfig", "gcc", "g++", "cc",
                       "c++", "clang", "clang++", "uname", "fc-list"})

HEAVY_TIER = pytest.StashKey[heavy_tier.HeavyTier]()

_running: list[pytest.Item] = []  # the item whose setup, call or teardown is under way
_started: list[str] = []  # processes that item started without a process marker, this phase


def _unmarked_start(what: str) -> None:
    if _running and not any(_running[-1].get_closest_marker(m) for m in PROCESS_MARKERS):
        _started.append(what)


def _describe(args) -> str:
    if isinstance(args, (str, bytes, os.PathLike)):
        return os.fsdecode(args)
    return " ".join(os.fsdecode(a) if isinstance(a, (str, bytes, os.PathLike)) else str(a) for a in args)


def _watch_process_starts() -> None:
    popen_child = subprocess.Popen._execute_child
    process_start = multiprocessing.process.BaseProcess.start

    def execute_child(self, args, *rest, **kwargs):
        command = _describe(args)
        if os.path.basename(command.split(" ", 1)[0]) not in TOOLCHAIN:
            _unmarked_start(f"subprocess {command[:200]}")
        return popen_child(self, args, *rest, **kwargs)

    def start(self):
        _unmarked_start(f"multiprocessing {type(self).__name__} {getattr(self, '_target', None)!r}")
        return process_start(self)

    subprocess.Popen._execute_child = execute_child
    multiprocessing.process.BaseProcess.start = start
    for name in ("fork", "forkpty", "system", "posix_spawn", "posix_spawnp"):
        original = getattr(os, name, None)
        if original is not None:
            def watched(*args, _original=original, _name=name, **kwargs):
                _unmarked_start(f"os.{_name} {_describe(args[:2]) if _name != 'fork' else ''}".strip())
                return _original(*args, **kwargs)

            setattr(os, name, watched)


def pytest_configure(config: pytest.Config) -> None:
    _watch_process_starts()
    config.stash[HEAVY_TIER] = heavy_tier.HeavyTier(heavy_tier.read_heavy_ids())


def _checked_phase(item: pytest.Item, phase: str):
    _running.append(item)
    del _started[:]
    try:
        yield
    finally:
        _running.pop()
        started, _started[:] = list(_started), []
    if started:
        pytest.fail(f"{item.nodeid} started a process in its {phase} but carries none of the markers "
                    f"{', '.join(PROCESS_MARKERS)} (pyproject.toml says which fits; `make test-fast` runs only "
                    f"unmarked tests, in one process): " + "; ".join(dict.fromkeys(started)), pytrace=False)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    return (yield from _checked_phase(item, "setup"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    return (yield from _checked_phase(item, "call"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item):
    return (yield from _checked_phase(item, "teardown"))


def pytest_itemcollected(item: pytest.Item) -> None:
    item.config.stash[HEAVY_TIER].mark(item)  # as each test is collected: before `-m` selects


def _report_unknown_heavy_ids(session: pytest.Session) -> None:
    """A listed id this run collected no test for is a collection error of tests/heavy_tests.txt:
    pytest (and xdist's controller, which the report reaches) stops before any test runs."""
    config = session.config
    if config.getoption("lf", False):  # --lf collects a module's last failures only, not its listed tests
        return
    narrowed = heavy_tier.narrowed_modules(config.args, config.invocation_params.dir)
    unknown = config.stash[HEAVY_TIER].unknown(config.rootpath, narrowed)
    if unknown:
        report = pytest.CollectReport(heavy_tier.LIST_NODEID, "failed", heavy_tier.unknown_ids_error(unknown), [])
        config.hook.pytest_collectreport(report=report)


def _rank(item: pytest.Item) -> int:
    """Longest first: the several-host clusters, then Ray, rank processes, other child processes."""
    for rank, marker in enumerate(PROCESS_MARKERS):
        if item.get_closest_marker(marker):
            return rank
    return len(PROCESS_MARKERS)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session: pytest.Session, items: list[pytest.Item]) -> None:
    """Whole modules move, in their own order (module fixtures stay set up once): each module
    ranks as its longest test. First, the heavy list's check (every test has been collected)."""
    _report_unknown_heavy_ids(session)
    module_rank: dict[str, int] = {}
    for item in items:
        module = item.nodeid.split("::")[0]
        module_rank[module] = min(module_rank.get(module, len(PROCESS_MARKERS)), _rank(item))
    items.sort(key=lambda item: module_rank[item.nodeid.split("::")[0]])
