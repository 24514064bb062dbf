"""The local rank group's replies (launch/process_rank_group.py) when ranks fail: a rank that dies with a
request unread resets its end of the socket pair rather than closing it, and the driver must still
say which rank was lost (WorkerLost), not fail with a bare ConnectionResetError; a rank that exits
after reporting why (a refusal, an error) is its report, not a death, and among the reports the
cause wins over its consequences, lowest rank first. Real pipes, no process: a rank's death is its
end closing (or its process object saying it exited), so each race is forced, not waited for."""

from __future__ import annotations

import multiprocessing
import threading
import time
from multiprocessing.reduction import ForkingPickler

import pytest

from attnres_pp.launch import rank_group
from attnres_pp.launch.process_rank_group import ProcessRankGroup
from attnres_pp.pipeline.errors import WorkerLost


class _Alive:
    """A rank process the group believes alive (the reset reaches the pipe before the exit is seen)."""

    exitcode = None

    def is_alive(self) -> bool:
        return True


def _group_with_a_reset_rank() -> ProcessRankGroup:
    group = ProcessRankGroup(2, timeout_s=5.0, name="pipes")
    for rank in range(2):
        driver_end, rank_end = multiprocessing.Pipe()
        group.conns.append(driver_end)
        group.procs.append(_Alive())
        if rank == 1:
            driver_end.send_bytes(b"a request rank 1 never read")
            rank_end.close()  # rank 1 died: its end goes away with the request unread
        else:
            group.rank0_end = rank_end  # rank 0 is alive and answers
            rank_end.send_bytes(ForkingPickler.dumps(("ok", "rank 0's answer")))
    return group


def test_a_reset_pipe_is_the_lost_rank_named():
    group = _group_with_a_reset_rank()
    with pytest.raises(WorkerLost, match="rank 1 closed its pipe during save_written") as info:
        group.gather("save_written")
    assert info.value.pp_rank == 1


class _Exited:
    """A rank process that has exited cleanly, after its last reply."""

    exitcode = 0

    def is_alive(self) -> bool:
        return False


NO_ROOM = "/dev/shm has no room for this run's shared-memory hop slots"


def _refusal(rank: int) -> bytes:
    return ForkingPickler.dumps(("refused", f"rank {rank}: {NO_ROOM}"))


def _group_where_rank1_refused_and_exited() -> tuple[ProcessRankGroup, list]:
    """Rank 1 has refused to start and exited (code 0); rank 0 is alive and has not answered yet."""
    group = ProcessRankGroup(2, timeout_s=5.0, name="race")
    rank_ends = []
    for _rank in range(2):
        driver_end, rank_end = multiprocessing.Pipe()
        group.conns.append(driver_end)
        rank_ends.append(rank_end)
    group.procs = [_Alive(), _Exited()]
    rank_ends[1].send_bytes(_refusal(1))
    return group, rank_ends


def test_a_partners_exit_after_its_refusal_is_not_reported_as_a_death():
    """The set-up race, forced: rank 1 refuses and exits, rank 0 refuses 0.5 s later. The driver, waiting
    on rank 0, sees rank 1's exit first; it reads rank 1's reply before calling the exit a death, gives
    rank 0 its moment to report, and raises the lowest rank's refusal (one line, a ValueError), not
    `rank 1 exited (code 0) during setup`."""
    group, rank_ends = _group_where_rank1_refused_and_exited()
    late = threading.Timer(0.5, lambda: rank_ends[0].send_bytes(_refusal(0)))
    late.start()
    try:
        with pytest.raises(ValueError) as info:
            group.gather("setup")
    finally:
        late.cancel()
    assert not isinstance(info.value, WorkerLost)
    assert str(info.value) == f"rank 0 refused to start: rank 0: {NO_ROOM}"


def test_a_refusal_wins_over_a_silent_partner_once_the_grace_is_over(monkeypatch):
    """Rank 0 never answers (blocked on the rank that left): after FAILURE_GRACE_S the report that did
    come, rank 1's refusal, is the cause raised; the wait is bounded by the grace, not the timeout."""
    monkeypatch.setattr(rank_group, "FAILURE_GRACE_S", 0.3)
    group, _rank_ends = _group_where_rank1_refused_and_exited()
    began = time.monotonic()
    with pytest.raises(ValueError, match="^rank 1 refused to start: rank 1: /dev/shm has no room"):
        group.gather("setup")
    assert time.monotonic() - began < 3.0  # the grace (0.3 s) and one poll, not the 5 s timeout


def test_an_exit_without_a_report_is_the_lost_rank_and_wins_over_the_error_it_caused():
    """Rank 1 exits with nothing said (killed); rank 0 then fails its receive. The death is named, with
    rank 0's error as the detail that follows from it."""
    group = ProcessRankGroup(2, timeout_s=5.0, name="death")
    rank_ends = []
    for _rank in range(2):
        driver_end, rank_end = multiprocessing.Pipe()
        group.conns.append(driver_end)
        rank_ends.append(rank_end)
    killed = _Exited()
    killed.exitcode = -9
    group.procs = [_Alive(), killed]
    rank_ends[0].send_bytes(ForkingPickler.dumps(("error", "RuntimeError: connection closed by peer")))
    with pytest.raises(WorkerLost, match=r"rank 1 exited \(code -9\) during step 3\nrank 0 then failed with") as info:
        group.gather("step 3")
    assert info.value.pp_rank == 1
