"""The rank processes' fork server ends without the interpreter's teardown (launch/fork_server_exit.py):
the server preloads the module, which registers its quick exit there and nowhere else. A teardown with
torch loaded cost ~0.7 CPU-s, seconds of wall on a loaded machine, and a SIGKILLed driver's server
outlived its ranks past the chaos suite's 5 s leak check."""

from __future__ import annotations

import os
import sys

import pytest

from attnres_pp.launch.process_rank_group import rank_context

MODULE = "attnres_pp.launch.fork_server_exit"


def _report_the_servers_module() -> None:
    """A rank's body: exit 3 if the fork server had preloaded the module and registered its quick exit
    (a forked rank inherits both), 4 if it had preloaded it without, 5 if it had not preloaded it."""
    held = sys.modules.get(MODULE)
    os._exit(5 if held is None else 3 if held.REGISTERED else 4)


@pytest.mark.subprocess
def test_the_fork_server_alone_registers_its_quick_exit():
    ctx = rank_context(__name__)
    rank = ctx.Process(target=_report_the_servers_module)
    rank.start()
    rank.join(timeout=120)
    assert rank.exitcode == 3
    from attnres_pp.launch import fork_server_exit

    assert fork_server_exit.REGISTERED is False  # imported here, in pytest's process: no quick exit


def test_the_quick_exit_flushes_and_ends_at_once(monkeypatch):
    from attnres_pp.launch import fork_server_exit

    ended = []
    monkeypatch.setattr(fork_server_exit.os, "_exit", ended.append)
    fork_server_exit._quit_at_once()
    assert ended == [0]
