"""The local rank group's pipes (pipeline/rank_group.py) when a rank dies with a request unread: its
end of the socket pair is reset rather than closed, and the driver must still say which rank was
lost (WorkerLost), not fail with a bare ConnectionResetError. Real pipes, no process: the rank's
death is its end closing with the request unread, which is what the kernel sees when it dies."""

from __future__ import annotations

import multiprocessing
from multiprocessing.reduction import ForkingPickler

import pytest

from attnres_pp.pipeline.errors import WorkerLost
from attnres_pp.pipeline.rank_group import ProcessRankGroup


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
