"""A stand-in for a rank actor's process-group set-up (test_ray.py's set-up refusal), in a module of
its own: the actors that run it import this module and nothing of the package but the refusal's
exception class, on the one rank that raises it, so they start in a fraction of a rank's time."""

from __future__ import annotations

import time
from pathlib import Path


class SetUpRank:
    """Stands in for a rank actor's process-group set-up: rank 1 refuses it as a rank does whose
    /dev/shm has no room (SharedMemoryFull is raised on every rank, naming the one without room), and
    rank 0 gives up because of it, as a real peer does: only once rank 1 has refused (`refused`, a
    file rank 1 makes first). Without that order a loaded machine could start rank 1's actor after
    rank 0 had already failed, a failure no real rank 0 makes on its own."""

    def __init__(self, rank: int, refused: str) -> None:
        self.rank, self.refused = rank, Path(refused)

    def join_process_group(self, init_method: str, world_size: int) -> dict:
        if self.rank == 1:
            from attnres_pp.comm.shm_transport import SharedMemoryFull

            self.refused.touch()
            raise SharedMemoryFull("rank 1: /dev/shm has no room for this run's shared-memory hop slots\n(detail)")
        deadline = time.monotonic() + 60
        while not self.refused.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        raise RuntimeError("rank 0 gave up: its peer left the set-up")
