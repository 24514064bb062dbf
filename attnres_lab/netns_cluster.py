"""A Ray cluster of several "hosts" on one machine: one Linux network namespace per host, all on one
bridge, each running a Ray node, with links that `tc` shapes and that can be cut.

    python -m attnres_lab.netns_cluster COMMAND, COMMAND one of:
    up --hosts N [--cpus-per-host C] [--gbps X] [--latency-ms Y]
    shape HOST --gbps X [--latency-ms Y]     unshape HOST
    partition HOST                           heal HOST
    kill HOST                                restart HOST
    exec HOST -- CMD...                      down   (safe to run twice)

`up` prints `{"head": "IP:6379", "dashboard": "http://IP:8265", "hosts": [{"name", "ip"}, ...],
"auth_token_path": ...}`, host 0 (the Ray head) first; `name` is the namespace, for `ip netns exec`
and for HOST (which also takes the host's index or IP). Addresses come from one private /24 (default
10.213.0.0/24) used only inside these namespaces; the bridge holds `.1` in the root namespace, so the
machine reaches every host as a workstation reaches a cluster (`ray job submit --address
http://IP:8265`, with RAY_AUTH_MODE=token and RAY_AUTH_TOKEN_PATH set to the printed path).

Each host's Ray node (and every `exec`) has its own host name, the namespace's (a UTS namespace,
where util-linux's `unshare` exists), its own `--temp-dir`, `--node-ip-address` and `--num-cpus`,
token authentication on, and runs from the Python environment of this harness. Every host resolves
every host's name to its address and has no name server (`/etc/netns/NAME/hosts` and `resolv.conf`,
which `ip netns exec` shows as /etc/hosts and /etc/resolv.conf): the machine's own resolver is out of
reach from a namespace, so each lookup would wait out its timeout (10 s), and Ray's start-up makes
several (the head took ~33 s to answer, each worker ~16 s). Ray's node-death detection
is lowered (health checks every 1 s, dead after 3 misses) so that a lost host is noticed in seconds.
Ports are per namespace, so Ray's defaults never collide with another Ray instance of the machine.

A link is the veth pair from the host to the bridge. `shape` puts a token bucket (tc tbf) on both
ends, so traffic in each direction is limited to X Gb/s, and a netem delay of Y ms on each direction;
a kernel without sch_netem refuses Y > 0 (one `error:` line saying so; `up` reports
`"latency_shaping": false`) and shapes bandwidth only. `partition`
detaches the host's link from the bridge: every packet to or from it is dropped, nothing is reset
(as a cut cable); `heal` attaches it again. `kill` SIGKILLs every process in the namespace (a host
that loses power); `restart` brings a killed or cut-off worker host back as a repaired machine
rejoins (its link attached again, whatever is left in it ended, a fresh Ray node at the same
address), so that one cluster can serve several disruptive runs in turn. `down` ends every process
started in the namespaces, then deletes the namespaces, the links and the bridge.

State (names, pids, addresses, the auth token, the nodes' logs and Ray temp dirs) lives in one
directory, so that `down` works from any process: /run/attnres-netns/PREFIX by default (PREFIX is
`--prefix`, arp; the top-level `--prefix` picks the cluster for the other commands), or
`--state-dir` (ATTNRES_NETNS_STATE overrides the default). The harness runs as root and the Ray
cluster runs jobs as root, so nothing in that directory is taken from anyone else:
- the directory (and /run/attnres-netns) is made 0700 by the harness; before any use it is checked
  by lstat: a directory, not a symlink, owned by this euid, no group or other access. Every
  directory above it must be owned by root (or this euid) and not writable by group or others
  unless sticky (/tmp is fine). Anything else is refused with one `error:` line.
- every file the harness makes in it (auth_token, state.json's temp file, logs) is created with
  O_CREAT|O_EXCL|O_NOFOLLOW, mode 0600; state.json is replaced by os.replace and read with
  O_NOFOLLOW.
- what state.json names is checked before anything is signalled or deleted: the prefix, namespace
  (PREFIX-hI), link (PREFIXvI) and bridge (PREFIXbr) names must be exactly the ones `up` makes, and
  its paths the directory's own; a pid is signalled only if it is above 1 and its /proc cmdline is
  the harness's `ray start` of that host (its --temp-dir in this directory) and, while the
  namespace exists, it runs in that namespace; `kill` and `down` signal only processes whose
  network namespace is the host's (never the root namespace's).
Bad input is one `error:` line and exit 2.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

STATE_ROOT = "/run/attnres-netns"  # default state: STATE_ROOT/<prefix>
NETNS_DIR = "/run/netns"  # where `ip netns` keeps its namespaces
DEFAULT_PREFIX = "arp"
DEFAULT_NET = "10.213.0.0/24"
HEAD_PORT, DASHBOARD_PORT = 6379, 8265
OBJECT_STORE_BYTES = 100 * 1024**2  # Ray's default takes 30 % of RAM per node: far too much for several
# Ray reads these at start-up in every process: node death in ~3 s instead of ~30 s.
RAY_HEALTH = {"RAY_health_check_initial_delay_ms": "1000", "RAY_health_check_period_ms": "1000",
              "RAY_health_check_timeout_ms": "1000", "RAY_health_check_failure_threshold": "3"}
UP_TIMEOUT_S = 120.0
NETNS_ETC = Path("/etc/netns")  # `ip netns exec NAME` bind-mounts /etc/netns/NAME/FILE over /etc/FILE
NAME_FILES = ("hosts", "resolv.conf")
BURST_BYTES = 16 * 1024  # tbf's bucket at low rates


class HarnessError(Exception):
    """Bad input or a state the command cannot act on: printed as one `error:` line, exit 2."""


def sh(*cmd: str, check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise HarnessError(f"`{' '.join(cmd)}` failed: {(done.stderr or done.stdout).strip()}")
    return done


def _private_problem(st: os.stat_result) -> str | None:
    """Why a directory, as lstat saw it, is not one only this euid can reach; None if it is."""
    if stat.S_ISLNK(st.st_mode):
        return "is a symlink"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if st.st_uid != os.geteuid():
        return f"is owned by uid {st.st_uid}, not {os.geteuid()}"
    if st.st_mode & 0o077:
        return f"has mode {stat.S_IMODE(st.st_mode):04o}: group or others can reach it (want 0700)"
    return None


def _check_ancestors(directory: Path) -> None:
    """Every directory from / down to `directory` (a resolved path): a real directory, owned by root
    or this euid, not writable by group or others unless sticky (as /tmp): no one else can swap a
    component."""
    for path in [*reversed(directory.parents), directory]:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            raise HarnessError(f"{path} does not exist: make it first (or use the default state dir)") from None
        why = ("is a symlink" if stat.S_ISLNK(st.st_mode) else "is not a directory" if not stat.S_ISDIR(st.st_mode)
               else f"is owned by uid {st.st_uid}" if st.st_uid not in (0, os.geteuid())
               else f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o}) and not sticky"
               if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX else None)
        if why:
            raise HarnessError(f"state dir {directory}: {path} {why}: refusing it")


def create_private(path: Path, text: str | None = None) -> int:
    """A new file, 0600, never through a symlink nor over anything already there. With `text`:
    written and closed (returns -1); without: its open fd, for the caller to close."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        raise HarnessError(f"{path} exists already (left over, or planted): refusing to write through it; "
                           "run `down`, or remove it after looking") from None
    if text is not None:
        with os.fdopen(fd, "w") as file:
            file.write(text)
        return -1
    return fd


