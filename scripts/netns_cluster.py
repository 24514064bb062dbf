#!/usr/bin/env python3
"""A Ray cluster of several "hosts" on one machine: one Linux network namespace per host, all on one
bridge, each running a Ray node, with links that `tc` shapes and that can be cut.

    netns_cluster.py up --hosts N [--cpus-per-host C] [--gbps X] [--latency-ms Y]
    netns_cluster.py shape HOST --gbps X [--latency-ms Y]     netns_cluster.py unshape HOST
    netns_cluster.py partition HOST                           netns_cluster.py heal HOST
    netns_cluster.py kill HOST                                netns_cluster.py restart HOST
    netns_cluster.py exec HOST -- CMD...                      netns_cluster.py down   (safe to run twice)

`up` prints `{"head": "IP:6379", "dashboard": "http://IP:8265", "hosts": [{"name", "ip"}, ...],
"auth_token_path": ...}`, host 0 (the Ray head) first; `name` is the namespace, for `ip netns exec`
and for HOST (which also takes the host's index or IP). Addresses come from one private /24 (default
10.213.0.0/24) used only inside these namespaces; the bridge holds `.1` in the root namespace, so the
machine reaches every host as a workstation reaches a cluster (`ray job submit --address
http://IP:8265`, with RAY_AUTH_MODE=token and RAY_AUTH_TOKEN_PATH set to the printed path).

Each host's Ray node (and every `exec`) has its own host name, the namespace's (a UTS namespace,
where util-linux's `unshare` exists), its own `--temp-dir`, `--node-ip-address` and `--num-cpus`,
token authentication on, and runs from the Python environment of this script. Ray's node-death detection
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
started in the namespaces, then deletes the namespaces, the links and the bridge. State (names,
pids, addresses) lives in `--state-dir` (default /tmp/attnres-netns-cluster; ATTNRES_NETNS_STATE
overrides), so `down` works from any process.
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
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_STATE = os.environ.get("ATTNRES_NETNS_STATE", "/tmp/attnres-netns-cluster")
DEFAULT_NET = "10.213.0.0/24"
HEAD_PORT, DASHBOARD_PORT = 6379, 8265
OBJECT_STORE_BYTES = 100 * 1024**2  # Ray's default takes 30 % of RAM per node: far too much for several
# Ray reads these at start-up in every process: node death in ~3 s instead of ~30 s.
RAY_HEALTH = {"RAY_health_check_initial_delay_ms": "1000", "RAY_health_check_period_ms": "1000",
              "RAY_health_check_timeout_ms": "1000", "RAY_health_check_failure_threshold": "3"}
UP_TIMEOUT_S = 120.0
BURST_BYTES = 16 * 1024  # tbf's bucket at low rates


class HarnessError(Exception):
    """Bad input or a state the command cannot act on: printed as one `error:` line, exit 2."""


def sh(*cmd: str, check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise HarnessError(f"`{' '.join(cmd)}` failed: {(done.stderr or done.stdout).strip()}")
    return done


class State:
    def __init__(self, directory: str) -> None:
        self.dir = Path(directory)
        self.file = self.dir / "state.json"

    def load(self) -> dict | None:
        try:
            return json.loads(self.file.read_text())
        except FileNotFoundError:
            return None

    def save(self, state: dict) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.file.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=2))
        os.replace(tmp, self.file)

    def require(self) -> dict:
        state = self.load()
        if state is None:
            raise HarnessError(f"no cluster in {self.dir}: run `up` first (or give its --state-dir)")
        return state


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
    temp_dir.mkdir(parents=True, exist_ok=True)
    role = (["--head", f"--port={HEAD_PORT}", "--dashboard-host=0.0.0.0", f"--dashboard-port={DASHBOARD_PORT}"]
            if index == 0 else [f"--address={state['hosts'][0]['ip']}:{HEAD_PORT}"])
    cmd = ["ip", "netns", "exec", host["name"], *own_host_name(host), sys.executable, "-m", "ray.scripts.scripts",
           "start", "--block",
           *role, f"--node-ip-address={host['ip']}", f"--num-cpus={state['cpus_per_host']}", "--num-gpus=0",
           f"--object-store-memory={OBJECT_STORE_BYTES}", f"--temp-dir={temp_dir}", "--disable-usage-stats"]
    log = open(Path(state["dir"]) / f"{host['name']}.log", "w")  # noqa: SIM115 (the child keeps it)
    proc = subprocess.Popen(cmd, env=ray_env(state), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return proc.pid


def own_host_name(host: dict) -> list[str]:
    """The command prefix that gives what follows its own host name, the namespace's, as a host of a
    real cluster has (a namespace alone shares the machine's): `unshare --uts`, then `hostname`.
    Without util-linux's unshare the hosts share the machine's name (the harness works either way)."""
    if shutil.which("unshare") is None:
        return []
    return ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', host["name"]]


def wait_for_nodes(state: dict, n_nodes: int, timeout_s: float) -> None:
    """Until the head reports `n_nodes` alive nodes (asked from the head's namespace)."""
    probe = ("import ray,sys; ray.init(address='auto', logging_level='ERROR'); "
             "print(sum(1 for n in ray.nodes() if n['Alive']))")
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        for index, host in enumerate(state["hosts"]):
            if host["pid"] and not _alive(host["pid"]):
                log = Path(state["dir"]) / f"{host['name']}.log"
                raise HarnessError(f"the Ray node of host {index} exited during start-up:\n{log.read_text()[-2000:]}")
        env = ray_env(state) | {"RAY_ADDRESS": f"{state['hosts'][0]['ip']}:{HEAD_PORT}"}
        done = subprocess.run(["ip", "netns", "exec", state["hosts"][0]["name"], sys.executable, "-c", probe],
                              env=env, capture_output=True, text=True, timeout=60)
        last = (done.stdout.strip().splitlines() or [""])[-1]
        if done.returncode == 0 and last.isdigit() and int(last) >= n_nodes:
            return
        time.sleep(1.0)
    raise HarnessError(f"the cluster did not show {n_nodes} nodes within {timeout_s:.0f} s (last count: {last!r})")


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
    if not prefix.isalnum() or len(prefix) > 8:
        raise HarnessError(f"--prefix {prefix!r} must be 1-8 letters or digits (interface names are short)")
    hosts_ip = list(net.hosts())
    store.dir.mkdir(parents=True, exist_ok=True)
    token_path = store.dir / "auth_token"
    token_path.write_text(secrets.token_hex(32))
    token_path.chmod(0o600)
    state = {"dir": str(store.dir), "prefix": prefix, "net": str(net), "bridge": f"{prefix}br",
             "bridge_ip": str(hosts_ip[0]), "cpus_per_host": args.cpus_per_host,
             "auth_token_path": str(token_path), "netem": missing is None, "netem_missing": missing, "hosts": []}
    state["hosts"] = [{"name": f"{prefix}-h{i}", "ip": str(hosts_ip[9 + i]), "veth": f"{prefix}v{i}",
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
            if index == 0:  # workers join a head that listens
                wait_for_nodes(state, 1, UP_TIMEOUT_S)
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
    """SIGKILL every process in namespace `name` until none is left; returns how many were killed."""
    killed = 0
    for _ in range(50):
        pids = namespace_pids(name)
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


def cmd_down(args, store: State) -> dict:
    """Stop the Ray nodes (SIGTERM lets `ray start --block` stop its node), SIGKILL what is left in
    each namespace, delete namespaces, links and bridge. Nothing to do is not an error."""
    state = store.load()
    if state is None:
        return {"down": True, "removed": []}
    removed = []
    for host in state["hosts"]:
        if host.get("pid") and _alive(host["pid"]):
            try:
                os.kill(host["pid"], signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(h.get("pid") and _alive(h["pid"]) for h in state["hosts"]):
        time.sleep(0.2)
    netns = sh("ip", "netns", "list", check=False).stdout.split()
    for host in state["hosts"]:
        if host["name"] in netns:
            kill_namespace(host["name"])
            sh("ip", "netns", "del", host["name"], check=False)
            removed.append(host["name"])
        sh("ip", "link", "del", host["veth"], check=False)
        if host.get("pid"):
            try:  # reap it if this process started it
                os.waitpid(host["pid"], os.WNOHANG)
            except ChildProcessError:
                pass
    sh("ip", "link", "del", state["bridge"], check=False)
    shutil.rmtree(store.dir, ignore_errors=True)
    return {"down": True, "removed": removed}


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    top.add_argument("--state-dir", default=DEFAULT_STATE, help=f"where the cluster's state lives ({DEFAULT_STATE})")
    sub = top.add_subparsers(dest="command_name", required=True)
    up = sub.add_parser("up", help="make N hosts, each with a Ray node")
    up.add_argument("--hosts", type=int, required=True)
    up.add_argument("--cpus-per-host", type=int, default=1)
    up.add_argument("--gbps", type=float, default=None, help="shape every host's link to this bandwidth")
    up.add_argument("--latency-ms", type=float, default=0.0)
    up.add_argument("--net", default=DEFAULT_NET, help=f"private range for the hosts ({DEFAULT_NET})")
    up.add_argument("--prefix", default="arp", help="prefix of namespace and interface names (arp)")
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


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if os.geteuid() != 0:
        print("error: netns_cluster.py needs root (ip netns, tc)", file=sys.stderr)
        return 2
    store = State(args.state_dir)
    try:
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
