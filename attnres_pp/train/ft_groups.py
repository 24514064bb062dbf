"""ReplicaGroup: one replica's P x T ranks under `--fault-tolerance replicas` (`train.ft_replicas`) and
where the group stands, with its restart in the background: a lost group's ranks are stopped and
started again (without any injected failure) on a thread of the driver, while the engine goes on
stepping the others; the engine polls it (`poll_restart`) and sends the group its step once it is
started."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

RESTARTS_PER_GROUP = 3  # a group lost more often than this stays out of the run


def replica_rank(replica: int, index: int, group_size: int) -> int:
    """The global rank of rank `index` of replica group `replica` (groups of `group_size` = P x T ranks)."""
    return replica * group_size + index


@dataclass
class ReplicaGroup:
    """`ranks`: the group's rank group (local processes or Ray actors), built with `worker_cls` and
    `kwargs` (one per rank). `state`: "live" (stepping), "restarting" (its ranks being started
    again), "joining" (started, its first step not yet committed) or "out" (lost more than
    RESTARTS_PER_GROUP times, or failed to start). `lost`: the open recovery record (summary.json's
    `recoveries`, with the driver's clock reading `lost_s`) from a loss to the group's first commit."""

    replica: int
    ranks: object
    worker_cls: type
    kwargs: list[dict]
    state: str = "live"
    in_flight: bool = False
    restarts: int = 0
    thread: threading.Thread | None = None
    error: BaseException | None = None
    lost: dict | None = None

    def lose(self, lost: Exception, step: int, group_size: int) -> None:
        """Stop the group's ranks and start them again in the background (WorkerLost `lost` at 0-based
        `step`; its `pp_rank` is the lost rank's index in the group of `group_size` = P x T ranks)."""
        self.ranks.stop_ranks()
        self.in_flight = False
        rank = replica_rank(self.replica, max(getattr(lost, "pp_rank", 0), 0), group_size)
        self.lost = {"replica": self.replica, "lost_at_step": step,
                     "cause": f"global rank {rank}: " + (str(lost).splitlines() or [""])[0], "lost_s": time.monotonic()}
        if self.restarts >= RESTARTS_PER_GROUP:
            self.state = "out"
            return
        self.restarts += 1
        self.state = "restarting"
        kwargs = [{**k, "fail_at_step": None} for k in self.kwargs]

        def restart() -> None:
            try:
                self.ranks.start(self.worker_cls, kwargs, device="cpu")
            except BaseException as error:  # reported by `poll_restart`, in the driver's thread
                self.error = error

        self.thread = threading.Thread(target=restart, name=f"restart-replica{self.replica}", daemon=True)
        self.thread.start()

    def poll_restart(self) -> bool:
        """A finished restart makes the group "joining", a failed one "out"; True when it failed (its
        recovery record is then final)."""
        if self.state != "restarting" or self.thread.is_alive():
            return False
        if self.error is None:
            self.state = "joining"
            return False
        self.state = "out"
        self.lost["restart_error"] = (str(self.error).splitlines() or [""])[0]
        return True


def public(record: dict) -> dict:
    """A recovery record as summary.json shows it (without the driver's clock reading)."""
    return {key: value for key, value in record.items() if key != "lost_s"}
