"""Writes that fail for want of room or permission: a full disk, a quota, a read-only or unwritable
folder. These are the operator's to fix, not the run's: restarting the ranks would fail the same
way, so a rank reports one as a `StorageFault` (data: the reason and the path) and the driver
stops with one line instead of calling the rank lost.

`find_storage_fault` looks for one anywhere an error can carry it: the error itself, its chain
(`__cause__`, `__context__`), DCP's `CheckpointException` (a BaseException whose `failures` maps each
failed rank to its exception) and a Ray task error's `cause`. Pure standard library: every rank
group and the driver read it."""

from __future__ import annotations

import errno
import os
from pathlib import Path

# errno -> (what happened, what the operator does about it)
_REASONS = {
    errno.ENOSPC: ("no space left on device", "free space"),
    errno.EDQUOT: ("disk quota exceeded", "free space or raise the quota"),
    errno.EACCES: ("permission denied", "make it writable"),
    errno.EPERM: ("operation not permitted", "make it writable"),
    errno.EROFS: ("read-only file system", "mount it writable"),
}
# How far the search follows nested errors: DCP nests one level per rank, chains are short; a cycle
# or a pathological chain must not make the search itself the failure.
_MAX_VISITS = 256


class StorageFault(Exception):
    """A write refused for want of space or permission: `code` (an errno), `path` (what could not
    be written, "" when unknown). Pickles as its two fields, so it crosses pipes and Ray intact. Not
    a RuntimeError: the handlers of rank failures (a RuntimeError with a traceback) must not take it
    for one."""

    def __init__(self, code: int, path: str = "") -> None:
        super().__init__(code, path)
        self.code, self.path = code, path

    @property
    def reason(self) -> str:
        return _REASONS.get(self.code, (os.strerror(self.code), ""))[0]

    @property
    def fix(self) -> str:
        return _REASONS.get(self.code, ("", "free space or make it writable"))[1]

    def __str__(self) -> str:
        return f"{self.reason} writing {self.path}" if self.path else self.reason


def find_storage_fault(error: BaseException | None) -> StorageFault | None:
    """The StorageFault `error` is or carries (an OSError with one of the errnos above counts), or None."""
    pending, seen = [error], set()
    while pending and len(seen) < _MAX_VISITS:
        current = pending.pop(0)
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        code = getattr(current, "code", None) if isinstance(current, StorageFault) else None
        if isinstance(code, int):  # a plain copy: Ray's task error subclasses the class it carries
            return StorageFault(code, str(getattr(current, "path", "") or ""))
        if isinstance(current, OSError) and current.errno in _REASONS:
            return StorageFault(current.errno, str(current.filename or ""))
        failures = getattr(current, "failures", None)
        if isinstance(failures, dict):  # DCP: rank -> (exception, traceback summary)
            for _rank, failure in sorted(failures.items(), key=lambda item: str(item[0])):
                pending.append(failure[0] if isinstance(failure, tuple) and failure else failure)
        for nested in (getattr(current, "cause", None), current.__cause__, current.__context__):
            if isinstance(nested, BaseException):
                pending.append(nested)
    return None


def failure_reply(error: BaseException, format_traceback) -> tuple[str, object]:
    """A rank's reply for a request that raised `error`: ("fault", the StorageFault) when it is one,
    which the driver reports in one line without a restart, else ("error", `format_traceback()`)."""
    fault = find_storage_fault(error)
    return ("fault", fault) if fault is not None else ("error", format_traceback())


def out_of_space(path: str | Path, needed_bytes: int) -> StorageFault | None:
    """ENOSPC for a write of `needed_bytes` into `path` that failed without an errno, when the
    filesystem has fewer bytes free than the write needed. torch.save's zip writer reports a full
    disk as "unexpected pos" (a RuntimeError, the OSError lost in C++), so asking the disk is the
    only way to tell; asked only after a write failed, never to refuse one."""
    try:
        stats = os.statvfs(_existing(path))
    except OSError:
        return None
    free = stats.f_bavail * stats.f_frsize
    return StorageFault(errno.ENOSPC, str(path)) if free < needed_bytes else None


def _existing(path: str | Path) -> Path:
    current = Path(os.path.abspath(path))
    while not current.exists() and current != current.parent:
        current = current.parent
    return current


def mount_point(path: str | Path) -> Path:
    """The mount point of the filesystem holding `path` (or its nearest existing ancestor): the
    disk a full-disk message names."""
    current = _existing(path)
    while not os.path.ismount(current) and current != current.parent:
        current = current.parent
    return current
