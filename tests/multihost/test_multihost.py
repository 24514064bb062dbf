"""Several hosts for real, on one machine: network namespaces joined by a bridge, each running a Ray
node (`python -m attnres_lab.netns_cluster`), with token authentication on. A job submitted from the root
namespace runs D = 2 x P = 2 ranks over two hosts with the single process's losses, and T = 2 x P = 2
keeps each tensor-parallel group on one host (under the zero-bubble ZB-V schedule); a host killed
mid-run, or cut off mid-step, is named (rank and node) and the run recovers onto the surviving hosts
from its last checkpoint with the undisturbed run's losses; a shaped link slows the run as the
simulator, calibrated on the unshaped link, predicts.

Two clusters serve the module (own names, own /24 each), each made once and shared by its tests in
turn: two 3-CPU hosts for the runs that leave a cluster as they found it (each test's teardown
checks that every CPU is free again and no link is shaped), three 1-CPU hosts for the runs that
kill or cut off a host (the next test's setup brings the host back with a fresh Ray node). The
tests of one cluster form one xdist group, so one worker runs them. Every namespace and process a
cluster made is removed when the module ends, also when a test fails. The tests skip, saying why,
only where a namespace cannot be made (not root, no `ip`); CI runs as root and runs them. Ray's
node-death detection is lowered by the harness (~3 s).
"""

from __future__ import annotations

import ipaddress
import json
import math
import os
import re
import secrets
import select
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from attnres_lab.fidelity_hosts import HostBench
from attnres_pp.cli import main
from attnres_pp.train.shards import checkpoint_tensors
from tests.run_helpers import assert_same_losses, losses
from tests.unit.test_memory_per_rank import check_memory_entries

pytestmark = [pytest.mark.ray, pytest.mark.multihost]
TWO_HOSTS = pytest.mark.xdist_group("multihost-two-hosts")
THREE_HOSTS = pytest.mark.xdist_group("multihost-three-hosts")

REPO = Path(__file__).resolve().parents[2]
HARNESS = [sys.executable, "-m", "attnres_lab.netns_cluster"]
CLI = [sys.executable, "-m", "attnres_pp.cli"]
TINY = ["--layers", "4", "--d-model", "32", "--heads", "2", "--seq-len", "16", "--batch-size", "4",
        "--microbatches", "2"]


def _namespaces_work() -> str | None:
    """None if this process can make a network namespace, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    name = f"attnprobe{secrets.token_hex(3)}"
    try:
        made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"`ip netns add` cannot run here: {error}"
    if made.returncode != 0:
        return f"`ip netns add` failed here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
    return None


_WHY_NOT = _namespaces_work()
if _WHY_NOT is not None:
    pytestmark.append(pytest.mark.skip(reason=_WHY_NOT))


# Asked a count of nodes per line: waits (up to 120 s: a restarted host's node joins in ~20 s) until
# that many nodes are alive with every CPU free (only alive, where the count is followed by "joined":
# a run may hold CPUs meanwhile), then answers "answer: alive free total" (Ray may print
# lines of its own). One driver for the module's checks, also the wait for a restarted host (`restart
# --no-wait`): a fresh Python and `ray.init` per check cost ~2 s each.
PROBER = """
import ray, sys, time
ray.init(address='auto', logging_level='ERROR', log_to_driver=False)
for line in sys.stdin:
    deadline = time.monotonic() + 120
    while True:
        free, total = ray.available_resources().get('CPU', 0), ray.cluster_resources().get('CPU', 0)
        alive = sum(1 for n in ray.nodes() if n['Alive'])
        if (free == total and alive == int(line)) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    print('answer:', alive, free, total, flush=True)
"""


def _free_subnet(third_octets: range) -> str:
    """A /24 of 10.213.X.0 (X from `third_octets`) that no address of this machine is in, drawn at
    random: a bridge an interrupted run left behind holds its range, and `up` refuses a range it
    overlaps; drawing among the free ones keeps that leftover from failing this run's tests."""
    held = subprocess.run(["ip", "-o", "-4", "addr"], capture_output=True, text=True, timeout=30).stdout
    taken = {ipaddress.ip_interface(word).network for line in held.splitlines() for word in line.split()
             if "/" in word and word[0].isdigit()}
    free = [x for x in third_octets
            if not any(net.overlaps(ipaddress.ip_network(f"10.213.{x}.0/24")) for net in taken)]
    assert free, f"every 10.213.X.0/24 for X in {third_octets} is held here: `ip -o -4 addr` shows {held}"
    return f"10.213.{secrets.choice(free)}.0/24"


