"""The rank processes' fork server ends without the interpreter's teardown.

`process_rank_group` preloads this module into the fork server (and nowhere else imports it). The
server ends when its last client is gone (the driver and every rank it forked); a teardown of an
interpreter holding torch then costs ~0.7 CPU-s, several seconds of wall on a loaded machine, so a
SIGKILLed driver's server outlived its ranks by seconds (the chaos suite's leak check saw it past
its 5 s). The server holds nothing to flush or release: its files are the pipes its clients hold.
"""

from __future__ import annotations

import atexit
import os
import sys

REGISTERED = False  # whether this process is a fork server that quits at once (a forked rank inherits it)


def _quit_at_once() -> None:
    """Run first at the server's exit (atexit's last registered): flush what it printed, then end."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass
    os._exit(0)


def _in_the_fork_server() -> bool:
    """Whether multiprocessing's fork-server loop (`multiprocessing.forkserver.main`, which imports the
    preload list) is importing this module."""
    frame = sys._getframe()
    while frame is not None:
        code = frame.f_code
        if code.co_name == "main" and code.co_filename.endswith(os.path.join("multiprocessing", "forkserver.py")):
            return True
        frame = frame.f_back
    return False


if _in_the_fork_server():
    atexit.register(_quit_at_once)
    REGISTERED = True
