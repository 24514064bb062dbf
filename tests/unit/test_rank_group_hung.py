"""A hung rank, classified where the driver meets it (launch/process_rank_group.py, launch/rank_group.py)
and acted on by the training loop (train/loop.py, train/recovery.py): a live rank whose heartbeat has
stopped is the cause (RankHung, killed), not the transport timeout its peer reports; a live rank that
still beats is not, whatever its peer says. Real pipes and fake processes, the heartbeats set by hand,
so each case is forced, not waited for. Also the start-up retries and the rehearsal hooks' checks."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import time
from multiprocessing.reduction import ForkingPickler

import pytest

from attnres_pp.launch import process_rank_group, rank_group
from attnres_pp.launch.process_rank_group import ProcessRankGroup
from attnres_pp.launch.rank_group import RankHung, StoppedSince, hung_after_s, process_stopped
from attnres_pp.pipeline.config import PipelineConfig
from attnres_pp.pipeline.errors import WorkerLost
from attnres_pp.train import faults
from attnres_pp.train.checkpoint import CheckpointConfig
from attnres_pp.train.config import RunConfig, TrainConfig
from attnres_pp.train.loop import _restart_or_fail
from attnres_pp.train.recovery import RunFailed, RunHistory, start_engine

TIMEOUT = "rank 0: message 3 from rank 1 did not come within the pipeline timeout (6 s)"


class _Live:
    """A rank process that runs (or is stopped: alive all the same); `join` as a killed one would."""

    exitcode = None

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def is_alive(self) -> bool:
        return True

    def join(self, timeout=None) -> None:
        pass


def _group(beats_age_s: list[float], *, timeout_s: float = 6.0) -> tuple[ProcessRankGroup, list]:
    """Two live ranks (pids 101, 102) whose last heartbeats were `beats_age_s` seconds ago (negative:
    they keep beating for that long)."""
    group = ProcessRankGroup(2, timeout_s=timeout_s, name="hung")
    rank_ends = []
    for rank in range(2):
        driver_end, rank_end = multiprocessing.Pipe()
        group.conns.append(driver_end)
        group.procs.append(_Live(101 + rank))
        rank_ends.append(rank_end)
    group._beats = [time.monotonic() - age for age in beats_age_s]
    return group, rank_ends


@pytest.fixture
def killed(monkeypatch) -> list[int]:
    pids: list[int] = []
    monkeypatch.setattr(process_rank_group, "kill_pid", pids.append)
    monkeypatch.setattr(rank_group, "FAILURE_GRACE_S", 0.3)
    return pids


def test_a_silent_rank_without_a_heartbeat_is_the_cause_of_its_peers_timeout(killed, monkeypatch):
    """Rank 0 reports the transport timeout; rank 1, frozen, has not beaten for 8 s: rank 1 is hung,
    killed, and named in one line, not rank 0's error; the grace for other reports ends at once (a
    silent rank will not report)."""
    monkeypatch.setattr(rank_group, "FAILURE_GRACE_S", 30.0)
    group, rank_ends = _group([0.0, 8.0])
    rank_ends[0].send_bytes(ForkingPickler.dumps(("error", f"Traceback ...\nTransportTimeout: {TIMEOUT}")))
    began = time.monotonic()
    with pytest.raises(RankHung) as info:
        group.gather("step 2")
    assert time.monotonic() - began < 5.0
    assert info.value.pp_rank == 1 and killed == [102]
    assert str(info.value) == ("rank 1 stopped answering during step 2 (no heartbeat for 8 s: its process is frozen or "
                               "hung; killed it)")
    assert group._failed  # the others may be blocked on it: the group stops them without the close handshake


def test_a_silent_rank_that_still_beats_is_not_hung_and_its_peers_error_is_raised(killed):
    """Rank 1 is silent but beats (blocked on rank 0, which failed): rank 0's error is the cause."""
    group, rank_ends = _group([0.0, -60.0])
    rank_ends[0].send_bytes(ForkingPickler.dumps(("error", "Traceback ...\nValueError: a bug of rank 0")))
    with pytest.raises(RuntimeError, match="^rank 0 failed during step 2:\nTraceback") as info:
        group.gather("step 2")
    assert not isinstance(info.value, WorkerLost) and killed == []


def test_silence_alone_makes_a_rank_hung_after_half_the_timeout(killed):
    """No rank has replied and none failed: a heartbeat silent for longer than hung_after_s(timeout)
    (max(5 s, timeout / 2)) is found within a poll; a shorter silence is still waited on."""
    assert hung_after_s(6.0) == 5.0 and hung_after_s(60.0) == 30.0
    group, _rank_ends = _group([0.0, 5.5])
    began = time.monotonic()
    with pytest.raises(RankHung, match="^rank 1 stopped answering during evaluation"):
        group.gather("evaluation")
    assert time.monotonic() - began < 2.0 and killed == [102]
    assert group.replied() is True  # a driver that steps several groups sees it at once too
    beating, _ends = _group([0.0, 2.0])
    assert beating.replied() is False
    starting, _ends = _group([0.0, 0.0])
    starting._beats[1] = 0.0  # no beat yet: a process just forked may take seconds to run on a busy machine
    assert starting.replied() is False and starting.silent_s(1) == 0.0


