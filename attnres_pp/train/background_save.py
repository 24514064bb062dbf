"""A rank's asynchronous checkpoint write (`--async-checkpoint`): DCP's `async_save`, at most one in
flight.

`begin` first waits for this rank's previous write (so a second save never overtakes the first, and
a rank holds at most one staged copy), then hands the state to `dcp.async_save`: DCP's staging
copies every tensor (FileSystemWriter's blocking stager) before `begin` returns, so the optimizer
may change the parameters at once, and a thread of DCP's writes and fsyncs the copy
(`sync_files=True`, as the blocking save). The staged copy costs this rank one more state's bytes
(parameters and optimizer state) until the write is done.

Ranks of one process group save collectively; their background writes plan and finish with
collectives of their own, which must not interleave with the training step's sends and receives on
the default group, so they run on a gloo group made for them (DCP requires a CPU backend for
`async_save` anyway, also under NCCL). The group is made at the first save, which every rank of the
default group begins together.
"""

from __future__ import annotations

import time
import warnings
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from attnres_pp.launch.storage_fault import find_storage_fault, out_of_space
from attnres_pp.train.shards import rank_failures

# One process has no peer to wait for: only the filesystem can stall its write, bounded by this.
ONE_PROCESS_TIMEOUT_S = 600.0


# Without a process group DCP warns, from its writer thread (where no `catch_warnings` of the caller
# reaches), that it assumes one process: that is the intent of a one-process save.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized, "
                        "assuming the intent is to save")


class BackgroundSave:
    """This rank's write in flight, if any. `timeout_s` bounds every wait for it."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._future: Future | None = None
        self._step_dir: str | None = None
        self._needed_bytes = 0  # what the write in flight puts on disk
        self._group = None

    def begin(self, step_dir: str | Path, state: dict, *, distributed: bool, on_written=None) -> float:
        """Start writing `state` into `step_dir`; returns the seconds this call blocked (waiting for
        the previous write, then DCP's copy of the state). `on_written()` runs in the writer's thread
        once the shard is on disk (the crash rehearsal's `after-shard` point)."""
        t0 = time.perf_counter()
        self.wait()
        group = self._save_group() if distributed else None
        try:
            self._future = dcp.async_save(state, storage_writer=FileSystemWriter(str(step_dir), sync_files=True),
                                          process_group=group, no_dist=not distributed)
        except (Exception, CheckpointException) as error:  # planning may run here (one process: no thread yet)
            raise save_failure(step_dir, error, "background ", needed_bytes=state_bytes(state)) from error
        self._step_dir, self._needed_bytes = str(step_dir), state_bytes(state)
        if on_written is not None:
            self._future.add_done_callback(lambda future: future.exception() is None and on_written())
        return time.perf_counter() - t0

    def written(self) -> bool:
        """Whether no write is in flight any more (done, or failed: `wait` raises its error)."""
        return self._future is None or self._future.done()

    def wait(self) -> None:
        """Block until the write in flight is done; raise RuntimeError, naming the folder, if it
        failed or took longer than `timeout_s`. Nothing in flight afterwards either way."""
        future, step_dir = self._future, self._step_dir
        if future is None:
            return
        self._future = self._step_dir = None
        try:
            future.result(timeout=self.timeout_s)
        except FutureTimeout:
            raise RuntimeError(f"the background checkpoint write into {step_dir} did not finish within "
                               f"{self.timeout_s:.0f} s: the filesystem is too slow or stuck; the previous "
                               "checkpoint stays the newest complete one") from None
        except (Exception, CheckpointException) as error:  # a rank's failure: disk full, permissions
            raise save_failure(step_dir, error, "background ", "; the previous checkpoint stays the newest "
                               "complete one", needed_bytes=self._needed_bytes) from error

    def _save_group(self):
        if self._group is None:
            self._group = dist.new_group(backend="gloo")
        return self._group


def save_failure(step_dir, error: BaseException, kind: str = "", note: str = "", *, needed_bytes: int = 0
                 ) -> Exception:
    """What a rank raises for a checkpoint write of `needed_bytes` that failed with `error`: the
    StorageFault it carries, or ENOSPC when the disk has less room than the write needed (torch's
    writer loses the errno); the driver stops the run in one line, without a restart. Otherwise a
    RuntimeError naming the (`kind`) write, its folder and the first failed rank's error, plus `note`."""
    fault = find_storage_fault(error) or out_of_space(step_dir, needed_bytes)
    if fault is not None:
        return fault
    return RuntimeError(f"the {kind}checkpoint write into {step_dir} failed: {_first_failure(error)}{note}")


def state_bytes(state: dict) -> int:
    """The bytes of the tensors in a shard's `state` (a DTensor counts its local shard)."""
    tensors = (getattr(value, "_local_tensor", value) for value in state.values())
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def _first_failure(error: BaseException) -> str:
    """One line for a failed save: DCP's CheckpointException (a BaseException, not an Exception)
    carries each failed rank's exception with its whole traceback; the first rank's error is the line."""
    failures = rank_failures(error) if isinstance(error, CheckpointException) else []
    if failures:
        rank, cause = failures[0]
        return f"rank {rank}: {type(cause).__name__}: {cause}"
    return f"{type(error).__name__}: {error}"