def read_private(path: Path) -> str:
    """A file of the state dir, never through a symlink."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as error:
        if isinstance(error, FileNotFoundError):
            raise
        raise HarnessError(f"{path}: {os.strerror(error.errno)} (a symlink?): refusing to read it") from None
    with os.fdopen(fd) as file:
        return file.read()


class State:
    """The state dir: checked before every use (see the module's doc), made by `up` only.
    `private_parent`: the parent is the harness's own (STATE_ROOT), made 0700 and held to the same
    checks as the dir."""

    def __init__(self, directory: str, private_parent: bool = False, prefix: str | None = None) -> None:
        path = Path(os.path.abspath(directory))
        if path.name in ("", ".", ".."):
            raise HarnessError(f"--state-dir {directory!r} must name a directory")
        # A symlink above it (as /var/run) is resolved once, so that it cannot be moved later; the
        # harness's own parent (STATE_ROOT) is not resolved: it, too, is checked by lstat.
        above = path.parent.parent if private_parent else path.parent
        self.dir = Path(os.path.realpath(above)) / path.relative_to(above)
        self.file = self.dir / "state.json"
        self.private_parent = private_parent
        self.prefix = prefix  # the cluster's prefix when the command line says it, else None

    def check(self, create: bool = False) -> bool:
        """True if the dir exists and passes; False if it does not exist (made first when `create`);
        HarnessError if it, or a directory above it, fails."""
        parent = self.dir.parent
        if self.private_parent:
            _check_ancestors(parent.parent)
            if create:
                try:
                    os.mkdir(parent, 0o700)
                except FileExistsError:
                    pass
            try:
                why = _private_problem(os.lstat(parent))
            except FileNotFoundError:
                return False
            if why:
                raise HarnessError(f"{parent} {why}: refusing it (remove it, or give --state-dir)")
        else:
            _check_ancestors(parent)
        if create:
            try:
                os.mkdir(self.dir, 0o700)
            except FileExistsError:
                pass
        try:
            st = os.lstat(self.dir)
        except FileNotFoundError:
            return False
        why = _private_problem(st)
        if why:
            raise HarnessError(f"state dir {self.dir} {why}: refusing it (remove it, or give another --state-dir)")
        return True

    def load(self) -> dict | None:
        if not self.check():
            return None
        try:
            text = read_private(self.file)
        except FileNotFoundError:
            return None
        try:
            state = json.loads(text)
        except ValueError as error:
            raise HarnessError(f"{self.file} is not JSON ({error}): remove it after looking") from None
        check_state(state, self)
        return state

    def save(self, state: dict) -> None:
        if not self.check():
            raise HarnessError(f"state dir {self.dir} is gone")
        tmp = self.dir / f"state.json.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        create_private(tmp, json.dumps(state, indent=2))
        os.replace(tmp, self.file)

    def require(self) -> dict:
        state = self.load()
        if state is None:
            raise HarnessError(f"no cluster in {self.dir}: run `up` first (or give its --prefix or --state-dir)")
        return state


def check_state(state: dict, store: State) -> None:
    """What state.json names must be exactly what `up` makes for its prefix, in this dir: else
    nothing is acted on (a planted or damaged file could name eth0, or any path)."""
    bad = []
    prefix = state.get("prefix") if isinstance(state, dict) else None
    if not isinstance(prefix, str) or not valid_prefix(prefix):
        raise HarnessError(f"{store.file}: prefix {prefix!r} is not one `up` takes: refusing to act on it")
    if store.prefix is not None and prefix != store.prefix:
        bad.append(f"prefix {prefix!r} (this cluster's is {store.prefix!r})")
    if state.get("dir") != str(store.dir):
        bad.append(f"dir {state.get('dir')!r}")
    if state.get("auth_token_path") != str(store.dir / "auth_token"):
        bad.append(f"auth_token_path {state.get('auth_token_path')!r}")
    if state.get("bridge") != f"{prefix}br":
        bad.append(f"bridge {state.get('bridge')!r}")
    hosts = state.get("hosts")
    if not isinstance(hosts, list) or not 1 <= len(hosts) <= 50:
        bad.append("hosts (not a list of 1-50)")
        hosts = []
    for index, host in enumerate(hosts):
        if not isinstance(host, dict):
            bad.append(f"host {index}")
            continue
        for key, want in (("name", host_name(prefix, index)), ("veth", veth_name(prefix, index))):
            if host.get(key) != want:
                bad.append(f"host {index}'s {key} {host.get(key)!r}")
        pid = host.get("pid")
        if pid is not None and (type(pid) is not int or pid <= 1):
            bad.append(f"host {index}'s pid {pid!r}")
        try:
            ipaddress.ip_address(host.get("ip"))
        except ValueError:
            bad.append(f"host {index}'s ip {host.get('ip')!r}")
    if bad:
        raise HarnessError(f"{store.file} names what this harness does not make ({', '.join(bad)}): refusing to "
                           f"act on it; look, then remove {store.dir} and what it made by hand")


def valid_prefix(prefix: str) -> bool:
    return prefix.isascii() and prefix.isalnum() and 1 <= len(prefix) <= 8


def host_name(prefix: str, index: int) -> str:
    return f"{prefix}-h{index}"


def veth_name(prefix: str, index: int) -> str:
    return f"{prefix}v{index}"


def _netns_id(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def named_netns_id(name: str) -> tuple[int, int] | None:
    """The network namespace `ip netns` calls `name`; None if there is none, or if it is the
    namespace of pid 1 or of this process (which `kill` must never empty)."""
    ns = _netns_id(f"{NETNS_DIR}/{name}")
    if ns is None or ns in (_netns_id("/proc/1/ns/net"), _netns_id("/proc/self/ns/net")):
        return None
    return ns


def node_pid_problem(state: dict, index: int, pid: int) -> str | None:
    """Why `pid` is not host `index`'s `ray start` as `start_node` made it (None if it is): above 1,
    not this process, its cmdline that node's (its --temp-dir in this state dir) and, while the
    namespace exists, in that namespace. A reused pid, or a planted one, is not signalled."""
    if type(pid) is not int or pid <= 1 or pid == os.getpid():
        return f"pid {pid!r} is not one the harness starts"
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as file:
            argv = file.read().decode(errors="replace").split("\0")
    except OSError:
        return f"pid {pid} is not running"
    if f"--temp-dir={Path(state['dir']) / f'ray{index}'}" not in argv:
        return f"pid {pid} is not host {index}'s Ray node (its cmdline is {' '.join(argv)[:120]!r})"
    ns = _netns_id(f"{NETNS_DIR}/{state['hosts'][index]['name']}")
    if ns is not None and _netns_id(f"/proc/{pid}/ns/net") != ns:
        return f"pid {pid} does not run in namespace {state['hosts'][index]['name']}"
    return None


def netem_missing() -> str | None:
    """None if this kernel has sch_netem (delay), else why not, as tc says it. Some VM kernels ship
    tbf and htb only (CONFIG_NET_SCH_NETEM unset and no modules to load). Tried on the loopback of a
    scratch namespace: the harness needs namespaces anyway, and such kernels may lack dummy links."""
    name = f"attnprobe{secrets.token_hex(2)}"
    made = sh("ip", "netns", "add", name, check=False)
    if made.returncode != 0:
        return f"no scratch namespace to try it in: {(made.stderr or made.stdout).strip()}"
    try:
        tried = sh("ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms",
                   check=False)
        return None if tried.returncode == 0 else (tried.stderr or tried.stdout).strip() or "tc failed"
    finally:
        sh("ip", "netns", "del", name, check=False)


def refuse_latency(latency_ms: float, why: str) -> None:
    """A delay this kernel cannot add is refused, never shaped without it."""
    raise HarnessError(f"--latency-ms {latency_ms:g} needs sch_netem, which this kernel lacks (`tc qdisc add ... "
                       f"netem delay 1ms` says: {why}; tbf and htb, the shapers such kernels keep, add no delay): "
                       "shape the bandwidth alone (--latency-ms 0), or emulate the latency in the ranks "
                       "(attnres-pp train --link-latency-us)")


def find_host(state: dict, key: str) -> dict:
    for index, host in enumerate(state["hosts"]):
        if key in (host["name"], host["ip"], str(index)):
            return host
    names = ", ".join(h["name"] for h in state["hosts"])
    raise HarnessError(f"host {key!r} is not in this cluster: give one of {names} (or its index or IP)")


def ray_env(state: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(RAY_HEALTH, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=state["auth_token_path"],
               RAY_DEDUP_LOGS="0", RAY_USAGE_STATS_ENABLED="0")
    return env


def start_node(state: dict, index: int) -> int:
    """`ray start --block` in host `index`'s namespace (head for 0); returns its pid."""
    host = state["hosts"][index]
    temp_dir = Path(state["dir"]) / f"ray{index}"  # short: Ray's socket paths live under it
    try:
        os.mkdir(temp_dir, 0o700)
    except FileExistsError:  # a restart: the node's earlier one
        pass
    if not stat.S_ISDIR(os.lstat(temp_dir).st_mode):
        raise HarnessError(f"{temp_dir} is not a directory (a symlink?): refusing it")
    role = (["--head", f"--port={HEAD_PORT}", "--dashboard-host=0.0.0.0", f"--dashboard-port={DASHBOARD_PORT}"]
            if index == 0 else [f"--address={state['hosts'][0]['ip']}:{HEAD_PORT}"])
    cmd = ["ip", "netns", "exec", host["name"], *own_host_name(host), sys.executable, "-m", "ray.scripts.scripts",
           "start", "--block",
           *role, f"--node-ip-address={host['ip']}", f"--num-cpus={state['cpus_per_host']}", "--num-gpus=0",
           f"--object-store-memory={OBJECT_STORE_BYTES}", f"--temp-dir={temp_dir}", "--disable-usage-stats"]
    log = open_log(Path(state["dir"]), host["name"])
    try:
        proc = subprocess.Popen(cmd, env=ray_env(state), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    finally:
        os.close(log)  # the child has its own
    return proc.pid


def open_log(directory: Path, name: str) -> int:
    """A fresh `name`.log in the state dir (an earlier one, of a restarted node, renamed to
    .log.old: a rename moves a symlink itself, never what it points at); returns its fd."""
    log = directory / f"{name}.log"
    try:
        os.replace(log, directory / f"{name}.log.old")
    except FileNotFoundError:
        pass
    return create_private(log)


def own_host_name(host: dict) -> list[str]:
    """The command prefix that gives what follows its own host name, the namespace's, as a host of a
    real cluster has (a namespace alone shares the machine's): `unshare --uts`, then `hostname`.
    Without util-linux's unshare the hosts share the machine's name (the harness works either way)."""
    if shutil.which("unshare") is None:
        return []
    return ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', host["name"]]


def _check_nodes_alive(state: dict) -> None:
    for index, host in enumerate(state["hosts"]):
        if host["pid"] and not _alive(host["pid"]):
            log = Path(state["dir"]) / f"{host['name']}.log"
            raise HarnessError(f"the Ray node of host {index} exited during start-up:\n{read_private(log)[-2000:]}")


def wait_for_head_port(state: dict, deadline: float) -> None:
    """Until the head's GCS port takes a TCP connection (the bridge reaches it from here). Asking
    Ray before that costs ~30 s: `ray.init` backs off between its connection attempts."""
    address = (state["hosts"][0]["ip"], HEAD_PORT)
    while time.monotonic() < deadline:
        _check_nodes_alive(state)
        try:
            with socket.create_connection(address, timeout=1.0):
                return
        except OSError:
            time.sleep(0.1)
    raise HarnessError(f"the head's port {address[0]}:{address[1]} did not open within {UP_TIMEOUT_S:.0f} s")


# One process asks the head until it reports the nodes (an import of ray and a connection cost ~2 s
# on two cores: once, not once a poll).
NODES_PROBE = """
import ray, sys, time
ray.init(address='auto', logging_level='ERROR')
want, deadline, alive = int(sys.argv[1]), time.monotonic() + float(sys.argv[2]), 0
while time.monotonic() < deadline:
    alive = sum(1 for n in ray.nodes() if n['Alive'])
    if alive >= want:
        break
    time.sleep(0.2)
print(alive)
"""


def wait_for_nodes(state: dict, n_nodes: int, timeout_s: float) -> None:
    """Until the head reports `n_nodes` alive nodes (asked from the head's namespace)."""
    deadline = time.monotonic() + timeout_s
    wait_for_head_port(state, deadline)
    env = ray_env(state) | {"RAY_ADDRESS": f"{state['hosts'][0]['ip']}:{HEAD_PORT}"}
    last = ""
    while time.monotonic() < deadline:
        left = deadline - time.monotonic()
        probe = subprocess.Popen(["ip", "netns", "exec", state["hosts"][0]["name"], sys.executable, "-c",
                                  NODES_PROBE, str(n_nodes), f"{left:.1f}"], env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.DEVNULL, text=True)
        try:
            while probe.poll() is None:
                if time.monotonic() > deadline + 30:
                    break
                _check_nodes_alive(state)
                time.sleep(0.2)
        finally:
            if probe.poll() is None:
                probe.kill()
            out = probe.communicate()[0]
        last = (out.strip().splitlines() or [""])[-1]
        if probe.returncode == 0 and last.isdigit() and int(last) >= n_nodes:
            return
        time.sleep(1.0)
    raise HarnessError(f"the cluster did not show {n_nodes} nodes within {timeout_s:.0f} s (last count: {last!r})")


def _etc_dir(name: str, create: bool) -> Path | None:
    """/etc/netns/NAME, checked by lstat (a directory, not a symlink, owned by root); None if absent."""
    directory = NETNS_ETC / name
    for path in (NETNS_ETC, directory):
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            if not create:
                return None
            os.mkdir(path, 0o755)
            st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o022:
            raise HarnessError(f"{path} is not a root-owned directory that only root can write: refusing it")
    return directory


def write_name_files(state: dict, host: dict) -> None:
    """The host's hosts file (localhost and every host of the cluster) and an empty resolver list."""
    directory = _etc_dir(host["name"], create=True)
    lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost",
             *(f"{h['ip']} {h['name']}" for h in state["hosts"])]
    texts = {"hosts": "\n".join(lines) + "\n",
             "resolv.conf": "# no name server: every host of this cluster is in /etc/hosts\n"}
    for file_name in NAME_FILES:
        path = directory / file_name
        try:  # a file left by a `down` that never ran: replaced, never followed
            os.unlink(path)
        except FileNotFoundError:
            pass
        create_private(path, texts[file_name])
        os.chmod(path, 0o644)  # Ray's processes read them as any process does


def remove_name_files(name: str) -> None:
    directory = _etc_dir(name, create=False)
    if directory is None:
        return
    for file_name in NAME_FILES:
        try:
            os.unlink(directory / file_name)
        except FileNotFoundError:
            pass
    try:
        os.rmdir(directory)
    except OSError as error:
        print(f"warning: {directory} is not empty ({error.strerror}): left as it is", file=sys.stderr)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"


def cmd_up(args, store: State) -> dict:
    if store.load() is not None:
        raise HarnessError(f"a cluster is already up in {store.dir}: run `down` first")
    if not 1 <= args.hosts <= 50:
        raise HarnessError(f"--hosts {args.hosts} is out of range: give 1 to 50")
    if args.cpus_per_host < 1:
        raise HarnessError(f"--cpus-per-host {args.cpus_per_host} must be at least 1")
    net = ipaddress.ip_network(args.net)
    if not net.is_private or net.prefixlen > 26:
        raise HarnessError(f"--net {args.net} must be a private range of at least 64 addresses, e.g. {DEFAULT_NET}")
    mine = sh("ip", "-o", "addr").stdout
    if any(ipaddress.ip_interface(w).network.overlaps(net) for line in mine.splitlines()
           for w in line.split() if "/" in w and w[0].isdigit() and ":" not in w):
        raise HarnessError(f"--net {net} overlaps an address of this machine: choose another private range")
    if args.latency_ms < 0:
        raise HarnessError(f"--latency-ms {args.latency_ms} must be 0 or more")
    if args.latency_ms > 0 and args.gbps is None:
        raise HarnessError(f"--latency-ms {args.latency_ms:g} needs --gbps: `up` shapes a link in both at once")
    missing = netem_missing()
    if args.latency_ms > 0 and missing:
        refuse_latency(args.latency_ms, missing)
    prefix = args.prefix
    hosts_ip = list(net.hosts())
    store.check(create=True)
    token_path = store.dir / "auth_token"
    create_private(token_path, secrets.token_hex(32))
    state = {"dir": str(store.dir), "prefix": prefix, "net": str(net), "bridge": f"{prefix}br",
             "bridge_ip": str(hosts_ip[0]), "cpus_per_host": args.cpus_per_host,
             "auth_token_path": str(token_path), "netem": missing is None, "netem_missing": missing, "hosts": []}
    state["hosts"] = [{"name": host_name(prefix, i), "ip": str(hosts_ip[9 + i]), "veth": veth_name(prefix, i),
                       "pid": None, "shape": None, "partitioned": False} for i in range(args.hosts)]
    store.save(state)  # first: `down` can clean up whatever part of this gets made
    try:
        bridge = state["bridge"]
        sh("ip", "link", "add", bridge, "type", "bridge")
        sh("ip", "addr", "add", f"{state['bridge_ip']}/{net.prefixlen}", "dev", bridge)
        sh("ip", "link", "set", bridge, "up")
        for host in state["hosts"]:
            name, veth = host["name"], host["veth"]
            sh("ip", "netns", "add", name)
            write_name_files(state, host)
            sh("ip", "link", "add", veth, "type", "veth", "peer", "name", f"{veth}p")
            sh("ip", "link", "set", f"{veth}p", "netns", name)
            sh("ip", "link", "set", veth, "master", bridge)
            sh("ip", "link", "set", veth, "up")
            inside = ("ip", "netns", "exec", name)
            sh(*inside, "ip", "link", "set", f"{veth}p", "name", "eth0")
            sh(*inside, "ip", "addr", "add", f"{host['ip']}/{net.prefixlen}", "dev", "eth0")
            sh(*inside, "ip", "link", "set", "eth0", "up")
            sh(*inside, "ip", "link", "set", "lo", "up")
            sh(*inside, "ip", "route", "add", "default", "via", state["bridge_ip"])
        if args.gbps is not None:
            for host in state["hosts"]:
                apply_shape(state, host, args.gbps, args.latency_ms)
        for index, host in enumerate(state["hosts"]):
            host["pid"] = start_node(state, index)
            store.save(state)
            if index == 0:  # workers join a head that listens (a port check: no Ray client to start)
                wait_for_head_port(state, time.monotonic() + UP_TIMEOUT_S)
        wait_for_nodes(state, len(state["hosts"]), UP_TIMEOUT_S)
    except BaseException:
        cmd_down(args, store)
        raise
    return describe(state)


def describe(state: dict) -> dict:
    head = state["hosts"][0]["ip"]
    return {"head": f"{head}:{HEAD_PORT}", "dashboard": f"http://{head}:{DASHBOARD_PORT}",
            "hosts": [{"name": h["name"], "ip": h["ip"]} for h in state["hosts"]],
            "auth_token_path": state["auth_token_path"], "latency_shaping": state["netem"]}


def apply_shape(state: dict, host: dict, gbps: float, latency_ms: float) -> None:
    """tbf (and a netem delay, which a kernel without sch_netem refuses) on both ends of the host's link."""
    if not gbps > 0:
        raise HarnessError(f"--gbps {gbps} must be positive")
    if latency_ms < 0:
        raise HarnessError(f"--latency-ms {latency_ms} must be 0 or more")
    if latency_ms > 0 and not state["netem"]:  # before any qdisc changes: the link keeps its shaping
        refuse_latency(latency_ms, state.get("netem_missing") or "Specified qdisc kind is unknown")
    rate_bit = int(gbps * 1e9)
    # A small bucket, so that a message's bytes are paced rather than let through at line rate
    # (tbf splits GSO segments larger than the bucket), yet ~0.2 ms of traffic at high rates.
    burst = max(BURST_BYTES, rate_bit // 8 // 5000)
    for inside, dev in (((), host["veth"]), (("ip", "netns", "exec", host["name"]), "eth0")):
        sh(*inside, "tc", "qdisc", "del", "dev", dev, "root", check=False)
        if latency_ms > 0 and state["netem"]:
            sh(*inside, "tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem", "delay",
               f"{latency_ms}ms", "limit", "100000")
            sh(*inside, "tc", "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", "tbf", "rate",
               str(rate_bit), "burst", str(burst), "latency", "200ms")
        else:
            sh(*inside, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", str(rate_bit), "burst", str(burst),
               "latency", "200ms")
    host["shape"] = {"gbps": gbps, "latency_ms": latency_ms}


def cmd_shape(args, store: State) -> dict:
    state = store.require()
    host = find_host(state, args.host)
    apply_shape(state, host, args.gbps, args.latency_ms)
    store.save(state)
    return {"host": host["name"], "shape": host["shape"]}


def cmd_unshape(args, store: State) -> dict:
    state = store.require()
    host = find_host(state, args.host)
    sh("tc", "qdisc", "del", "dev", host["veth"], "root", check=False)
    sh("ip", "netns", "exec", host["name"], "tc", "qdisc", "del", "dev", "eth0", "root", check=False)
    host["shape"] = None
    store.save(state)
    return {"host": host["name"], "shape": None}


def cmd_partition(args, store: State) -> dict:
    state = store.require()
    host = find_host(state, args.host)
    sh("ip", "link", "set", host["veth"], "nomaster")
    host["partitioned"] = True
    store.save(state)
    return {"host": host["name"], "partitioned": True}


def cmd_heal(args, store: State) -> dict:
    state = store.require()
    host = find_host(state, args.host)
    sh("ip", "link", "set", host["veth"], "master", state["bridge"])
    sh("ip", "link", "set", host["veth"], "up")
    host["partitioned"] = False
    store.save(state)
    return {"host": host["name"], "partitioned": False}


def namespace_pids(name: str) -> list[int]:
    done = sh("ip", "netns", "pids", name, check=False)
    return [int(p) for p in done.stdout.split() if p.isdigit()]


def kill_namespace(name: str) -> int:
    """SIGKILL every process in namespace `name` until none is left; returns how many were killed.
    Only a process whose network namespace is that one is signalled (checked per pid, so a pid
    reused meanwhile is left alone); a namespace that is pid 1's or this process's is refused."""
    killed = 0
    ns = named_netns_id(name)
    if ns is None:
        if _netns_id(f"{NETNS_DIR}/{name}") is not None:
            print(f"warning: namespace {name} is the machine's own: no process of it is signalled", file=sys.stderr)
        return 0
    for _ in range(50):
        pids = [pid for pid in namespace_pids(name)
                if pid > 1 and pid != os.getpid() and _netns_id(f"/proc/{pid}/ns/net") == ns]
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
        time.sleep(0.1)
    return killed


def cmd_kill(args, store: State) -> dict:
    state = store.require()
    host = find_host(state, args.host)
    return {"host": host["name"], "killed_processes": kill_namespace(host["name"])}


def cmd_restart(args, store: State) -> dict:
    """A fresh Ray node in a worker host (a new node id, the same address), once Ray has given up
    the old one: the caller waits for that (a run that recovered from the loss has). The head is
    refused: its loss ends the cluster."""
    state = store.require()
    host = find_host(state, args.host)
    index = state["hosts"].index(host)
    if index == 0:
        raise HarnessError(f"host {host['name']} is the head: a cluster cannot outlive it; run `down` and `up`")
    if host["partitioned"]:
        sh("ip", "link", "set", host["veth"], "master", state["bridge"])
        sh("ip", "link", "set", host["veth"], "up")
        host["partitioned"] = False
    kill_namespace(host["name"])
    if host.get("pid"):
        try:  # reap the old node if this process started it
            os.waitpid(host["pid"], os.WNOHANG)
        except ChildProcessError:
            pass
    host["pid"] = start_node(state, index)
    store.save(state)
    wait_for_nodes(state, len(state["hosts"]), UP_TIMEOUT_S)
    return {"host": host["name"], "restarted": True}


def cmd_exec(args, store: State) -> int:
    state = store.require()
    host = find_host(state, args.host)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise HarnessError("exec needs a command after --")
    env = ray_env(state) | {"RAY_ADDRESS": f"{state['hosts'][0]['ip']}:{HEAD_PORT}"}
    return subprocess.run(["ip", "netns", "exec", host["name"], *own_host_name(host), *command], env=env).returncode


def delete_link(name: str, kind: str) -> None:
    """Delete link `name` only if it is of the `kind` the harness makes there (a veth, the bridge):
    a name read back from state could be an interface the machine needs that happens to fit the
    harness's pattern (someone else's `tqv0`, a renamed uplink). Gone already is nothing to do."""
    shown = sh("ip", "-j", "-d", "link", "show", "dev", name, check=False)
    if shown.returncode != 0:
        return
    try:
        found = (json.loads(shown.stdout)[0].get("linkinfo") or {}).get("info_kind", "")
    except (ValueError, IndexError, AttributeError):
        found = "?"
    if found != kind:
        print(f"warning: link {name} is {'a ' + found if found else 'a device of no kind'}, not the {kind} the "
              "harness makes: not deleted", file=sys.stderr)
        return
    sh("ip", "link", "del", name, check=False)


def cmd_down(args, store: State) -> dict:
    """Stop the Ray nodes (SIGTERM lets `ray start --block` stop its node), SIGKILL what is left in
    each namespace, delete namespaces, links and bridge. Nothing to do is not an error."""
    state = store.load()
    if state is None:
        return {"down": True, "removed": []}
    removed = []
    nodes = []  # the pids that are the harness's Ray nodes: the only ones signalled by pid
    for index, host in enumerate(state["hosts"]):
        if not host.get("pid") or not _alive(host["pid"]):  # signal 0 only: exited (or a zombie) is nothing to do
            continue
        if host.get("partitioned"):  # a node cut off cannot stop in order (it waits for the head): killed below
            continue
        why = node_pid_problem(state, index, host["pid"])
        if why is None:
            nodes.append(host["pid"])
        elif "is not running" not in why:
            print(f"warning: host {host['name']}: {why}: not signalled", file=sys.stderr)
    for pid in nodes:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(_alive(pid) for pid in nodes):
        time.sleep(0.2)
    netns = sh("ip", "netns", "list", check=False).stdout.split()
    for host in state["hosts"]:
        if host["name"] in netns:
            kill_namespace(host["name"])
            sh("ip", "netns", "del", host["name"], check=False)
            removed.append(host["name"])
        remove_name_files(host["name"])
        delete_link(host["veth"], "veth")
        if host.get("pid") in nodes:
            try:  # reap it if this process started it
                os.waitpid(host["pid"], os.WNOHANG)
            except ChildProcessError:
                pass
    delete_link(state["bridge"], "bridge")
    shutil.rmtree(store.dir, ignore_errors=True)
    return {"down": True, "removed": removed}


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="python -m attnres_lab.netns_cluster", description=__doc__.split("\n\n")[0])
    top.add_argument("--state-dir", default=os.environ.get("ATTNRES_NETNS_STATE"),
                     help=f"where the cluster's state lives (default {STATE_ROOT}/PREFIX; ATTNRES_NETNS_STATE)")
    top.add_argument("--prefix", default=None, help=f"the cluster, when --state-dir is not given ({DEFAULT_PREFIX})")
    sub = top.add_subparsers(dest="command_name", required=True)
    up = sub.add_parser("up", help="make N hosts, each with a Ray node")
    up.add_argument("--hosts", type=int, required=True)
    up.add_argument("--cpus-per-host", type=int, default=1)
    up.add_argument("--gbps", type=float, default=None, help="shape every host's link to this bandwidth")
    up.add_argument("--latency-ms", type=float, default=0.0)
    up.add_argument("--net", default=DEFAULT_NET, help=f"private range for the hosts ({DEFAULT_NET})")
    up.add_argument("--prefix", dest="up_prefix", default=None,
                    help=f"prefix of namespace and interface names ({DEFAULT_PREFIX})")
    shape = sub.add_parser("shape", help="limit a host's link (both directions)")
    shape.add_argument("host")
    shape.add_argument("--gbps", type=float, required=True)
    shape.add_argument("--latency-ms", type=float, default=0.0)
    for name, what in (("unshape", "remove a host's shaping"), ("partition", "drop all of a host's traffic"),
                       ("heal", "undo partition"), ("kill", "kill every process of a host"),
                       ("restart", "bring a killed or cut-off worker host back with a fresh Ray node")):
        sub.add_parser(name, help=what).add_argument("host")
    run = sub.add_parser("exec", help="run a command in a host's namespace (RAY_ADDRESS and the token set)")
    run.add_argument("host")
    run.add_argument("command", nargs=argparse.REMAINDER)
    sub.add_parser("down", help="remove every namespace, link and process (safe to run twice)")
    return top


COMMANDS = {"up": cmd_up, "shape": cmd_shape, "unshape": cmd_unshape, "partition": cmd_partition,
            "heal": cmd_heal, "kill": cmd_kill, "restart": cmd_restart, "exec": cmd_exec, "down": cmd_down}


def state_store(args) -> State:
    """The state dir the command line names; `args.prefix` set to the cluster's prefix."""
    up_prefix = getattr(args, "up_prefix", None)
    if up_prefix is not None and args.prefix is not None and up_prefix != args.prefix:
        raise HarnessError(f"--prefix {args.prefix!r} and up --prefix {up_prefix!r} differ: give one")
    given = up_prefix if up_prefix is not None else args.prefix
    args.prefix = given if given is not None else DEFAULT_PREFIX
    if not valid_prefix(args.prefix):
        raise HarnessError(f"--prefix {args.prefix!r} must be 1-8 letters or digits (interface names are short)")
    if args.state_dir:
        return State(args.state_dir, prefix=given)
    return State(os.path.join(STATE_ROOT, args.prefix), private_parent=True, prefix=args.prefix)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if os.geteuid() != 0:
        print("error: attnres_lab.netns_cluster needs root (ip netns, tc): run it with sudo", file=sys.stderr)
        return 2
    try:
        store = state_store(args)
        result = COMMANDS[args.command_name](args, store)
    except (HarnessError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if isinstance(result, int):
        return result
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
