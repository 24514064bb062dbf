"""How a driver starts and talks to the ranks of a pipeline, whoever hosts them: the `RankGroup`
interface that training (`train.engine` under its replica policies, `train.replica_policy` and
`train.ft_replicas`) and generation (`generate.engines`) use alone, every method and attribute they
call named there, and `RankGroupBase`, what its implementations do the same way. The
implementations: `process_rank_group` (one local process per rank, `--launcher local`),
`thread_rank_group` (every rank a thread of this process, `--launcher inprocess`),
`ray_rank_group` (one Ray actor per rank, `--launcher ray`) and `torchrun_rank_group` (the
processes torchrun started, `--launcher torchrun`); `launchers.make_rank_group` gives the one a
launcher names.

A group hosts one worker per rank (a `rank_host.RankHost`): `start(worker_cls, rank_kwargs,
device=...)` builds `worker_cls(**rank_kwargs[rank])` on every rank and joins them
(`worker.join_process_group(init_method, world_size)` for processes and actors,
`worker.join_threads(...)` for threads); what each rank's join returns is `setup_results`. Then
`call(method, per_rank_args)` runs `worker.method(*per_rank_args[rank])` on every rank at once and
returns the results in rank order; `send` and `gather` are its two halves, for a driver that steps
several groups at once.

Every wait is bounded by the pipeline timeout (plus start-up slack): a rank that dies or stops
answering is WorkerLost naming it, a rank whose set-up raises ValueError is one line (`rank R
refused to start: ...`, a ValueError, so the CLI prints it as `error:`), any other failure a
RuntimeError carrying the rank's traceback. When several ranks fail, the cause is raised, not what
follows from it: a refusal first, then a rank lost without a word or hung, then an error, lowest
rank first in each (see each group's gather).

A hung rank (frozen by SIGSTOP, a debugger, a process that no longer runs) is `RankHung`, a
WorkerLost: the group kills it and the loop restarts the ranks as for a lost one. How a group sees
it: the local group's ranks beat a heartbeat every HEARTBEAT_S; the Ray and torchrun groups look at
the state of the rank processes on the driver's host (`process_stopped`). A rank silent for
`hung_after_s(timeout)` is hung; once a peer has failed (its transport timed out waiting for the
silent one), a silence of STALE_S is enough: the peer's failure is the consequence, the silence the
cause. A rank hung elsewhere (another host, or alive but deadlocked) meets the step deadline
(timeout + start-up slack): WorkerLost naming it.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Protocol

from attnres_pp.pipeline.errors import WorkerLost

# Once a rank has reported a failure, how long the others get to report theirs before the driver names
# the cause: ranks that refuse together (a full /dev/shm) reply moments apart, in any order, and the
# lowest rank's report is the one raised whichever arrived first.
FAILURE_GRACE_S = 3.0
# How often a local rank stamps its heartbeat, and the silence that marks a rank hung once a peer has
# failed: a rank that runs at all (even blocked on a peer) stamps within a beat or two.
HEARTBEAT_S = 1.0
STALE_S = 3.0


def hung_after_s(timeout_s: float) -> float:
    """The silence after which a rank is hung with no other sign: half the pipeline timeout, so the
    driver names the hung rank before its peers' transports time out waiting for it (at the full
    timeout) and report errors that only follow from it; at least 5 s, so a loaded machine's
    scheduling delays never count."""
    return max(5.0, timeout_s / 2)


class RankHung(WorkerLost):
    """A rank that stopped answering while its process lives (frozen, hung): killed, then treated
    as lost (restarted from the last checkpoint within --max-restarts). `why`: the sign, in words."""

    def __init__(self, pp_rank: int, message: str, why: str) -> None:
        super().__init__(pp_rank, message)
        self.why = why


def hung(rank: int, what: str, silent_s: float, *, stopped: bool = False) -> RankHung:
    """The one-line RankHung for `rank`, silent for `silent_s` seconds during `what`: its heartbeat,
    or (`stopped`) its process seen stopped."""
    why = (f"its process stopped for {silent_s:.0f} s (SIGSTOP or a debugger); killed it" if stopped
           else f"no heartbeat for {silent_s:.0f} s: its process is frozen or hung; killed it")
    return RankHung(rank, f"rank {rank} stopped answering during {what} ({why})", why)


def process_stopped(pid: int) -> bool:
    """Whether process `pid` of this host is stopped (SIGSTOP, SIGTSTP, a debugger): state T or t
    in /proc/PID/stat (after the command name, which may hold spaces and parentheses)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            text = stat.read()
    except OSError:
        return False
    return text[text.rfind(b")") + 2:text.rfind(b")") + 3] in (b"T", b"t")


def kill_pid(pid: int | None) -> None:
    """SIGKILL `pid` (a hung rank: SIGKILL ends even a stopped process; SIGTERM would wait for a SIGCONT)."""
    if pid:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


