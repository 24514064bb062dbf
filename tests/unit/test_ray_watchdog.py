"""A private Ray instance ends with its driver (`launch.ray_watchdog`): the watchdog holds a pidfd of
every process of the instance and SIGKILLs what is left once the driver has ended, also a process
that its parent's death orphaned (Ray's agents outlived a SIGKILLed driver by 50-140 s, waiting on
the dead GCS); it ends by itself once the instance has ended while the driver lives. Stand-ins for
Ray's processes: a shell (the raylet) with a child (an agent), under a driver process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from attnres_lab.chaos_probe import alive, descendants, wait_until_ended
from tests.run_helpers import REPO

pytestmark = pytest.mark.subprocess

DRIVER = ("import subprocess, sys, time\n"
          "raylet = subprocess.Popen(['sh', '-c', 'sleep 600 & wait'])\n"
          "print(raylet.pid, flush=True)\n"
          "time.sleep(600)\n")


def start(tmp_path):
    """(driver, raylet pid, agent pid, watchdog): the watchdog adopted both by the time this returns."""
    driver = subprocess.Popen([sys.executable, "-c", DRIVER], stdout=subprocess.PIPE, text=True)
    raylet = int(driver.stdout.readline())
    deadline = time.monotonic() + 30
    while not descendants(raylet) and time.monotonic() < deadline:
        time.sleep(0.05)
    [agent] = descendants(raylet)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    watchdog = subprocess.Popen([sys.executable, "-m", "attnres_pp.launch.ray_watchdog", str(driver.pid), str(raylet)],
                                env=env)
    time.sleep(1.5)  # its first scans: the agent is adopted while its parent lives
    return driver, raylet, agent, watchdog


def test_what_is_left_of_the_instance_ends_with_a_killed_driver(tmp_path):
    driver, raylet, agent, watchdog = start(tmp_path)
    try:
        os.kill(raylet, signal.SIGKILL)  # what Ray's parent-death signal does to the raylet
        time.sleep(0.3)
        assert alive(agent)  # orphaned, as Ray's agents are, and still running
        driver.kill()
        driver.wait(timeout=10)
        assert wait_until_ended({agent}, 3)[0] == []
        assert watchdog.wait(timeout=5) == 0
    finally:
        for proc in (driver, watchdog):
            proc.kill()
            proc.wait(timeout=10)
        if alive(agent):
            os.kill(agent, signal.SIGKILL)


def test_the_watchdog_ends_once_the_instance_has_ended(tmp_path):
    driver, raylet, agent, watchdog = start(tmp_path)
    try:
        os.kill(agent, signal.SIGTERM)
        assert wait_until_ended({raylet}, 5)[0] == []  # its `wait` returns: the instance is down
        assert watchdog.wait(timeout=5) == 0
        assert driver.poll() is None  # the driver lives on
    finally:
        for proc in (driver, watchdog):
            proc.kill()
            proc.wait(timeout=10)