@pytest.mark.subprocess
def test_a_stopped_process_is_seen_and_killed():
    """`process_stopped` reads a real SIGSTOPped process as stopped; `StoppedSince` (the Ray and
    torchrun groups' sign) names it hung once a peer has failed, and kills it."""
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        assert not process_stopped(sleeper.pid)
        watch = StoppedSince([None, sleeper.pid])
        watch.raise_if_hung([0, 1], "step 4", None)  # neither is stopped: nothing raised
        sleeper.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while not process_stopped(sleeper.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert process_stopped(sleeper.pid)
        watch.raise_if_hung([1], "step 4", 30.0)  # not stopped long enough to be hung by itself
        with pytest.raises(RankHung, match=r"^rank 1 stopped answering during step 4 \(its process stopped for 0 s "
                                           r"\(SIGSTOP or a debugger\); killed it\)$"):
            watch.raise_if_hung([1], "step 4", None)
        assert sleeper.wait(timeout=5) == -signal.SIGKILL
    finally:
        sleeper.kill()
        sleeper.wait()


class _Engine:
    def __init__(self) -> None:
        self.restarts = 0

    def restart_workers(self) -> None:
        self.restarts += 1


def test_the_loop_restarts_a_hung_rank_in_one_line_and_stops_in_one_line_when_none_is_left():
    frozen = rank_group.hung(1, "step 2", 5.2)
    lines, engine = [], _Engine()
    _restart_or_fail(engine, frozen, 1, RunHistory(), None, CheckpointConfig(max_restarts=1), 3,
                     lambda line, **_: lines.append(line))
    assert engine.restarts == 1 and lines == [
        "rank 1 stopped answering at step 2/3 (no heartbeat for 5 s: its process is frozen or hung; killed it); "
        "restarting from step 0 (no checkpoint yet) (restart 1/1)"]
    with pytest.raises(RunFailed) as info:
        _restart_or_fail(engine, frozen, 1, RunHistory(restarts=1), None, CheckpointConfig(max_restarts=1), 3, print)
    assert str(info.value) == ("rank 1 stopped answering at step 2/3 (no heartbeat for 5 s: its process is frozen or "
                               "hung; killed it) after 1 restart(s), the limit set by --max-restarts")
    # A lost rank's report may carry its peer's traceback: the line keeps the first line only.
    lost = WorkerLost(1, "rank 1 exited (code -9) during step 2\nrank 0 then failed with:\nTraceback ...")
    with pytest.raises(RunFailed) as info:
        _restart_or_fail(engine, lost, 1, RunHistory(restarts=1), None, CheckpointConfig(max_restarts=1), 3, print)
    assert "\n" not in str(info.value) and str(info.value).endswith(": rank 1 exited (code -9) during step 2")


def test_start_up_is_retried_within_the_restart_limit():
    """`start_engine`: a rank lost while the ranks start is another start (not the first: hooks stay
    off), counted with the run's earlier restarts; past the limit, or where no restart is possible,
    one line; a refusal (ValueError) is not retried."""
    firsts, lines = [], []

    def make(first: bool):
        firsts.append(first)
        if len(firsts) < 3:
            raise WorkerLost(1, "rank 1 exited (code -9) during setup\nrank 0 then failed with:\nTraceback ...")
        return "engine"

    say = lambda line, **_: lines.append(line)  # noqa: E731
    assert start_engine(make, max_restarts=3, restarts_done=1, can_restart=True, say=say) == ("engine", 2)
    assert firsts == [True, False, False]
    assert lines == [f"rank 1 lost while the ranks started; starting them again (restart {n}/3); cause: rank 1 "
                     "exited (code -9) during setup" for n in (2, 3)]
    firsts.clear()
    with pytest.raises(RunFailed, match=r"^rank 1 lost while the ranks started, after 3 restart\(s\), the limit set "
                                        r"by --max-restarts: rank 1 exited \(code -9\) during setup$"):
        start_engine(make, max_restarts=3, restarts_done=2, can_restart=True, say=say)
    firsts.clear()
    with pytest.raises(RunFailed, match=r"\(this launcher cannot restart workers\)$"):
        start_engine(make, max_restarts=3, restarts_done=0, can_restart=False, say=say)

    def refuse(first: bool):
        firsts.append(first)
        raise ValueError("rank 1 refused to start: /dev/shm has no room")

    firsts.clear()
    with pytest.raises(ValueError, match="refused to start"):
        start_engine(refuse, max_restarts=3, restarts_done=0, can_restart=True, say=say)
    assert firsts == [True]


def _run_cfg(launcher: str = "local", stages: int = 2, steps: int = 4) -> RunConfig:
    return RunConfig(train=TrainConfig(steps=steps), pipeline=PipelineConfig(stages=stages, launcher=launcher))


@pytest.mark.parametrize(("name", "value", "fix"), [
    ("ATTNRES_PP_FREEZE_RANK", "1", "set it to RANK:STEP"),
    ("ATTNRES_PP_FREEZE_RANK", "1:0", "set it to RANK:STEP"),
    ("ATTNRES_PP_FREEZE_RANK", "x:2", "set it to RANK:STEP"),
    ("ATTNRES_PP_FREEZE_RANK", "2:2", "RANK must be in 0..1"),
    ("ATTNRES_PP_FREEZE_RANK", "1:5", "STEP must be in 1..4"),
    ("ATTNRES_PP_LOSE_RANK_AT_START", "-1", "set it to RANK"),
    ("ATTNRES_PP_LOSE_RANK_AT_START", "one", "set it to RANK"),
    ("ATTNRES_PP_LOSE_RANK_AT_START", "2", "RANK must be in 0..1"),
    ("ATTNRES_PP_SLOW_STEP_S", "-1", "set it to SECONDS from 0 to 60"),
    ("ATTNRES_PP_SLOW_STEP_S", "soon", "set it to SECONDS from 0 to 60"),
    ("ATTNRES_PP_SLOW_STEP_S", "61", "set it to SECONDS from 0 to 60"),
])
def test_a_bad_rehearsal_value_is_one_line_naming_what_to_set(monkeypatch, name, value, fix):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError) as info:
        faults.check_rank_rehearsals(_run_cfg())
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{name}={value!r} is invalid: ") and fix in message


