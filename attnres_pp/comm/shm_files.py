"""The files behind `comm.shm_transport`'s slots: made by each pair's receiver with every page
allocated, mapped by both ranks, named by the run's token, the pair and the creator's pid so that
a run whose every rank died in its set-up leaves files the next set-up can recognise and remove
(`remove_stale`), and laid out one slot per message (`slot_layout`)."""

from __future__ import annotations

import contextlib
import errno
import os
import re

import torch

# A file of this project's set-up: the run's token, the pair's global ranks, its creator's pid.
FILE_NAME = re.compile(r"attnres-pp-[0-9a-f]{16}-\d+-to-\d+-p(\d+)\.(?:data|count|bell)")
ALIGN_ELEMENTS = 64  # slots start on 256-byte boundaries (fp32)

Message = tuple[int, int, int, tuple[torch.Size, ...]]  # (src, dst, tag, shapes), see pipeline.routes


class SharedMemoryFull(ValueError):
    """The shared-memory directory has no room for the slots: a setup error that names the fix."""


def create_files(pair: tuple[int, int], stem: str, n_elements: int, offsets: dict[int, int], dtype: torch.dtype,
            arenas: dict, fds: dict) -> None:
    """The receiver's files of `pair` (src, dst), every page allocated now (posix_fallocate): a tmpfs
    that fills up later cannot take a page from a mapping mid-step (which would be a SIGBUS)."""
    os.mkfifo(f"{stem}.bell", 0o600)
    fds[pair] = os.open(f"{stem}.bell", os.O_RDONLY | os.O_NONBLOCK)
    element = torch.empty((), dtype=dtype).element_size()
    for path, n_bytes in ((f"{stem}.data", max(n_elements, 1) * element), (f"{stem}.count", (len(offsets) + 1) * 8)):
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, n_bytes)
        except OSError as error:
            if error.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            where = os.path.dirname(path)
            raise SharedMemoryFull(
                f"{where} has no room for this run's shared-memory hop slots ({n_bytes} bytes for "
                f"{os.path.basename(path)}: {os.strerror(error.errno)}); free space in {where} (a container may "
                "need a larger /dev/shm), or set ATTNRES_PP_SHM=0 to send the hops over gloo") from None
        finally:
            os.close(fd)
    arenas[pair] = _map(stem, n_elements, offsets, dtype)


def open_files(pair: tuple[int, int], stem: str, n_elements: int, offsets: dict[int, int], dtype: torch.dtype,
          arenas: dict, fds: dict) -> None:
    """The sender's side of `pair`: the receiver's files, and the pipe's writing end."""
    arenas[pair] = _map(stem, n_elements, offsets, dtype)
    fds[pair] = os.open(f"{stem}.bell", os.O_WRONLY | os.O_NONBLOCK)


def file_stem(base: str, src: int, dst: int, creator_pid: int) -> str:
    """The files of pair (src, dst) of the run `base`, made by the receiver, whose pid they carry."""
    return f"{base}-{src}-to-{dst}-p{creator_pid}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def remove_stale(directory: str) -> list[str]:
    """Remove this project's set-up files in `directory` whose creator pid is not alive (a run
    whose every rank died inside its set-up); returns their names. A live creator's, another
    user's (the sticky /dev/shm refuses) and any other file are left alone."""
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        match = FILE_NAME.fullmatch(name)
        if match is None or int(match.group(1)) <= 0 or _alive(int(match.group(1))):
            continue
        with contextlib.suppress(FileNotFoundError, PermissionError):
            os.unlink(os.path.join(directory, name))
            removed.append(name)
    return removed


def unlink_run(base: str) -> None:
    """Remove every file of this run (its unique name prefix), whichever rank made it: a rank that
    died during the setup leaves its files to the others."""
    directory, prefix = os.path.split(base)
    for name in os.listdir(directory):
        if name.startswith(prefix + "-"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(directory, name))


def _map(stem: str, n_elements: int, offsets: dict[int, int], dtype: torch.dtype):
    data = torch.from_file(f"{stem}.data", shared=True, size=max(n_elements, 1), dtype=dtype)
    counters = torch.from_file(f"{stem}.count", shared=True, size=len(offsets) + 1, dtype=torch.int64)
    return data, counters


def slot_layout(messages: list[Message]) -> dict[tuple[int, int], tuple[int, dict[int, int]]]:
    """Per (src, dst): (elements of its data file, tag -> first element of the message's slot)."""
    layout: dict[tuple[int, int], tuple[int, dict[int, int]]] = {}
    for src, dst, tag, shapes in sorted(messages, key=lambda m: (m[0], m[1], m[2])):
        size, offsets = layout.get((src, dst), (0, {}))
        offsets[tag] = size
        numel = sum(torch.Size(s).numel() for s in shapes)
        layout[(src, dst)] = (size + -(-numel // ALIGN_ELEMENTS) * ALIGN_ELEMENTS, offsets)
    return layout


def slot_views(arena: torch.Tensor, offset: int, shapes: tuple[torch.Size, ...]) -> tuple[torch.Tensor, ...]:
    views, first = [], offset
    for shape in shapes:
        numel = torch.Size(shape).numel()
        views.append(arena[first:first + numel].view(shape))
        first += numel
    return tuple(views)