class StoppedSince:
    """When each rank's process was first seen stopped (the Ray and torchrun groups' sign of a hung
    rank on this host): `silent_s(rank)` is how long it has been stopped, 0 if it runs. `pids[rank]`
    is None for a rank on another host (which only the step deadline can catch)."""

    def __init__(self, pids: list[int | None]) -> None:
        self.pids = pids
        self.since: dict[int, float] = {}

    def silent_s(self, rank: int) -> float:
        pid = self.pids[rank] if rank < len(self.pids) else None
        if pid is None or not process_stopped(pid):
            self.since.pop(rank, None)
            return 0.0
        return time.monotonic() - self.since.setdefault(rank, time.monotonic())

    def raise_if_hung(self, silent: list[int], what: str, limit_s: float | None) -> None:
        """Raise the RankHung of the lowest of the `silent` ranks stopped for more than `limit_s`
        (None: stopped now, the cause once a peer has failed), its process killed, if there is one."""
        for rank in sorted(silent):
            silent_s = self.silent_s(rank)
            if (silent_s > limit_s) if limit_s is not None else rank in self.since:
                kill_pid(self.pids[rank])
                raise hung(rank, what, silent_s, stopped=True)


class RankGroup(Protocol):
    """What engines and generators need of the ranks, whoever hosts them."""

    world_size: int
    one_process: bool  # every rank in the driver's process (the device rules for one process apply)
    spans_nodes: bool  # ranks may run on several nodes: `rank_nodes` and `lost_nodes` are meaningful
    where: str  # where `gpus()` counts, for the device decision's messages
    setup_results: list  # each rank's join result, in rank order
    bytes_exchanged: int  # driver <-> rank traffic so far, both directions
    rank_nodes: list[tuple[str, str]]  # (node id, node address) per rank, where the group knows them
    lost_nodes: list[dict]  # each rank lost so far: rank, node, address and what it was doing

    def gpus(self) -> int | None:
        """GPUs the ranks can have (None: this machine's, as the driver counts them)."""

    def driver_address(self) -> str | None:
        """The driver's node address as ranks on other nodes reach it (None: every rank is on this host)."""

    def start(self, worker_cls: type, rank_kwargs: list[dict], *, device: str) -> list:
        """Build and join one worker per rank on `device` ("cpu" or "cuda"); returns `setup_results`."""

    def call(self, method: str, per_rank_args: list[tuple], what: str | None = None) -> list:
        """`worker.method(*per_rank_args[rank])` on every rank; `what` names the call in errors."""

    def call_all(self, method: str, *args, what: str | None = None) -> list:
        """`worker.method(*args)` on every rank."""

    def send(self, method: str, per_rank_args: list[tuple]) -> None:
        """The requests of `call` without waiting for the replies (`gather` collects them)."""

    def replied(self) -> bool:
        """Whether `gather` would return or raise without waiting: every rank has replied, or one failed."""

    def gather(self, what: str) -> list:
        """The replies to the last `send`, in rank order (raising as `call` does)."""

    def stop_ranks(self) -> None:
        """Stop every rank at once (survivors may be blocked on a lost one); the group can `start` again."""

    def restart(self, rank_kwargs: list[dict] | None = None) -> None:
        """Stop every rank and start fresh workers, with `rank_kwargs` or the last ones."""

    def stop(self, graceful: bool) -> None:
        """graceful: let each live worker close (leave its process group) first. Safe to call twice."""


class RankGroupBase:
    """What every rank group does alike: its bookkeeping, `call` as `send` then `gather`, `call_all`,
    `restart`. A subclass provides `start`, `send`, `replied`, `gather`, `stop_ranks` and `stop`,
    and records `(worker_cls, rank_kwargs, device)` in `_worker` when it starts."""

    one_process = False
    spans_nodes = False
    where = "on this node"

    def __init__(self, world_size: int, timeout_s: float) -> None:
        self.world_size, self.timeout_s = world_size, timeout_s
        self.bytes_exchanged = 0
        self.setup_results: list = []
        self.rank_nodes: list[tuple[str, str]] = []
        self.lost_nodes: list[dict] = []
        self._worker: tuple[type, list[dict], str] | None = None

    def gpus(self) -> int | None:
        return None

    def driver_address(self) -> str | None:
        return None

    def call(self, method: str, per_rank_args: list[tuple], what: str | None = None) -> list:
        self.send(method, per_rank_args)
        return self.gather(what or method)

    def call_all(self, method: str, *args, what: str | None = None) -> list:
        return self.call(method, [args] * self.world_size, what)

    def restart(self, rank_kwargs: list[dict] | None = None) -> None:
        worker_cls, last_kwargs, device = self._worker
        self.stop_ranks()
        self.start(worker_cls, rank_kwargs or last_kwargs, device=device)
