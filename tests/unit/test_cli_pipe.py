"""A reader that closes the pipe early (`attnres-pp simulate ... | head`): the command ends quietly
with 141 (128 + SIGPIPE, what a shell reports for a writer a closed pipe stopped), no traceback."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


@pytest.mark.subprocess
def test_a_closed_pipe_ends_the_command_without_a_traceback():
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first write: every write meets a closed pipe
    try:
        done = subprocess.run([sys.executable, "-m", "attnres_pp.cli", "simulate", "comm", "--layers", "64",
                               "--block-size", "1", "--stages", "8", "--virtual", "2"],
                              stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write_end)
    assert done.stderr == "" and done.returncode == 141, (done.returncode, done.stderr[-2000:])
