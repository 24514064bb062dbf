"""The several-hosts harness (`python -m attnres_lab.netns_cluster`) runs as root and its Ray cluster
runs jobs as root: its state dir, and
what state.json names, are taken from no one else. Real attacks, in-process: a state dir of another
uid, a symlinked or group-readable one, a world-writable directory above it; a planted state.json
naming pid 1 or eth0; planted symlinks at auth_token, a log, state.json. Every command the harness
would run is recorded instead (`sh`, subprocess, signals), so a check that failed could not touch
the machine, and each test asserts that nothing was acted on."""

from __future__ import annotations

import json
import os
import secrets
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from attnres_lab import netns_state

REPO = Path(__file__).resolve().parents[2]
ROOT = pytest.mark.skipif(os.geteuid() != 0, reason="needs root, as the harness does (its main refuses other "
                                                     "users; os.chown to another uid)")


@pytest.fixture(scope="module")
def harness():
    from attnres_lab import netns_cluster

    return netns_cluster  # its `hosts` is netns_host, what the harness does to the machine


class Recorder:
    """What the harness would have run or signalled; nothing is run, no signal but 0 is sent."""

    def __init__(self, netns: str = "", pids: str = "") -> None:
        self.commands: list[tuple[str, ...]] = []
        self.signals: list[tuple[int, int]] = []
        self.netns, self.pids = netns, pids
        self.links: dict[str, str] = {}  # the machine's links: name -> kind ("" for a plain device)

    def sh(self, *cmd: str, check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess:
        self.commands.append(cmd)
        if cmd[:6] == ("ip", "-j", "-d", "link", "show", "dev"):
            if cmd[6] not in self.links:
                return subprocess.CompletedProcess(cmd, 1, stdout="", stderr=f'Device "{cmd[6]}" does not exist.')
            info = {"ifname": cmd[6], **({"linkinfo": {"info_kind": self.links[cmd[6]]}} if self.links[cmd[6]] else {})}
            return subprocess.CompletedProcess(cmd, 0, stdout=json.dumps([info]), stderr="")
        out = self.netns if cmd[:3] == ("ip", "netns", "list") else self.pids if cmd[:3] == ("ip", "netns",
                                                                                               "pids") else ""
        return subprocess.CompletedProcess(cmd, 0, stdout=out, stderr="")

    def refuse(self, cmd, *args, **kwargs):
        self.commands.append(tuple(cmd))
        raise AssertionError(f"the harness ran {cmd}")

    def kill(self, pid: int, sig: int, _real=os.kill) -> None:
        if sig == 0:
            return _real(pid, 0)
        self.signals.append((pid, sig))
        return None


@pytest.fixture
def recorder(harness, monkeypatch):
    rec = Recorder()
    monkeypatch.setattr(harness.hosts, "sh", rec.sh)  # the one way the harness runs a command
    monkeypatch.setattr(harness.subprocess, "run", rec.refuse)
    monkeypatch.setattr(harness.subprocess, "Popen", rec.refuse)
    monkeypatch.setattr(harness.os, "kill", rec.kill)
    monkeypatch.setattr(harness.time, "sleep", lambda s: None)
    return rec


def private_dir(path: Path) -> Path:
    os.mkdir(path, 0o700)
    return path


def up_state(directory: Path, prefix: str = "tq", hosts: int = 2) -> dict:
    """state.json as `up` writes it for `prefix` in `directory`."""
    return {"dir": str(directory), "prefix": prefix, "net": "10.213.0.0/24", "bridge": f"{prefix}br",
            "bridge_ip": "10.213.0.1", "cpus_per_host": 1, "auth_token_path": str(directory / "auth_token"),
            "netem": True, "netem_missing": None,
            "hosts": [{"name": f"{prefix}-h{i}", "ip": f"10.213.0.{10 + i}", "veth": f"{prefix}v{i}", "pid": None,
                       "shape": None, "partitioned": False} for i in range(hosts)]}


def plant(directory: Path, state: dict) -> None:
    (directory / "state.json").write_text(json.dumps(state))


def one_error(capsys) -> str:
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert captured.out == "" and len(lines) == 1 and lines[0].startswith("error: "), captured
    return lines[0]


@ROOT
def test_a_state_dir_of_another_uid_is_refused(harness, recorder, tmp_path, capsys):
    planted = private_dir(tmp_path / "st")
    plant(planted, up_state(planted))
    os.chown(planted, 65534, 65534)
    for argv in (["down"], ["up", "--hosts", "1", "--prefix", "tq"], ["kill", "0"], ["exec", "0", "--", "true"]):
        assert harness.main(["--state-dir", str(planted), *argv]) == 2
        assert "is owned by uid 65534" in one_error(capsys)
    assert recorder.commands == [] and recorder.signals == []
    assert sorted(os.listdir(planted)) == ["state.json"]  # no auth_token handed to its owner


@ROOT
def test_a_symlinked_or_reachable_state_dir_is_refused(harness, recorder, tmp_path, capsys, monkeypatch):
    real = private_dir(tmp_path / "real")
    plant(real, up_state(tmp_path / "st"))
    (tmp_path / "st").symlink_to(real)
    assert harness.main(["--state-dir", str(tmp_path / "st"), "down"]) == 2
    assert "is a symlink" in one_error(capsys)

    readable = tmp_path / "readable"
    os.mkdir(readable)
    os.chmod(readable, 0o750)
    assert harness.main(["--state-dir", str(readable), "up", "--hosts", "1"]) == 2
    assert "mode 0750" in one_error(capsys)

    open_above = tmp_path / "open"  # anyone may swap what is in it: not sticky
    os.mkdir(open_above)
    os.chmod(open_above, 0o777)
    assert harness.main(["--state-dir", str(open_above / "st"), "up", "--hosts", "1"]) == 2
    assert "writable by group or others" in one_error(capsys)
    assert not (open_above / "st").exists()

    # The default, STATE_ROOT/<prefix>: a symlinked or reachable STATE_ROOT is refused as well.
    monkeypatch.setattr(harness, "STATE_ROOT", str(tmp_path / "run-netns"))
    (tmp_path / "run-netns").symlink_to(real)
    assert harness.main(["--prefix", "tq", "down"]) == 2
    assert "is a symlink" in one_error(capsys)
    (tmp_path / "run-netns").unlink()
    os.mkdir(tmp_path / "run-netns", 0o755)
    os.chmod(tmp_path / "run-netns", 0o755)
    assert harness.main(["up", "--hosts", "1", "--prefix", "tq"]) == 2
    assert "mode 0755" in one_error(capsys)
    assert recorder.commands == [] and recorder.signals == []
    assert sorted(os.listdir(real)) == ["state.json"]


def test_the_harness_makes_its_state_dirs_0700(harness, tmp_path):
    root = tmp_path / "run-netns"
    store = harness.State(str(root / "tq"), private_parent=True, prefix="tq")
    assert store.check() is False and not root.exists()  # only `up` makes them
    assert store.check(create=True) is True
    assert stat.S_IMODE(os.lstat(root).st_mode) == stat.S_IMODE(os.lstat(root / "tq").st_mode) == 0o700
    # An explicit --state-dir in /tmp (root's, sticky), as tests/multihost/test_multihost.py gives: made 0700, accepted.
    in_tmp = Path("/tmp") / f"attnres-sec-{secrets.token_hex(3)}"
    try:
        assert harness.State(str(in_tmp)).check(create=True) is True
        assert stat.S_IMODE(os.lstat(in_tmp).st_mode) == 0o700
    finally:
        os.rmdir(in_tmp)


def _planted(state: dict, change: str) -> None:
    if change == "pid 1":
        state["hosts"][0]["pid"] = 1
    elif change == "namespace eth0":
        state["hosts"][0]["name"] = "eth0"
    elif change == "veth eth0":
        state["hosts"][1]["veth"] = "eth0"
    elif change == "bridge eth0":
        state["bridge"] = "eth0"
    elif change == "namespace without the prefix":
        state["hosts"][1]["name"] = "other-h1"
    elif change == "veth of another index":
        state["hosts"][0]["veth"] = "tqv7"
    elif change == "another prefix":
        state.update(prefix="eth", bridge="ethbr")
        for index, host in enumerate(state["hosts"]):
            host.update(name=f"eth-h{index}", veth=f"ethv{index}")
    elif change == "token elsewhere":
        state["auth_token_path"] = "/etc/shadow"


@ROOT
@pytest.mark.parametrize("change", ["pid 1", "namespace eth0", "veth eth0", "bridge eth0",
                                    "namespace without the prefix", "veth of another index", "token elsewhere"])
def test_a_planted_state_json_is_refused_before_anything_is_done(harness, recorder, tmp_path, capsys, change):
    directory = private_dir(tmp_path / "st")
    state = up_state(directory)
    _planted(state, change)
    plant(directory, state)
    recorder.netns = "tq-h0 tq-h1 eth0 other-h1"
    recorder.pids = "1"
    for argv in (["down"], ["kill", "1"], ["partition", "1"], ["unshape", "1"]):
        assert harness.main(["--state-dir", str(directory), "--prefix", "tq", *argv]) == 2
        assert "refusing to act on it" in one_error(capsys)
    assert recorder.commands == [] and recorder.signals == []
    assert (directory / "state.json").exists()


@ROOT
def test_a_prefix_other_than_the_clusters_is_refused(harness, recorder, tmp_path, capsys):
    directory = private_dir(tmp_path / "st")
    state = up_state(directory)
    _planted(state, "another prefix")
    plant(directory, state)
    assert harness.main(["--state-dir", str(directory), "--prefix", "tq", "down"]) == 2
    assert "prefix 'eth'" in one_error(capsys)
    assert recorder.commands == [] and recorder.signals == []


@ROOT
def test_down_signals_no_pid_that_is_not_its_ray_node(harness, recorder, tmp_path, capsys):
    """Pids that fit the file's form but are not the harness's nodes (this test's parent, this very
    process): skipped with a warning; `ip netns pids` naming pid 1 and this process signals neither;
    only the harness's own names are deleted."""
    directory = private_dir(tmp_path / "st")
    state = up_state(directory)
    state["hosts"][0]["pid"], state["hosts"][1]["pid"] = os.getppid(), os.getpid()
    plant(directory, state)
    recorder.netns = "tq-h0 tq-h1"
    recorder.pids = f"1 {os.getppid()} {os.getpid()}"
    recorder.links = {"tqv0": "veth", "tqv1": "veth", "tqbr": "bridge"}
    assert harness.main(["--state-dir", str(directory), "down"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out) == {"down": True, "removed": ["tq-h0", "tq-h1"]}
    assert f"pid {os.getppid()} is not host 0's Ray node" in captured.err
    assert f"pid {os.getpid()} is not one the harness starts" in captured.err
    assert recorder.signals == []  # no namespace under /run/netns of that name: no pid of it is signalled
    names = {cmd[-1] for cmd in recorder.commands if cmd[:3] in (("ip", "netns", "del"), ("ip", "link", "del"))}
    assert names == {"tq-h0", "tq-h1", "tqv0", "tqv1", "tqbr"}
    assert not directory.exists()


def test_a_namespace_that_is_the_machines_own_is_not_emptied(harness, recorder, tmp_path, monkeypatch, capsys):
    """`ip netns` names a file; one that is the root namespace (pid 1's) must not make `kill` SIGKILL
    every process of the machine."""
    netns = tmp_path / "netns"
    netns.mkdir()
    (netns / "tq-h0").symlink_to("/proc/1/ns/net" if os.access("/proc/1/ns/net", os.R_OK) else "/proc/self/ns/net")
    monkeypatch.setattr(harness.hosts, "NETNS_DIR", str(netns))
    recorder.pids = f"1 {os.getppid()} {os.getpid()}"
    assert harness.hosts.kill_namespace("tq-h0") == 0
    assert recorder.signals == [] and "is the machine's own" in capsys.readouterr().err


def test_a_pid_must_be_the_harness_ray_node_of_that_host(harness, tmp_path):
    state = up_state(tmp_path)
    for pid in (1, 0, -1, os.getpid(), "1"):
        assert harness.hosts.node_pid_problem(state, 0, pid) == f"pid {pid!r} is not one the harness starts"
    assert "is not host 0's Ray node" in harness.hosts.node_pid_problem(state, 0, os.getppid())


@pytest.mark.subprocess
def test_a_pid_whose_cmdline_is_the_hosts_ray_node_passes(harness, tmp_path):
    node = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", f"--temp-dir={tmp_path}/ray1"])
    try:
        while b"--temp-dir" not in Path(f"/proc/{node.pid}/cmdline").read_bytes():  # until it has exec'd
            time.sleep(0.01)
        state = up_state(tmp_path)
        assert harness.hosts.node_pid_problem(state, 1, node.pid) is None
        assert "is not host 0's Ray node" in harness.hosts.node_pid_problem(state, 0, node.pid)  # another host's
    finally:
        node.send_signal(signal.SIGKILL)
        node.wait()


@ROOT
def test_a_planted_auth_token_symlink_is_not_followed(harness, recorder, tmp_path, capsys):
    directory = private_dir(tmp_path / "st")
    target = tmp_path / "target"
    target.write_text("theirs")
    os.chmod(target, 0o644)
    (directory / "auth_token").symlink_to(target)
    assert harness.main(["--state-dir", str(directory), "up", "--hosts", "1", "--prefix", "tq"]) == 2
    assert "auth_token exists already" in one_error(capsys)
    assert target.read_text() == "theirs" and stat.S_IMODE(os.stat(target).st_mode) == 0o644
    assert (directory / "auth_token").is_symlink()
    assert not any(cmd[:3] in (("ip", "link", "add"), ("ip", "addr", "add")) for cmd in recorder.commands)


def test_logs_and_state_files_are_not_written_through_symlinks(harness, tmp_path):
    directory = private_dir(tmp_path / "st")
    target = tmp_path / "target"
    target.write_text("theirs")
    (directory / "tq-h0.log").symlink_to(target)
    os.close(netns_state.open_log(directory, "tq-h0"))  # the earlier log is moved aside, a new one made
    log = os.lstat(directory / "tq-h0.log")
    assert stat.S_ISREG(log.st_mode) and stat.S_IMODE(log.st_mode) == 0o600
    assert (directory / "tq-h0.log.old").is_symlink() and target.read_text() == "theirs"

    (directory / "state.json.1.tmp").symlink_to(target)  # as a planted temp file of state.json would be
    with pytest.raises(harness.HarnessError, match="exists already"):
        harness.create_private(directory / "state.json.1.tmp", "x")
    assert target.read_text() == "theirs"

    store = harness.State(str(directory))
    (directory / "state.json").symlink_to(target)
    with pytest.raises(harness.HarnessError, match="a symlink"):
        store.load()
    store.save(up_state(directory, hosts=1))  # replaces the link itself
    saved = os.lstat(directory / "state.json")
    assert stat.S_ISREG(saved.st_mode) and stat.S_IMODE(saved.st_mode) == 0o600 and target.read_text() == "theirs"
    assert store.load()["hosts"][0]["name"] == "tq-h0"
    assert not [n for n in os.listdir(directory) if n.startswith("state.json.") and n != "state.json.1.tmp"]


@ROOT
def test_down_deletes_no_link_that_is_not_of_the_kind_it_makes(harness, recorder, tmp_path, capsys):
    """Names that fit the harness's pattern but are the machine's own devices (a plain NIC renamed
    tqv0, another bridge where a veth should be, a veth where the bridge should be) are left, with
    a warning each; a link that is gone already is nothing to do."""
    directory = private_dir(tmp_path / "st")
    plant(directory, up_state(directory, hosts=3))
    recorder.links = {"tqv0": "", "tqv1": "bridge", "tqbr": "veth"}  # tqv2: gone
    assert harness.main(["--state-dir", str(directory), "down"]) == 0
    err = capsys.readouterr().err
    assert "link tqv0 is a device of no kind, not the veth the harness makes: not deleted" in err
    assert "link tqv1 is a bridge, not the veth" in err and "link tqbr is a veth, not the bridge" in err
    assert not [cmd for cmd in recorder.commands if cmd[:3] == ("ip", "link", "del")]
