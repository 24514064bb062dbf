"""What the several-hosts harness (`attnres_lab.netns_cluster`) does to the machine, host by host:
the commands it runs (`sh`, the one way out: tests replace it), each host's Ray node (started in
its namespace with its own host name, waited for with a bounded wait), the hosts' name files,
the links' shaping (tc tbf, and a netem delay where the kernel has sch_netem), and the checks
before anything is signalled or deleted: a pid is the harness's Ray node of that host, a process
runs in that host's namespace (never the machine's own), a link is of the kind the harness makes.
Standard library only.
"""

from __future__ import annotations

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

from attnres_lab.netns_state import HarnessError, create_private, open_log, read_private

NETNS_DIR = "/run/netns"  # where `ip netns` keeps its namespaces
HEAD_PORT, DASHBOARD_PORT = 6379, 8265
OBJECT_STORE_BYTES = 100 * 1024**2  # Ray's default takes 30 % of RAM per node: far too much for several
# Ray reads these at start-up in every process: node death in ~3 s instead of ~30 s.
RAY_HEALTH = {"RAY_health_check_initial_delay_ms": "1000", "RAY_health_check_period_ms": "1000",
              "RAY_health_check_timeout_ms": "1000", "RAY_health_check_failure_threshold": "3"}
# What every node and process would otherwise spend CPU on without use here: the metrics each
# dashboard agent and worker collects and exports every few seconds (nothing here reads them), and
# a Python worker per CPU started with each node, most of which no actor ever takes (an actor
# starts one when it needs it). Each host's idle Ray node costs ~30% less CPU.
RAY_LEAN = {"RAY_enable_metrics_collection": "0", "RAY_prestart_worker_first_driver": "0",
            "RAY_enable_worker_prestart": "0"}
UP_TIMEOUT_S = 120.0
NETNS_ETC = Path("/etc/netns")  # `ip netns exec NAME` bind-mounts /etc/netns/NAME/FILE over /etc/FILE
NAME_FILES = ("hosts", "resolv.conf")
BURST_BYTES = 16 * 1024  # tbf's bucket at low rates


def sh(*cmd: str, check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise HarnessError(f"`{' '.join(cmd)}` failed: {(done.stderr or done.stdout).strip()}")
    return done


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


def ray_env(state: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(RAY_HEALTH, **RAY_LEAN, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=state["auth_token_path"],
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
    dashboard = (["--dashboard-host=0.0.0.0", f"--dashboard-port={DASHBOARD_PORT}"] if state.get("dashboard", True)
                 else ["--include-dashboard=false"])
    role = (["--head", f"--port={HEAD_PORT}", *dashboard]
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


def own_host_name(host: dict) -> list[str]:
    """The command prefix that gives what follows its own host name, the namespace's, as a host of a
    real cluster has (a namespace alone shares the machine's): `unshare --uts`, then `hostname`.
    Without util-linux's unshare the hosts share the machine's name (the harness works either way)."""
    if shutil.which("unshare") is None:
        return []
    return ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', host["name"]]


def _check_nodes_alive(state: dict) -> None:
    for index, host in enumerate(state["hosts"]):
        if host["pid"] and not alive(host["pid"]):
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


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"


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
