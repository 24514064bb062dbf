"""A torch.distributed process group whose ranks are threads of this process: what the in-process
launcher's ranks join under tensor parallelism, so that DTensor and DeviceMesh run on them as they
run on rank processes.

Why torch.testing._internal: its `multi_threaded_pg` is the only thread-backed process group torch
has (the "threaded" backend its own DTensor tests run on). It needs two process-wide switches, which
`ThreadedWorld` turns on for one run and off again when the run ends, also when it fails:
- `_set_thread_isolation_mode(True)`: c10d's registry of process groups by name becomes one per
  thread (without it the second rank's `init_process_group` fails: a group is already registered
  under the name "0");
- `_install_threaded_pg()`: torch.distributed's bookkeeping of groups (its "world") becomes one per
  thread, and autograd's multithreading is switched off, so that a backward runs on the thread that
  calls it (the rank's own, whose groups its collectives resolve).
While a run holds them no other thread of this process may use torch.distributed, so one run at a time
holds them (a second is refused, ValueError).

Every rank thread joins with `join(rank)` and leaves with `leave()` on the thread that joined: a
thread's groups are visible to that thread alone, so a rank's calls all run on its own thread
(`thread_rank_group`). The threaded group's collectives wait without a timeout; `wake_blocked` makes
every rank blocked in one raise (SystemExit), which the caller's bounded waits use when a rank fails
or stops answering.
"""

from __future__ import annotations

import datetime
import threading

import torch
import torch.distributed as dist

_held = threading.Lock()  # held by the one run whose threads use the threaded process group


class ThreadedWorld:
    """The threaded process group of `world_size` thread ranks: `install()` before any rank joins,
    `uninstall()` once every rank has left (or failed); both on the driver's thread."""

    def __init__(self, world_size: int, timeout_s: float) -> None:
        self.world_size, self.timeout_s = world_size, timeout_s
        self.installed = False
        self._store = None

    def install(self) -> None:
        from torch.testing._internal.distributed import multi_threaded_pg

        if not _held.acquire(blocking=False):
            raise ValueError("another in-process tensor-parallel run holds this process's threaded process group: "
                             "run one at a time, or use --launcher local")
        try:
            if dist.is_initialized():
                raise ValueError("this process is already in a torch.distributed process group: an in-process "
                                 "tensor-parallel run needs the threaded one (use --launcher local)")
            torch._C._distributed_c10d._set_thread_isolation_mode(True)
            multi_threaded_pg._install_threaded_pg()
            multi_threaded_pg.ProcessLocalGroup.reset()
        except BaseException:
            torch._C._distributed_c10d._set_thread_isolation_mode(False)
            _held.release()
            raise
        self._store = dist.HashStore()
        self.installed = True

    def join(self, rank: int) -> None:
        """On rank `rank`'s own thread: join the group (a store-based barrier with the others, bounded)."""
        dist.init_process_group("threaded", rank=rank, world_size=self.world_size, store=self._store,
                                timeout=datetime.timedelta(seconds=self.timeout_s))

    @staticmethod
    def leave() -> None:
        """On a rank's own thread: destroy the groups it joined (nothing if it joined none)."""
        if dist.is_initialized():
            dist.destroy_process_group()

    @staticmethod
    def wake_blocked(error: BaseException) -> None:
        """Make every rank thread waiting in a threaded collective raise SystemExit, now and in any
        collective it enters until `clear_wake`."""
        from torch.testing._internal.distributed import multi_threaded_pg

        multi_threaded_pg.ProcessLocalGroup.exception_handle(error)

    @staticmethod
    def clear_wake() -> None:
        """Forget the collectives `wake_blocked` interrupted, so the groups can run collectives again."""
        from torch.testing._internal.distributed import multi_threaded_pg

        multi_threaded_pg.ProcessLocalGroup.reset()

    def uninstall(self) -> None:
        """Give torch.distributed, the group registry and autograd back as they were. Safe twice."""
        from torch.testing._internal.distributed import multi_threaded_pg

        if not self.installed:
            return
        self.installed = False
        try:
            multi_threaded_pg.ProcessLocalGroup.reset()
            multi_threaded_pg._uninstall_threaded_pg()
        finally:
            torch._C._distributed_c10d._set_thread_isolation_mode(False)
            self._store = None
            _held.release()
