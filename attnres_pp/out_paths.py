"""Checks of the paths a command will write (`--out DIR`, `--trace FILE`, ...), made before any work
starts so that a bad path is one `error:` line, not a traceback after minutes of training. Pure
standard library: the simulator uses it too."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def check_out_dir(path: str | Path, flag: str) -> None:
    """Raise ValueError saying what to change unless `path` is, or can be created as, a writable directory."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{flag} {path} is an existing file: give a directory (it is created if missing)")
    _check_creatable(path, flag)


def check_out_file(path: str | Path, flag: str, example_name: str) -> None:
    """Raise ValueError saying what to change unless `path` can be written as a file (its folder is
    created if missing)."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{flag} {path} is a directory: give a file path, e.g. {path / example_name}")
    _check_creatable(path.parent, flag, shown=path)


def _check_creatable(folder: Path, flag: str, shown: Path | None = None) -> None:
    """The nearest existing ancestor of `folder` (itself included) must be a directory we may write in."""
    shown = folder if shown is None else shown
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"{flag} {shown} cannot be created: {existing} is a file, not a directory; "
                         f"choose another {flag}")
    # Permission bits do not stop root, and some file systems (read-only, /proc) refuse anyway: try it.
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".write-check-", dir=existing))
    except OSError as error:
        raise ValueError(f"{flag} {shown} cannot be written: {existing} refuses new entries ({error.strerror}); "
                         f"choose another {flag}") from None
