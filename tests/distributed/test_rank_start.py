"""How the local launcher starts ranks (launch/process_rank_group.py): forked from the fork server, which
has torch imported, yet with the driver's environment as it is when each rank starts."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from attnres_lab.chaos_run import start_driver
from attnres_pp.launch.process_rank_group import ProcessRankGroup

pytestmark = pytest.mark.distributed


class _EnvWorker:
    """Reports what a rank process sees before it has imported anything of its own."""

    def __init__(self, key: str) -> None:
        self.key, self.torch_before = key, "torch" in sys.modules

    def join_process_group(self, init_method: str, world_size: int) -> dict:
        return {"value": os.environ.get(self.key), "torch_before": self.torch_before, "parent": os.getppid(),
                "pid": os.getpid()}

    def close(self) -> None:
        pass


def _start(key: str) -> list[dict]:
    group = ProcessRankGroup(2, 30.0, name="env-test")
    try:
        return group.start(_EnvWorker, [{"key": key}] * 2)
    finally:
        group.stop(graceful=True)


def test_each_rank_takes_the_drivers_environment_at_its_start(monkeypatch):
    key = "ATTNRES_PP_TEST_RANK_ENV"
    monkeypatch.delenv(key, raising=False)
    first = _start(key)  # the fork server runs from here on, with the environment of this moment
    assert [r["value"] for r in first] == [None, None]
    monkeypatch.setenv(key, "set after the server started")
    second = _start(key)
    assert [r["value"] for r in second] == ["set after the server started"] * 2
    monkeypatch.delenv(key)
    assert [r["value"] for r in _start(key)] == [None, None]  # and an unset one is unset again
    # Forked from the one server, with torch already imported: not spawned by the driver.
    assert all(r["torch_before"] for r in first + second)
    assert {r["parent"] for r in first + second} != {os.getpid()}
    assert len({r["pid"] for r in first + second}) == 4


@pytest.mark.subprocess
def test_a_temporary_folder_too_long_for_the_fork_servers_socket_is_one_error_line(tmp_path):
    """A driver with a fork server of its own (this process forked as a fresh driver: TMPDIR read
    again, multiprocessing's folder and fork server not yet made) whose TMPDIR is longer than a Unix
    socket path may be: one `error:` line naming TMPDIR, exit 2, nothing written, no traceback."""
    base = tempfile.mkdtemp(prefix="long-", dir="/tmp")
    try:
        long_tmp = Path(base) / ("x" * 100)
        long_tmp.mkdir()
        out, log = tmp_path / "run", tmp_path / "driver.log"
        driver = start_driver(["train", "--launcher", "local", "--stages", "2", "--layers", "2", "--d-model", "32",
                               "--heads", "2", "--seq-len", "16", "--batch-size", "4", "--steps", "1", "--quiet",
                               "--out", str(out)], {}, long_tmp, log, "local")
        try:
            returncode = driver.wait(timeout=120)
        finally:
            driver.kill()
            driver.wait(timeout=30)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    printed = log.read_text()  # stdout and stderr: a --quiet run that fails prints its one line only
    assert returncode == 2, printed
    assert printed.splitlines() == [printed.strip()] and printed.startswith("error: the temporary folder")
    assert "TMPDIR" in printed and not out.exists()