class Cluster:
    """One `netns_cluster.py` cluster with its own state directory, name prefix and address range."""

    def __init__(self, hosts: int, cpus_per_host: int, subnets: range, dashboard: bool = True) -> None:
        """`subnets`: the third octets this cluster's /24 may take (the module's clusters are up at
        once, on two workers: disjoint ranges keep their addresses apart); `dashboard`: the head's,
        which only a job submission needs."""
        self.state_dir = Path("/tmp") / f"attnres-mh-{secrets.token_hex(3)}"  # short: Ray's socket paths
        self.prefix = f"t{secrets.token_hex(2)}"
        self.net = _free_subnet(subnets)
        try:
            up = self.harness("up", "--hosts", str(hosts), "--cpus-per-host", str(cpus_per_host), "--net", self.net,
                              "--prefix", self.prefix, *([] if dashboard else ["--no-dashboard"]), timeout=300)
        except BaseException:
            # `up` removes what it made when it fails; a timeout may still leave some: down again.
            self.harness("down", timeout=120, check=False)
            raise
        self.info = json.loads(up.stdout)
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        self.env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=self.info["auth_token_path"], RAY_DEDUP_LOGS="0",
                        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
        self.hit: list[str] = []  # hosts killed or cut off, for `restore`
        self.prober: subprocess.Popen | None = None
        self.prober_said = b""  # what the prober printed and no answer has consumed yet
        # The prober's stderr goes to a file: Ray forwards its raylets' logs (state dumps after every
        # kill and restart) to a driver's stderr, and a pipe nobody drains fills at 64 KiB and stops
        # the prober mid-print, before its answer.
        self.prober_log = Path("/tmp") / f"attnres-mh-prober-{secrets.token_hex(3)}.log"

    def harness(self, *args: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess:
        done = subprocess.run([*HARNESS, "--state-dir", str(self.state_dir), *args], capture_output=True, text=True,
                              timeout=timeout)
        if check:
            assert done.returncode == 0, f"netns_cluster.py {' '.join(args)}: {done.stdout}{done.stderr}"
        return done

    def host_of(self, address: str) -> str:
        return next(h["name"] for h in self.info["hosts"] if h["ip"] == address)

    def driver(self, argv: list[str], out: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
        """`attnres-pp train ARGV --launcher ray` as a driver process in the head's namespace, its
        output in driver.log beside `out`; `env` added to the cluster's environment."""
        log = (out.parent / "driver.log").open("w")
        return subprocess.Popen([*HARNESS, "--state-dir", str(self.state_dir), "exec", "0", "--", *CLI, "train",
                                 *argv, "--launcher", "ray", "--out", str(out)],
                                env={**self.env, **(env or {})}, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                text=True)

    def disturb(self, action: str, host: str) -> None:
        """`kill` or `partition` a worker host; `restore` brings it back."""
        self.hit.append(host)
        self.harness(action, host)

    def restore(self) -> None:
        """The hit hosts back, each with a fresh Ray node; `assert_as_found` then waits (the prober) until
        every node has joined: `restart --no-wait` starts no Ray driver of its own to wait with."""
        for host in self.hit:
            self.harness("restart", host, "--no-wait", timeout=300)
        self.hit.clear()

    def assert_as_found(self) -> None:
        """What the next test sharing this cluster needs: no link shaped and, once Ray has freed what
        the last run held, every node alive with all of its CPUs available; while hosts are still
        down (killed or cut off, before `restore`), every other node so."""
        for host in json.loads((self.state_dir / "state.json").read_text())["hosts"]:
            qdiscs = subprocess.run(["tc", "qdisc", "show", "dev", host["veth"]], capture_output=True,
                                    text=True).stdout
            assert "tbf" not in qdiscs and "netem" not in qdiscs, f"{host['name']} is left shaped: {qdiscs}"
        nodes = len(self.info["hosts"]) - len(self.hit)
        try:
            answer = self._ask_prober(str(nodes), timeout=180)
        except AssertionError as first:  # a driver stuck in a Ray call: one more try with a fresh one
            print(f"a fresh prober after: {first}")
            answer = self._ask_prober(str(nodes), timeout=180)
        alive, free, total = answer.split()
        assert int(alive) == nodes and float(free) == float(total) > 0, f"{answer}\n{self._node_logs()}"

    def _node_logs(self) -> str:
        """The end of each host's `ray start` log: why a node did not join, when one did not."""
        logs = [(self.state_dir / f"{host['name']}.log") for host in self.info["hosts"]]
        return "\n".join(f"{log.name}: {log.read_text(errors='replace')[-1500:]}" for log in logs if log.exists())

    def _ask_prober(self, line: str, timeout: float) -> str:
        """`line` to the cluster's prober (a Ray driver in the head's namespace, started at the first
        question and kept: one Python and one `ray.init` for all of the module's checks); its answer.
        Its stdout is read as raw bytes and split here: a buffered reader could hold the answer in
        its buffer while `select` waits on an empty pipe."""
        if self.prober is None:
            with self.prober_log.open("ab") as log:
                self.prober = subprocess.Popen([*HARNESS, "--state-dir", str(self.state_dir), "exec", "0", "--",
                                                sys.executable, "-c", PROBER], stdin=subprocess.PIPE,
                                               stdout=subprocess.PIPE, stderr=log, start_new_session=True)
            self.prober_said = b""
        self.prober.stdin.write((line + "\n").encode())
        self.prober.stdin.flush()
        deadline = time.monotonic() + timeout
        while True:
            lines = self.prober_said.split(b"\n")
            for i, said in enumerate(lines[:-1]):
                if b"answer:" in said:  # a line of Ray's without its newline may precede it
                    self.prober_said = b"\n".join(lines[i + 1:])
                    return said.split(b"answer:")[-1].decode().strip()
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.prober.stdout], [], [], left)[0]:
                break
            chunk = os.read(self.prober.stdout.fileno(), 65536)
            if not chunk:  # the prober ended
                break
            self.prober_said += chunk
        prober, self.prober = self.prober, None
        self._kill(prober)
        log = self.prober_log.read_bytes().decode(errors="replace")
        raise AssertionError(f"the cluster's prober gave no answer within {timeout:.0f} s (exit {prober.returncode}): "
                             f"{self.prober_said.decode(errors='replace')[-2000:]}{log[-2000:]}")

    def stop_prober(self) -> None:
        """The prober ends at the end of its input; killed (with the harness that runs it) only if not."""
        if self.prober is not None and self.prober.poll() is None:
            self.prober.stdin.close()
            try:
                self.prober.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._kill(self.prober)
        self.prober_log.unlink(missing_ok=True)

    @staticmethod
    def _kill(prober: subprocess.Popen) -> None:
        """The prober's whole session: the harness, `ip netns exec` and the Ray driver it runs."""
        try:
            os.killpg(prober.pid, 9)
        except ProcessLookupError:
            pass
        prober.wait(timeout=30)

    def down(self) -> None:
        self.stop_prober()
        self.harness("down", timeout=120)
        left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert f"{self.prefix}-h" not in left, f"namespaces outlived `down`: {left}"
        assert not self.state_dir.exists()


