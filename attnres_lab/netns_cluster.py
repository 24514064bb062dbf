"""A Ray cluster of several "hosts" on one machine: one Linux network namespace per host, all on one
bridge, each running a Ray node, with links that `tc` shapes and that can be cut.

    python -m attnres_lab.netns_cluster COMMAND, COMMAND one of:
    up --hosts N [--cpus-per-host C] [--gbps X] [--latency-ms Y] [--no-dashboard]
    shape HOST --gbps X [--latency-ms Y]     unshape HOST
    partition HOST                           heal HOST
    kill HOST                                restart HOST [--no-wait]
    exec HOST -- CMD...                      down   (safe to run twice)

`up` prints `{"head": "IP:6379", "dashboard": "http://IP:8265", "hosts": [{"name", "ip"}, ...],
"auth_token_path": ...}`, host 0 (the Ray head) first; `name` is the namespace, for `ip netns exec`
and for HOST (which also takes the host's index or IP). Addresses come from one private /24 (default
10.213.0.0/24) used only inside these namespaces; the bridge holds `.1` in the root namespace, so the
machine reaches every host as a workstation reaches a cluster (`ray job submit --address
http://IP:8265`, with RAY_AUTH_MODE=token and RAY_AUTH_TOKEN_PATH set to the printed path).
`--no-dashboard` starts the head without the dashboard's modules (no `ray job submit`, `"dashboard":
null`), for drivers run in a host (`exec`) that need none: they cost CPU at start and while idle.

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
address), so that one cluster can serve several disruptive runs in turn; it returns once the node has
joined, or with `--no-wait` once it is started (for a caller that waits with a Ray driver it has).
`down` ends every process started in the namespaces, then deletes the namespaces, the links and the
bridge.

Three modules: this one (the commands and their flags), `netns_state` (the state directory and its
files), `netns_host` (what is done to each host: the commands run, Ray nodes, name files, shaping,
the checks before a signal or a deletion).

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
import subprocess
import sys
import time

from attnres_lab import netns_host as hosts
from attnres_lab.netns_state import HarnessError, State, create_private, host_name, valid_prefix, veth_name

STATE_ROOT = "/run/attnres-netns"  # default state: STATE_ROOT/<prefix>
DEFAULT_PREFIX = "arp"
DEFAULT_NET = "10.213.0.0/24"


def find_host(state: dict, key: str) -> dict:
    for index, host in enumerate(state["hosts"]):
        if key in (host["name"], host["ip"], str(index)):
            return host
    names = ", ".join(h["name"] for h in state["hosts"])
    raise HarnessError(f"host {key!r} is not in this cluster: give one of {names} (or its index or IP)")


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
    mine = hosts.sh("ip", "-o", "addr").stdout
    if any(ipaddress.ip_interface(w).network.overlaps(net) for line in mine.splitlines()
           for w in line.split() if "/" in w and w[0].isdigit() and ":" not in w):
        raise HarnessError(f"--net {net} overlaps an address of this machine: choose another private range")
    if args.latency_ms < 0:
        raise HarnessError(f"--latency-ms {args.latency_ms} must be 0 or more")
    if args.latency_ms > 0 and args.gbps is None:
        raise HarnessError(f"--latency-ms {args.latency_ms:g} needs --gbps: `up` shapes a link in both at once")
    missing = hosts.netem_missing()
    if args.latency_ms > 0 and missing:
        hosts.refuse_latency(args.latency_ms, missing)
    prefix = args.prefix
    hosts_ip = list(net.hosts())
    store.check(create=True)
    token_path = store.dir / "auth_token"
    create_private(token_path, secrets.token_hex(32))
    state = {"dir": str(store.dir), "prefix": prefix, "net": str(net), "bridge": f"{prefix}br",
             "bridge_ip": str(hosts_ip[0]), "cpus_per_host": args.cpus_per_host, "dashboard": not args.no_dashboard,
             "auth_token_path": str(token_path), "netem": missing is None, "netem_missing": missing, "hosts": []}
    state["hosts"] = [{"name": host_name(prefix, i), "ip": str(hosts_ip[9 + i]), "veth": veth_name(prefix, i),
                       "pid": None, "shape": None, "partitioned": False} for i in range(args.hosts)]
    store.save(state)  # first: `down` can clean up whatever part of this gets made
    try:
        bridge = state["bridge"]
        hosts.sh("ip", "link", "add", bridge, "type", "bridge")
        hosts.sh("ip", "addr", "add", f"{state['bridge_ip']}/{net.prefixlen}", "dev", bridge)
        hosts.sh("ip", "link", "set", bridge, "up")
        for host in state["hosts"]:
            name, veth = host["name"], host["veth"]
            hosts.sh("ip", "netns", "add", name)
            hosts.write_name_files(state, host)
            hosts.sh("ip", "link", "add", veth, "type", "veth", "peer", "name", f"{veth}p")
            hosts.sh("ip", "link", "set", f"{veth}p", "netns", name)
            hosts.sh("ip", "link", "set", veth, "master", bridge)
            hosts.sh("ip", "link", "set", veth, "up")
            inside = ("ip", "netns", "exec", name)
            hosts.sh(*inside, "ip", "link", "set", f"{veth}p", "name", "eth0")
            hosts.sh(*inside, "ip", "addr", "add", f"{host['ip']}/{net.prefixlen}", "dev", "eth0")
            hosts.sh(*inside, "ip", "link", "set", "eth0", "up")
            hosts.sh(*inside, "ip", "link", "set", "lo", "up")
            hosts.sh(*inside, "ip", "route", "add", "default", "via", state["bridge_ip"])
        if args.gbps is not None:
            for host in state["hosts"]:
                hosts.apply_shape(state, host, args.gbps, args.latency_ms)
        for index, host in enumerate(state["hosts"]):
            host["pid"] = hosts.start_node(state, index)
            store.save(state)
            if index == 0:  # workers join a head that listens (a port check: no Ray client to start)
                hosts.wait_for_head_port(state, time.monotonic() + hosts.UP_TIMEOUT_S)
        hosts.wait_for_nodes(state, len(state["hosts"]), hosts.UP_TIMEOUT_S)
    except BaseException:
        cmd_down(args, store)
        raise
    return describe(state)


def describe(state: dict) -> dict:
    head = state["hosts"][0]["ip"]
    dashboard = f"http://{head}:{hosts.DASHBOARD_PORT}" if state.get("dashboard", True) else None
    return {"head": f"{head}:{hosts.HEAD_PORT}", "dashboard": dashboard,
            "hosts": [{"name": h["name"], "ip": h["ip"]} for h in state["hosts"]],
            "auth_token_path": state["auth_token_path"], "latency_shaping": state["netem"]}


def cmd_shape(args, store: State) -> dict:
    state = store.require()
    host = find_host(state, args.host)
    hosts.apply_shape(state, host, args.gbps, args.latency_ms)
    store.save(state)
    return {"host": host["name"], "shape": host["shape"]}


def cmd_unshape(args, store: State) -> dict:
    state = store.require()
    host = find_host(state, args.host)
    hosts.sh("tc", "qdisc", "del", "dev", host["veth"], "root", check=False)
    hosts.sh("ip", "netns", "exec", host["name"], "tc", "qdisc", "del", "dev", "eth0", "root", check=False)
    host["shape"] = None
    store.save(state)
    return {"host": host["name"], "shape": None}


def cmd_partition(args, store: State) -> dict:
    state = store.require()
    host = find_host(state, args.host)
    hosts.sh("ip", "link", "set", host["veth"], "nomaster")
    host["partitioned"] = True
    store.save(state)
    return {"host": host["name"], "partitioned": True}


def cmd_heal(args, store: State) -> dict:
    state = store.require()
    host = find_host(state, args.host)
    hosts.sh("ip", "link", "set", host["veth"], "master", state["bridge"])
    hosts.sh("ip", "link", "set", host["veth"], "up")
    host["partitioned"] = False
    store.save(state)
    return {"host": host["name"], "partitioned": False}


def cmd_kill(args, store: State) -> dict:
    state = store.require()
    host = find_host(state, args.host)
    return {"host": host["name"], "killed_processes": hosts.kill_namespace(host["name"])}


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
        hosts.sh("ip", "link", "set", host["veth"], "master", state["bridge"])
        hosts.sh("ip", "link", "set", host["veth"], "up")
        host["partitioned"] = False
    hosts.kill_namespace(host["name"])
    if host.get("pid"):
        try:  # reap the old node if this process started it
            os.waitpid(host["pid"], os.WNOHANG)
        except ChildProcessError:
            pass
    host["pid"] = hosts.start_node(state, index)
    store.save(state)
    if not args.no_wait:  # a caller with a Ray driver of its own waits with it: no second one started here
        hosts.wait_for_nodes(state, len(state["hosts"]), hosts.UP_TIMEOUT_S)
    return {"host": host["name"], "restarted": True}


def cmd_exec(args, store: State) -> int:
    state = store.require()
    host = find_host(state, args.host)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise HarnessError("exec needs a command after --")
    env = hosts.ray_env(state) | {"RAY_ADDRESS": f"{state['hosts'][0]['ip']}:{hosts.HEAD_PORT}"}
    argv = ["ip", "netns", "exec", host["name"], *hosts.own_host_name(host), *command]
    return subprocess.run(argv, env=env).returncode


def cmd_down(args, store: State) -> dict:
    """Stop the Ray nodes (SIGTERM lets `ray start --block` stop its node), SIGKILL what is left in
    each namespace, delete namespaces, links and bridge. Nothing to do is not an error."""
    state = store.load()
    if state is None:
        return {"down": True, "removed": []}
    removed = []
    nodes = []  # the pids that are the harness's Ray nodes: the only ones signalled by pid
    for index, host in enumerate(state["hosts"]):
        if not host.get("pid") or not hosts.alive(host["pid"]):  # signal 0 only: exited (or a zombie): nothing to do
            continue
        if host.get("partitioned"):  # a node cut off cannot stop in order (it waits for the head): killed below
            continue
        why = hosts.node_pid_problem(state, index, host["pid"])
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
    while time.monotonic() < deadline and any(hosts.alive(pid) for pid in nodes):
        time.sleep(0.2)
    netns = hosts.sh("ip", "netns", "list", check=False).stdout.split()
    for host in state["hosts"]:
        if host["name"] in netns:
            hosts.kill_namespace(host["name"])
            hosts.sh("ip", "netns", "del", host["name"], check=False)
            removed.append(host["name"])
        hosts.remove_name_files(host["name"])
        hosts.delete_link(host["veth"], "veth")
        if host.get("pid") in nodes:
            try:  # reap it if this process started it
                os.waitpid(host["pid"], os.WNOHANG)
            except ChildProcessError:
                pass
    hosts.delete_link(state["bridge"], "bridge")
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
    up.add_argument("--no-dashboard", action="store_true", help="no dashboard on the head (no job submission)")
    up.add_argument("--net", default=DEFAULT_NET, help=f"private range for the hosts ({DEFAULT_NET})")
    up.add_argument("--prefix", dest="up_prefix", default=None,
                    help=f"prefix of namespace and interface names ({DEFAULT_PREFIX})")
    shape = sub.add_parser("shape", help="limit a host's link (both directions)")
    shape.add_argument("host")
    shape.add_argument("--gbps", type=float, required=True)
    shape.add_argument("--latency-ms", type=float, default=0.0)
    for name, what in (("unshape", "remove a host's shaping"), ("partition", "drop all of a host's traffic"),
                       ("heal", "undo partition"), ("kill", "kill every process of a host")):
        sub.add_parser(name, help=what).add_argument("host")
    restart = sub.add_parser("restart", help="bring a killed or cut-off worker host back with a fresh Ray node")
    restart.add_argument("host")
    restart.add_argument("--no-wait", action="store_true",
                         help="return once the node is started, before it has joined (the caller waits for it)")
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
