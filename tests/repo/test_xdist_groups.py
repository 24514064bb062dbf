"""`make test` spreads the suite over two workers with `--dist loadgroup`, so that the tests sharing an
expensive fixture (an `xdist_group`: the namespace clusters, the shared Ray instance, the reference
runs) run on one worker and build it once. Some pytest / pytest-xdist pairs ignore the groups
silently (pytest 9.2 with xdist 3.8: every fixture was then built on both workers, minutes more on a
new machine). The installed pair is checked here on a small suite of its own."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.subprocess

GROUPED = '''
import os
import pytest

@pytest.mark.xdist_group("shared")
@pytest.mark.parametrize("n", range(4))
def test_grouped(n):
    print("worker", os.environ["PYTEST_XDIST_WORKER"])

@pytest.mark.parametrize("n", range(4))
def test_free(n):
    pass
'''


def test_loadgroup_runs_a_group_on_one_worker(tmp_path):
    (tmp_path / "test_grouped.py").write_text(GROUPED)
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup",
                           "-v", "test_grouped.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    # `-v` under xdist: "[gwN] [ p%] PASSED test_grouped.py::test_grouped[0]@shared"
    workers = {line.split("]")[0].lstrip("[") for line in done.stdout.splitlines()
               if line.startswith("[gw") and "PASSED" in line and "::test_grouped[" in line}
    assert len(workers) == 1 and workers <= {"gw0", "gw1"}, done.stdout[-3000:]
    assert done.stdout.count("@shared") >= 4, "xdist did not name the group: loadgroup is not in effect"
