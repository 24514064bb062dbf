"""Shared-memory set-up files carry their creator's pid; files of this project whose creator is
gone (a run whose every rank died inside its set-up) are removed when a set-up starts, and nothing
else is: in-process, in a temporary directory."""

from __future__ import annotations

import os
from pathlib import Path

from attnres_pp.comm.shm_files import FILE_NAME, file_stem, remove_stale


def _gone_pid() -> int:
    """A pid no process can have: above the kernel's pid_max."""
    return int(Path("/proc/sys/kernel/pid_max").read_text()) + 1


def test_a_files_name_carries_its_creators_pid():
    stem = file_stem("/dev/shm/attnres-pp-0123456789abcdef", 2, 3, 4242)
    assert stem == "/dev/shm/attnres-pp-0123456789abcdef-2-to-3-p4242"
    for suffix in (".data", ".count", ".bell"):
        assert FILE_NAME.fullmatch(os.path.basename(stem) + suffix).group(1) == "4242"


def test_files_of_a_gone_creator_are_removed_and_nothing_else(tmp_path):
    gone, token = _gone_pid(), "0123456789abcdef"
    stale = [f"attnres-pp-{token}-0-to-1-p{gone}{suffix}" for suffix in (".data", ".count", ".bell")]
    live = [f"attnres-pp-{token}-1-to-0-p{os.getpid()}.data", f"attnres-pp-{token}-1-to-0-p1.count"]
    other = [f"attnres-pp-{token}-0-to-1.data",  # no pid: not one of these files
             f"attnres-pp-test-0-to-1-p{gone}.data", f"someone-else-p{gone}.data", f"attnres-pp-{token}-0-to-1-p0.data"]
    for name in (*stale, *live, *other):
        (tmp_path / name).write_bytes(b"")
    assert sorted(remove_stale(str(tmp_path))) == sorted(stale)
    assert sorted(os.listdir(tmp_path)) == sorted([*live, *other])
    assert remove_stale(str(tmp_path / "missing")) == []