def test_the_rank_rehearsals_need_rank_processes_and_act_on_the_first_start_only(monkeypatch):
    monkeypatch.setenv("ATTNRES_PP_FREEZE_RANK", "1:2")
    monkeypatch.setenv("ATTNRES_PP_LOSE_RANK_AT_START", "0")
    faults.check_rank_rehearsals(_run_cfg())
    assert faults.freeze_point() == (1, 2) and faults.start_loss_rank() == 0
    for cfg in (_run_cfg(launcher="inprocess"), _run_cfg(stages=1)):
        with pytest.raises(ValueError, match="needs rank processes to rehearse on"):
            faults.check_rank_rehearsals(cfg)
    assert faults.first_start()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # a job torchrun restarted: not the first start
    assert not faults.first_start()
    faults.rehearse_freeze(1, 1)  # would SIGSTOP this process on a first start
    faults.rehearse_start_loss(0)  # would end it


def test_the_step_pause_sleeps_before_each_step_of_every_rank(monkeypatch, tmp_path):
    """ATTNRES_PP_SLOW_STEP_S (pacing for a fault from outside, tests/multihost): every rank's worker
    reads it once and pauses that long before each of its steps; unset, 0 s."""
    from attnres_pp.cli import main
    from attnres_pp.train import stage_worker

    paused: list[float] = []
    monkeypatch.setattr(stage_worker, "rehearse_slow_step", paused.append)
    argv = ["train", "--launcher", "inprocess", "--stages", "2", "--layers", "2", "--d-model", "16", "--heads", "2",
            "--seq-len", "8", "--batch-size", "2", "--microbatches", "2", "--steps", "2", "--eval-every", "0",
            "--no-final-checkpoint", "--quiet"]
    monkeypatch.setenv("ATTNRES_PP_SLOW_STEP_S", "0.25")
    assert main([*argv, "--out", str(tmp_path / "paced")]) == 0
    assert paused == [0.25] * 4  # two ranks, two steps
    monkeypatch.delenv("ATTNRES_PP_SLOW_STEP_S")
    assert faults.slow_step_s() == 0.0  # unset: a rank pauses 0 s, and rehearse_slow_step(0.0) never sleeps


class _Stoppable(_Live):
    """A rank process that ends when told to (terminate), recording how long the group waited on it."""

    def __init__(self, pid: int) -> None:
        super().__init__(pid)
        self.alive, self.waits = True, []

    def is_alive(self) -> bool:
        return self.alive

    def join(self, timeout=None) -> None:
        self.waits.append(timeout)

    def terminate(self) -> None:
        self.alive = False


def test_a_frozen_rank_makes_the_stop_wait_for_no_rank_to_close():
    """Ctrl-C or SIGTERM while rank 1 is frozen: rank 0 may be blocked on it and would never read a
    close, so no close is sent and no rank is waited on for one (10 s each); a run whose ranks all
    beat closes them gracefully."""
    for ages, graceful in (([0.0, 8.0], False), ([0.0, 0.5], True)):
        group, rank_ends = _group(ages)
        group.procs = [_Stoppable(os.getpid()) for _ in range(2)]  # SIGCONT to this process does nothing
        procs = list(group.procs)
        group.stop(graceful=True)
        assert (_received(rank_ends[0]) == ("close", ())) is graceful
        assert (10 in procs[0].waits) is graceful


def _received(rank_end):
    """What the driver sent down a pipe it has since closed (None: nothing before the end)."""
    try:
        return rank_end.recv()
    except EOFError:
        return None
