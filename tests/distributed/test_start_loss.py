"""A rank lost while the engine starts its ranks (launch/process_rank_group.py, train/recovery.py
`start_engine`): start-up is part of the run, so the ranks start again within --max-restarts, said in
one line, and the run ends with the undisturbed run's losses, its summary counting the restart.
Lost by the rehearsal hook (ATTNRES_PP_LOSE_RANK_AT_START) and by a real SIGKILL from outside within
moments of the rank's process appearing. The runs are `attnres-pp train` called in this process
(their ranks come from this process's fork server), so no interpreter has to start for them."""

from __future__ import annotations

import os
import re
import signal
import threading

import pytest

from attnres_pp.cli import main
from tests.run_helpers import assert_same_losses, losses, summary

from .test_hung_rank import RUN, alive, assert_all_ended, rank_pids, undisturbed

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def want(tmp_path_factory) -> list[float]:
    """The undisturbed 2-step run's losses (thread ranks), one run for the module's two restarts."""
    return undisturbed(tmp_path_factory.mktemp("plain"), 2)


def _notices(out: str) -> list[str]:
    return [line for line in out.splitlines() if "while the ranks started" in line]


def test_a_rank_lost_at_start_up_is_started_again(tmp_path, capsys, monkeypatch, want):
    capsys.readouterr()
    monkeypatch.setenv("ATTNRES_PP_LOSE_RANK_AT_START", "1")
    assert main(["train", *RUN, "--steps", "2", "--out", str(tmp_path / "run")]) == 0
    captured = capsys.readouterr()
    notices = _notices(captured.out)
    assert len(notices) == 1 and re.fullmatch(r"rank 1 lost while the ranks started; starting them again \(restart "
                                              r"1/3\); cause: rank 1 (exited \(code 17\)|closed its pipe) during setup",
                                              notices[0]), captured.out
    assert "Traceback" not in captured.err
    assert_same_losses(losses(tmp_path / "run"), want)
    assert summary(tmp_path / "run")["restarts"] == 1


def test_a_rank_lost_at_start_up_with_no_restart_left_is_one_error_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("ATTNRES_PP_LOSE_RANK_AT_START", "0")
    assert main(["train", *RUN, "--steps", "2", "--max-restarts", "0", "--out", str(tmp_path / "run")]) == 1
    err = capsys.readouterr().err
    # Its exit, or its end of the pipe reset before the exit shows: either names the rank.
    assert re.fullmatch(r"error: rank 0 lost while the ranks started, after 0 restart\(s\), the limit set by "
                        r"--max-restarts: rank 0 (exited \(code 17\)|closed its pipe) during setup\n", err), err


def test_a_rank_killed_from_outside_as_it_starts_is_started_again(tmp_path, capsys, want):
    """A real SIGKILL to the first rank process as soon as it appears (before it has joined)."""
    capsys.readouterr()
    before, killed, stop = set(rank_pids()), [], threading.Event()

    def kill_the_first_rank() -> None:
        while not stop.is_set() and not killed:
            fresh = [pid for pid in rank_pids() if pid not in before]
            if fresh:
                os.kill(fresh[0], signal.SIGKILL)
                killed.append(fresh[0])
            stop.wait(0.01)

    watcher = threading.Thread(target=kill_the_first_rank, daemon=True)
    watcher.start()
    try:
        assert main(["train", *RUN, "--steps", "2", "--out", str(tmp_path / "run")]) == 0
    finally:
        stop.set()
        watcher.join(timeout=5)
    out = capsys.readouterr().out
    assert killed and not alive(killed[0])
    notices = _notices(out)
    assert len(notices) == 1 and re.fullmatch(r"rank \d lost while the ranks started; starting them again "
                                              r"\(restart 1/3\); cause: rank \d (exited \(code -9\)|closed its pipe) "
                                              r"during setup",
                                              notices[0]), out
    assert_same_losses(losses(tmp_path / "run"), want)
    assert summary(tmp_path / "run")["restarts"] == 1
    assert_all_ended(set(rank_pids()) - before)