class SharedHostBench(HostBench):
    """The host benchmark's runs on a shared cluster's first two hosts (one rank per host, SPREAD, as
    on the benchmark's own 2-host cluster): no `up` of its own, and `down` leaves host 1 unshaped."""

    def __init__(self, cluster: Cluster) -> None:
        self.state_dir, self.info = str(cluster.state_dir), cluster.info

    def down(self) -> None:
        self._harness("unshape", "1")


@pytest.fixture(scope="module")
def two_hosts():
    """Two 3-CPU hosts, made once for the tests that leave a cluster as they found it."""
    cluster = Cluster(2, cpus_per_host=3, subnets=range(100, 175))
    try:
        yield cluster
    finally:
        cluster.down()


@pytest.fixture
def two_host_cluster(two_hosts):
    yield two_hosts
    two_hosts.assert_as_found()


@pytest.fixture(scope="module")
def three_hosts():
    """Three 1-CPU hosts, made once for the runs that kill or cut off a host: their drivers run in
    the head's namespace, so the head has no dashboard."""
    cluster = Cluster(3, cpus_per_host=1, subnets=range(175, 250), dashboard=False)
    try:
        assert cluster.info["dashboard"] is None and not _dashboard_modules(cluster.info["hosts"][0]["name"])
        yield cluster
    finally:
        cluster.down()


def _dashboard_modules(namespace: str) -> list[str]:
    """The dashboard's module processes (`ray-dashboard-JobHead-0`, ...) running in `namespace`."""
    pids = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True, timeout=30).stdout
    found = []
    for pid in pids.split():
        try:
            argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
        except OSError:
            continue
        if argv0.startswith("ray-dashboard-"):
            found.append(argv0.split()[0])
    return found


@pytest.fixture
def three_host_cluster(three_hosts):
    """The host a test hit is brought back before the next test (a fresh Ray node takes ~20 s),
    not after the last one: the module's `down` removes it as it is. Each test's teardown checks
    the surviving nodes; the next test's setup checks every node once the hit host is back."""
    if three_hosts.hit:
        three_hosts.restore()
        three_hosts.assert_as_found()
    yield three_hosts
    three_hosts.assert_as_found()


def _wait_for_line(log: Path, proc: subprocess.Popen, needle: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log.read_text() if log.exists() else ""
        if needle in text:
            return text
        assert proc.poll() is None, f"the driver exited before {needle!r}:\n{text[-4000:]}"
        time.sleep(0.05)
    raise AssertionError(f"no {needle!r} within {timeout:.0f} s:\n{log.read_text()[-4000:]}")


def _rank_addresses(text: str, world: int) -> dict[int, str]:
    """Each rank's node address from the actors' set-up lines (`... node IP (id, eth0) ...`)."""
    found = {}
    for line in text.splitlines():
        for rank in range(world):
            if f"StageActor rank={rank} " in line and " node " in line:
                found[rank] = line.split(" node ")[1].split()[0]
    return found


@TWO_HOSTS
def test_job_submitted_from_the_root_namespace_runs_over_two_hosts(two_host_cluster, tmp_path):
    """`ray job submit` to the head's dashboard (a `ray start --head` node) from the machine itself,
    token auth on (a client without the token is refused), the actors' lines in the job's output: D = 2,
    P = 2 packed onto two 3-CPU hosts, each end rank reading its share of a `--data` file, gives the
    single process's losses with scalars only between the driver and the actors (the Ray D x P run
    of the suite: test_ray.py has none of its own). Three ranks sit on one host
    and one on the other, so replica 0's hop stays on one node and replica 1's crosses the link:
    shared memory and gloo carry bytes in the same step (the pairs are chosen from the node map, not
    from host names, and a replica without a same-node pair does not send the other's over gloo).
    SPREAD's one rank per host is the disturbed runs' placement (the three-host tests below)."""
    data = tmp_path / "corpus.txt"  # a small file: each end rank reads its own share of it
    data.write_text("".join(p.read_text() for p in sorted((REPO / "attnres_pp" / "train").glob("*.py"))))
    steps = ["--steps", "3", "--data", str(data)]
    assert main(["train", *TINY, *steps, "--launcher", "local", "--out", str(tmp_path / "single"), "--quiet"]) == 0
    cluster = two_host_cluster
    # Token authentication is on: a client without the token is refused, and one with a wrong token. The
    # jobs API asked over HTTP from this process, as `ray job list` asks it (a Ray CLI start is ~3 CPU-s).
    no_proxy = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    for headers, status, said in (({}, 401, "Unauthorized"), ({"Authorization": "Bearer wrong"}, 403, "Forbidden")):
        with pytest.raises(urllib.error.HTTPError) as refused:
            no_proxy.open(urllib.request.Request(f"{cluster.info['dashboard']}/api/jobs/", headers=headers),
                          timeout=60)
        assert refused.value.code == status and refused.value.read().decode().startswith(said), refused.value
    out = tmp_path / "run"
    submit = ["ray", "job", "submit", "--address", cluster.info["dashboard"], "--", "env", f"PYTHONPATH={REPO}",
              *CLI, "train", *TINY, *steps, "--stages", "2", "--data-parallel", "2", "--launcher", "ray",
              "--placement", "PACK", "--timeout", "60", "--out", str(out)]
    deadline = time.monotonic() + 60
    while True:  # the dashboard answers a little before the head's job agent does
        done = subprocess.run(submit, env=cluster.env, capture_output=True, text=True, timeout=300)
        said = done.stdout + done.stderr
        if done.returncode == 0 or "No available agent" not in said or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert done.returncode == 0, said[-4000:]
    assert all(f"StageActor rank={rank} " in said for rank in range(4)), said[-4000:]  # the actors' lines, by rank
    summary = json.loads((out / "summary.json").read_text())
    assert_same_losses(summary["losses"], losses(tmp_path / "single"))
    hosts = {h["ip"] for h in cluster.info["hosts"]}
    assert set(summary["node_addresses"]) == hosts  # ranks on both nodes
    nodes = summary["nodes"]
    assert nodes[0] == nodes[1] == nodes[2] != nodes[3], nodes  # ranks numbered node by node
    for host in cluster.info["hosts"]:  # each host has its own name, as real hosts do
        assert f" of {host['name']}, node {host['ip']} " in said, said[-4000:]
    by_way = summary["bytes_sent_per_step_by_transport"]
    assert by_way["shm"] > 0 and by_way["gloo"] > 0, by_way
    assert by_way["shm"] == by_way["gloo"]  # the two replicas send the same hops, one way each
    assert by_way["shm"] + by_way["gloo"] == summary["bytes_sent_per_step"]
    # What the driver and the actors account for a D x P run: scalars only between them, the
    # parameters once per stage, a cache peak per rank.
    assert summary["data_parallel"] == 2 and summary["config"]["pipeline"]["launcher"] == "ray"
    assert len(summary["params_per_rank"]) == 2 and sum(summary["params_per_rank"]) == summary["params"]
    assert 0 < summary["driver_bytes_per_step"] < 4096
    assert len(summary["cache_peak_bytes_per_rank"]) == 4


@TWO_HOSTS
def test_each_tensor_parallel_group_stays_on_one_host_where_rank_bundles_would_split_one(two_host_cluster, tmp_path):
    """T = 2 x P = 2 packed onto two 3-CPU hosts: a bundle per rank would put ranks 0-2 on one host and
    rank 3 on the other, splitting stage 1's tp group over the link; a bundle per tp group keeps
    each group on one host, stage 0's on one and stage 1's on the other. The pipeline hop crosses
    the link (gloo carries every hop byte), the tp collectives stay on a host; the single process's
    losses. The run is also the Ray launcher's zero-bubble run (`--schedule zbv`, V = 2): four
    actors that build the V placement from the schedule and run I and W, with the in-process
    launcher's losses (its rank threads give the local rank processes' losses bitwise, without
    starting four) and what each actor holds counted as other ranks count it. One run for both: the
    schedule reaches a tp rank's actor as it reaches any rank's (its worker's arguments). Hops in
    shared memory between actors on one node: the job submission above."""
    cluster = two_host_cluster
    steps = ["--steps", "2"]
    argv = [*TINY, *steps, "--stages", "2", "--virtual", "2", "--schedule", "zbv", "--tensor-parallel", "2",
            "--device", "cpu", "--eval-every", "0", "--no-final-checkpoint"]
    out = tmp_path / "run"
    proc = cluster.driver([*argv, "--placement", "PACK", "--timeout", "60"], out)
    try:
        # the references meanwhile, in this process: the driver's actors start on the cluster's own CPUs
        assert main(["train", *TINY, *steps, "--launcher", "local", "--out", str(tmp_path / "single"),
                     "--quiet"]) == 0
        assert main(["train", *argv, "--launcher", "inprocess", "--out", str(tmp_path / "inproc"), "--quiet"]) == 0
        assert proc.wait(timeout=300) == 0, (tmp_path / "driver.log").read_text()[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    summary = json.loads((out / "summary.json").read_text())
    assert_same_losses(summary["losses"], losses(tmp_path / "single"))
    assert_same_losses(summary["losses"], losses(tmp_path / "inproc"))
    pipeline = summary["config"]["pipeline"]
    assert (pipeline["tensor_parallel"], pipeline["schedule"], pipeline["launcher"]) == (2, "zbv", "ray")
    assert summary["fwd_hop_tensors"][1] == 0  # V placement: chunks 1 and 2 share pp rank 1, a self-hop
    nodes = summary["nodes"]
    assert nodes[0] == nodes[1] != nodes[2] == nodes[3], nodes  # each tp group on one host, the stages apart
    assert summary["tp_bytes_per_step"] > 0
    by_way = summary["bytes_sent_per_step_by_transport"]
    assert by_way["gloo"] == summary["bytes_sent_per_step"] > 0 and by_way["shm"] == 0, by_way
    check_memory_entries(summary["memory_per_rank"], 4)  # the actors count what they hold, as other ranks do


@TWO_HOSTS
def test_a_rendezvous_that_cannot_connect_is_one_line_naming_ranks_and_addresses(two_host_cluster, tmp_path):
    """Ranks on two hosts whose gloo sockets are bound to loopback (the address a host name resolves
    to in every namespace) cannot connect: one `error:` line naming the ranks and addresses, exit 2,
    no traceback, within the --timeout."""
    cluster = two_host_cluster
    argv = [*TINY, "--steps", "2", "--stages", "2", "--placement", "SPREAD", "--timeout", "20"]
    # Loopback is what binding to the host name's address gives in every namespace.
    done = subprocess.run([*HARNESS, "--state-dir", str(cluster.state_dir), "exec", "0", "--", *CLI, "train", *argv,
                           "--launcher", "ray", "--out", str(tmp_path / "bad")],
                          env={**cluster.env, "ATTNRES_PP_SOCKET_IFNAME": "lo"}, cwd=REPO, capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 2, done.stdout + done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in done.stderr.split(errors[0])[-1]
    assert "did not connect at tcp://" in errors[0] and "rank 0 at 10.213." in errors[0]
    assert "rank 1 at 10.213." in errors[0]


@TWO_HOSTS
def test_a_delay_this_kernel_cannot_add_is_refused_in_one_line(two_host_cluster, tmp_path):
    """Without sch_netem no delay can be put on a link (tbf and htb add none): `up` and `shape` with
    --latency-ms > 0 exit 2 with one `error:` line saying why and what to do instead, `up` before it
    makes anything and `shape` before it touches the link; bandwidth alone still shapes."""
    from attnres_lab import netns_host as harness

    if harness.netem_missing() is None:
        pytest.skip("this kernel has sch_netem: --latency-ms adds a real delay here")
    state_dir, prefix = f"/tmp/attnres-mh-{secrets.token_hex(3)}", f"t{secrets.token_hex(2)}"
    done = subprocess.run([*HARNESS, "--state-dir", state_dir, "up", "--hosts", "1", "--gbps", "1", "--latency-ms",
                           "1", "--prefix", prefix], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stdout == "", done.stdout + done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --latency-ms 1 needs sch_netem"), lines
    assert "--link-latency-us" in lines[0] and "--latency-ms 0" in lines[0]
    assert prefix not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not Path(state_dir).exists()

    cluster = two_host_cluster
    veth = json.loads((cluster.state_dir / "state.json").read_text())["hosts"][1]["veth"]
    try:
        refused = cluster.harness("shape", "1", "--gbps", "0.5", "--latency-ms", "2", check=False)
        assert refused.returncode == 2 and refused.stderr.startswith("error: --latency-ms 2 needs sch_netem")
        assert "tbf" not in subprocess.run(["tc", "qdisc", "show", "dev", veth], capture_output=True, text=True).stdout
        assert json.loads(cluster.harness("shape", "1", "--gbps", "0.5").stdout)["shape"] == {"gbps": 0.5,
                                                                                               "latency_ms": 0.0}
        assert "tbf" in subprocess.run(["tc", "qdisc", "show", "dev", veth], capture_output=True, text=True).stdout
    finally:
        cluster.harness("unshape", "1")


# Steps measured per run after its warm-up. 2 saved ~5 CPU-s of ~55 but widened the errors the
# ratio bound below must hold (-0.3% to -41% and +25% in three runs at load 35-50, against -14% to
# -24% with 4 steps at loads 5-44): the median of 4 keeps the margin.
SHAPED_STEPS = 4


@TWO_HOSTS
def test_a_shaped_link_slows_naive_more_than_cached_as_the_simulator_predicts(two_host_cluster):
    """Host 1's link shaped to 0.2 Gb/s (and 1 ms where the kernel has sch_netem): Block AttnRes
    cached vs naive step times on the real link, and the simulator's predictions for both from a
    calibration on the unshaped link and a probe of each link state (out of sample for the link),
    the three runs made by one driver. The errors are printed."""
    from attnres_lab.fidelity_hosts import CALIBRATION, HostCase, evaluate
    from attnres_lab.unit_probe import probe_units
    from attnres_pp.bench.common import MICROBATCH_SIZE
    from attnres_pp.model.config import ModelConfig

    probe = probe_units(ModelConfig.from_dict(CALIBRATION.fidelity_case().model()), MICROBATCH_SIZE, rounds=5)
    bench = SharedHostBench(two_host_cluster)
    try:
        latency = 1.0 if bench.latency_shaping else 0.0
        cases = [HostCase("interleaved_1f1b", 2, mode, 0.2, latency) for mode in ("cached", "naive")]
        result = evaluate(bench, cases, SHAPED_STEPS, probe, print, rotate=False, probe_repeats=5)
    finally:
        bench.down()
    cached, naive = result["rows"]
    print(f"0.2 Gb/s + {latency:g} ms: cached {cached['measured_step_s'] * 1e3:.1f} ms measured / "
          f"{cached['predicted_step_s'] * 1e3:.1f} predicted ({cached['error']:+.1%}); naive "
          f"{naive['measured_step_s'] * 1e3:.1f} / {naive['predicted_step_s'] * 1e3:.1f} ({naive['error']:+.1%})")
    # The probe saw the shaped link: each direction's payload rate within the token bucket's (frames
    # cost ~4.4% of it), far below the unshaped link's.
    shaped = result["links"]["0.2 Gb/s" + (f" + {latency:g} ms" if latency else "")]["idle"]
    unshaped = result["links"]["unshaped"]["idle"]
    for direction in ("forward", "backward"):
        assert 0.1 < shaped[direction]["gbps"] <= 0.2 * 1.02, shaped
        assert unshaped[direction]["gbps"] > 5 * shaped[direction]["gbps"], (unshaped, shaped)
    # The busy round streamed 0 -> 1 at the shaped rate and measured what each end's stack costs it.
    streamed = result["links"]["0.2 Gb/s" + (f" + {latency:g} ms" if latency else "")]["busy"]["cpu_share"]
    assert 0.05 < streamed["stream_gbps"] <= 0.2 * 1.05 and 0 <= streamed["send"] <= 1 and 0 <= streamed["recv"] <= 1
    # Naive sends every block summary again: more bytes on the slow link, so a longer step predicted.
    # The measured pair is printed, not asserted: at load 4-12 on 2 cores one run moves by up to 50%.
    assert naive["predicted_step_s"] > cached["predicted_step_s"]
    for row in (cached, naive):  # a loose bound (a factor of 2.5): the figures themselves are the report
        assert row["measured_step_s"] > 0 and 0.4 < row["predicted_step_s"] / row["measured_step_s"] < 2.5, row


DISTURBED_STEPS = ["--steps", "12", "--checkpoint-every", "2", "--eval-every", "6", "--tie-embeddings"]
# Tied embeddings at P = 2, V = 2: the embedding (chunk 0) on rank 0, the head (chunk 3) on rank 1, a
# copy each, summed by the embedding group; the restart loads the one stored matrix into both copies.
DISTURBED_LAYOUT = ["--stages", "2", "--virtual", "2"]
# The pipeline timeout of the disturbed runs: a host cut off is noticed after it (a step takes ~0.2 s).
DISTURBED_TIMEOUT_S = 12


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory) -> list[float]:
    """The single process's losses for the disturbed runs' arguments (one rank, one matrix: the
    recovered runs equal it, so the two copies stay one and the recovery changes no number)."""
    out = tmp_path_factory.mktemp("undisturbed") / "run"
    assert main(["train", *TINY, *DISTURBED_STEPS, "--launcher", "local", "--out", str(out), "--quiet"]) == 0
    return losses(out)


def _disturbed_run(cluster: Cluster, undisturbed: list[float], tmp_path, action: str) -> tuple[dict, str, str]:
    """P = 2, V = 2 over 3 one-CPU hosts, checkpoints every 2 steps; `action` ("kill" or "partition") hits
    the host of a rank that is not on the head, right after step 3. Returns (summary, driver log,
    the host's address)."""
    # 20 ms of emulated latency per message slows the steps (~0.2 s) so that the hit lands mid-run.
    steps = [*DISTURBED_STEPS, "--link-gbps", "100", "--link-latency-us", "20000"]  # the link changes no number
    log = tmp_path / "driver.log"
    proc = cluster.driver([*TINY, *steps, *DISTURBED_LAYOUT, "--placement", "SPREAD",
                           "--timeout", str(DISTURBED_TIMEOUT_S)],
                          tmp_path / "run")
    try:
        text = _wait_for_line(log, proc, "step  3/12", timeout=240)
        head = cluster.info["hosts"][0]["ip"]
        address = next(ip for ip in _rank_addresses(text, 2).values() if ip != head)
        cluster.disturb(action, cluster.host_of(address))
        started = time.monotonic()
        assert proc.wait(timeout=DISTURBED_TIMEOUT_S + 120) == 0, log.read_text()[-4000:]
        elapsed = time.monotonic() - started
    finally:
        if proc.poll() is None:
            proc.kill()
    assert elapsed < DISTURBED_TIMEOUT_S + 90, f"the run took {elapsed:.0f} s to recover"
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert_same_losses(summary["losses"], undisturbed)
    assert len(set(summary["nodes"])) == 2  # one rank per host: every hop crosses a link, over gloo
    assert summary["bytes_sent_per_step_by_transport"] == {"shm": 0, "gloo": summary["bytes_sent_per_step"]}
    checkpoints = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert all(name.startswith("step_") and name[5:].isdigit() for name in checkpoints), checkpoints  # no .tmp
    assert [entry[0] for entry in summary["val_losses"]] == [5, 11]  # the evaluations, also those restored
    saved = checkpoint_tensors(summary["final_checkpoint"])
    assert "embed.tok.weight" in saved and not [key for key in saved if "lm_head" in key]  # the one matrix, once
    return summary, log.read_text(), address


@THREE_HOSTS
def test_a_host_lost_mid_run_is_named_and_the_run_recovers_on_the_others(three_host_cluster, undisturbed, tmp_path):
    summary, text, address = _disturbed_run(three_host_cluster, undisturbed, tmp_path, "kill")
    assert summary["restarts"] == 1
    assert [lost["address"] for lost in summary["lost_nodes"]] == [address]
    assert address not in summary["node_addresses"]  # the restarted ranks are on the surviving hosts
    assert f"on node {address}" in text
    said = re.search(r"rank \d lost at step (\d+)/12; restarting from checkpoint step (\d+) \(restart 1/3\)", text)
    assert said and int(said[2]) % 2 == 0 and int(said[2]) < int(said[1]), text[-4000:]


@THREE_HOSTS
def test_a_host_cut_off_mid_step_is_named_and_the_run_never_hangs(three_host_cluster, undisturbed, tmp_path):
    summary, text, address = _disturbed_run(three_host_cluster, undisturbed, tmp_path, "partition")
    assert summary["restarts"] == 1
    assert [lost["address"] for lost in summary["lost_nodes"]] == [address]
    assert f"on node {address}" in text and "stopped answering" in text


# D = 2 replicas of one rank each (a host has one CPU). A batch of 32 over 24 steps: a loss curve
# whose fall over its last s steps, the skipped share's tolerance, is positive for every s up to 12
# (0.03 at the least, at s = 3; the disturbed runs' final losses came within 0.011-0.014 of it).
FT_STEPS = 24
FT_RUN = ["--layers", "4", "--d-model", "32", "--heads", "2", "--seq-len", "16", "--batch-size", "32",
          "--microbatches", "8", "--stages", "1", "--data-parallel", "2", "--steps", str(FT_STEPS),
          "--no-final-checkpoint"]
# Each rank of the disturbed run sleeps this long before every step (ATTNRES_PP_SLOW_STEP_S: no
# number of the run changes, and no CPU is spent), so that the lost replica, restarted in ~5-20 s,
# heals mid-run rather than at the last step, which waits for it: several steps after the kill, with
# steps left after the heal. The fewer steps it misses, the tighter the final loss's tolerance: at
# 0.6 s and load 20 it missed 17 (back at step 21 of 24, tolerance 0.49); the 16-batch evaluation
# after every step that paced it before (and cost most of the run's CPU) had it miss 7 at load 20
# (tolerance 0.12); at a second a step it missed 10 at load 15 (tolerance 0.135).
FT_STEP_PAUSE_S = "1.0"


@THREE_HOSTS
def test_a_host_lost_under_fault_tolerance_costs_only_its_replica_group(three_host_cluster, tmp_path):
    """`--fault-tolerance replicas` under `--placement SPREAD`, the two replica groups on two of the
    three one-CPU hosts, the Lighthouse in the driver on the head: the host of a group that is not on
    the head is killed mid-run. The other group commits every step once, in order; the lost group
    is restarted alone on the surviving host, heals from the live one across hosts (its Manager,
    store and checkpoint server reached at their node's address) and commits again; the job never
    restarts, the groups end bitwise equal, and the final loss is the fault-free run's within the
    skipped share's tolerance (tests/distributed/test_fault_tolerance.py)."""
    from ..distributed.test_fault_tolerance import skipped_share_tolerance

    free = tmp_path / "free"
    # the fault-free reference on thread ranks: the local rank processes' losses bitwise, no process started
    assert main(["train", *FT_RUN, "--eval-every", "0", "--launcher", "inprocess", "--out", str(free),
                 "--quiet"]) == 0
    cluster = three_host_cluster
    head = cluster.info["hosts"][0]["ip"]
    out, log = tmp_path / "run", tmp_path / "driver.log"
    proc = cluster.driver([*FT_RUN, "--eval-every", "0", "--fault-tolerance", "replicas", "--placement", "SPREAD",
                           "--timeout", "20"], out, env={"ATTNRES_PP_SLOW_STEP_S": FT_STEP_PAUSE_S})
    try:
        text = _wait_for_line(log, proc, f"step  3/{FT_STEPS}", timeout=240)
        where = _rank_addresses(text, 2)  # global rank d is replica d's one rank
        assert len(set(where.values())) == 2, where  # a replica per host
        lost = next(d for d in (1, 0) if where[d] != head)
        live = 1 - lost
        address = where[lost]
        cluster.disturb("kill", cluster.host_of(address))
        killed = time.monotonic()
        shrunk_s, healed_s = _watch_recovery(out / "metrics.jsonl", proc, killed, timeout=180)
        assert proc.wait(timeout=180) == 0, log.read_text()[-4000:]
        elapsed = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            proc.kill()
    summary = json.loads((out / "summary.json").read_text())
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps] == list(range(FT_STEPS))  # every step committed once, in order
    assert all(live in r["replica_groups"] for r in steps)  # the live group never missed one
    assert summary["restarts"] == 0 and summary["replica_restarts"][lost] == 1
    assert summary["replica_restarts"][live] == 0
    [recovery] = summary["recoveries"]
    assert recovery["replica"] == lost and f"on node {address}" in recovery["cause"], recovery
    assert "rejoined_at_step" in recovery and steps[-1]["replica_groups"] == [0, 1]
    assert all(r["replica_groups"] == [0, 1] for r in steps[recovery["rejoined_at_step"]:])
    assert summary["participants_per_step"] == [len(r["replica_groups"]) for r in steps]
    assert [n["address"] for n in summary["lost_nodes"]] == [address]
    placed = summary["replica_node_addresses"]
    assert placed[live] == [where[live]] and placed[lost][0] not in (address, where[live]), placed
    assert summary["lighthouse"].startswith(f"http://{head}:")  # reached from every host at the head's address
    assert summary["replicas_equal"] is True
    reference = losses(free)
    tolerance = skipped_share_tolerance(reference, summary["participants_per_step"], 2)
    gap = abs(summary["losses"][-1] - reference[-1])
    assert gap <= tolerance, (summary["losses"][-1], reference[-1], tolerance)
    print(f"final loss {gap:.4f} from the fault-free run's (tolerance {tolerance:.4f}); from the kill of "
          f"{address}: first step without it logged after {shrunk_s:.1f} s, its first step again (step "
          f"{recovery['rejoined_at_step'] + 1} of {FT_STEPS}) after {healed_s:.1f} s, run over after {elapsed:.1f} s; "
          f"from the driver seeing the loss: {recovery['first_commit_s']:.2f} s to a commit, "
          f"{recovery['rejoin_s']:.2f} s to its own; {sum(2 - p for p in summary['participants_per_step'])} "
          "step(s) without it")


def _watch_recovery(metrics: Path, proc: subprocess.Popen, since: float, timeout: float) -> tuple[float, float]:
    """Seconds from `since` until metrics.jsonl logs a step with one replica, and then one with both
    again (nan where the run ended first), reading the file as the driver appends to it."""
    shrunk = healed = math.nan
    deadline = since + timeout
    while proc.poll() is None and time.monotonic() < deadline and math.isnan(healed):
        text = metrics.read_text() if metrics.exists() else ""
        rows = [json.loads(line) for line in text[:text.rfind("\n") + 1].splitlines()]  # whole lines only
        now = time.monotonic() - since
        if math.isnan(shrunk) and any(r["participants"] == 1 for r in rows):
            shrunk = now
        if not math.isnan(shrunk) and rows[-1]["participants"] == 2:
            healed = now
        time.sleep(0.05)
    return shrunk, healed
