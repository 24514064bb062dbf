"""How long one tensor takes over a link shaped by tc tbf, as `netns_cluster shape` shapes it:
two network namespaces joined by a veth pair, a token bucket on both ends (the harness's rate,
bucket and queue), gloo point-to-point between a rank in each.

    python -m attnres_lab.shaped_link_probe [--gbps 0.1 0.5 2] [--sizes-kib 16 128 512 2048] [--repeats 15]
        [--gap-ms 5] [--busy]

For each rate and size the sender sends the tensor, the receiver answers with one element, and the
round trip less that of a one-element message is the tensor's transfer time (the fastest of the
repeats: on a loaded machine a wake-up adds milliseconds at random); messages are
`--gap-ms` apart, as a pipeline's hops are (the bucket refills in between). Prints one JSON object:
per rate, the seconds per size, the fit `seconds = a + bytes / rate_eff` (least squares over
the sizes) and `rate_eff / tbf rate`. Root; everything it makes is removed at the end, also on error.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import statistics
import subprocess
import sys
import time

NET = "10.213.252"
BURST_BYTES = 16 * 1024  # as attnres_lab/netns_host.py (this file runs by path in each namespace: it stands alone)


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=30)


def shape(ns: str, dev: str, gbps: float | None) -> None:
    subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"], capture_output=True)
    if gbps is None:
        return
    rate_bit = int(gbps * 1e9)
    burst = max(BURST_BYTES, rate_bit // 8 // 5000)
    sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", str(rate_bit), "burst",
       str(burst), "latency", "200ms")


def rank_main(rank: int, address: str, port: int, sizes: list[int], repeats: int, gap_s: float, busy: bool) -> None:
    """Rank 0 sends, rank 1 answers; rank 0 prints {size: [seconds, ...]} as JSON. `busy`: a thread
    of each rank multiplies matrices meanwhile, as a pipeline rank computes while its hops travel."""
    import datetime
    import threading

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    stop = threading.Event()
    if busy:
        def compute() -> None:
            a = torch.randn(256, 256)
            while not stop.is_set():
                a = torch.tanh(a @ a)

        threading.Thread(target=compute, daemon=True).start()

    os.environ["GLOO_SOCKET_IFNAME"] = "eth0"
    dist.init_process_group("gloo", init_method=f"tcp://{address}:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    ack = torch.zeros(1)
    times: dict[int, list[float]] = {}
    for n_bytes in [4, *sizes]:
        payload = torch.zeros(max(1, n_bytes // 4))
        for index in range(repeats + 2):  # two warm-ups
            time.sleep(gap_s)
            if rank == 0:
                start = time.perf_counter()
                dist.send(payload, 1)
                dist.recv(ack, 1)
                if index >= 2:
                    times.setdefault(n_bytes, []).append(time.perf_counter() - start)
            else:
                dist.recv(payload, 0)
                dist.send(ack, 0)
    stop.set()
    dist.destroy_process_group()
    if rank == 0:
        print(json.dumps(times))


def fit(points: dict[int, float]) -> tuple[float, float]:
    """Least-squares (a, b) of seconds = a + b * bytes."""
    xs, ys = list(points), list(points.values())
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gbps", type=float, nargs="+", default=[0.1, 0.5, 2.0])
    parser.add_argument("--sizes-kib", type=int, nargs="+", default=[16, 128, 512, 2048])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--gap-ms", type=float, default=5.0)
    parser.add_argument("--busy", action="store_true", help="each rank computes in a thread meanwhile")
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = [k * 1024 for k in args.sizes_kib]
    if args.rank is not None:
        rank_main(args.rank, f"{NET}.1", args.port, sizes, args.repeats, args.gap_ms / 1e3, args.busy)
        return 0
    if os.geteuid() != 0:
        print("error: attnres_lab.shaped_link_probe needs root (ip netns, tc): run it with sudo", file=sys.stderr)
        return 2
    tag = secrets.token_hex(2)
    names = [f"slp{tag}a", f"slp{tag}b"]
    try:
        for ns in names:
            sh("ip", "netns", "add", ns)
        sh("ip", "link", "add", f"slp{tag}0", "type", "veth", "peer", "name", f"slp{tag}1")
        for index, ns in enumerate(names):
            dev = f"slp{tag}{index}"
            sh("ip", "link", "set", dev, "netns", ns)
            sh("ip", "netns", "exec", ns, "ip", "link", "set", dev, "name", "eth0")
            sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{NET}.{index + 1}/24", "dev", "eth0")
            sh("ip", "netns", "exec", ns, "ip", "link", "set", "eth0", "up")
            sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        result = {"load_average": [round(x, 2) for x in os.getloadavg()], "rates": {}}
        for gbps in [None, *args.gbps]:
            for ns in names:
                shape(ns, "eth0", gbps)
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                port = probe.getsockname()[1]
            argv = [sys.executable, os.path.abspath(__file__), "--sizes-kib", *map(str, args.sizes_kib), "--repeats",
                    str(args.repeats), "--gap-ms", str(args.gap_ms), "--port", str(port),
                    *(["--busy"] if args.busy else []), "--rank"]
            procs = [subprocess.Popen(["ip", "netns", "exec", ns, *argv, str(rank)], stdout=subprocess.PIPE, text=True)
                     for rank, ns in enumerate(names)]
            out = procs[0].communicate(timeout=600)[0]
            procs[1].wait(timeout=60)
            # The fastest of the repeats: on a loaded machine a rank's wake-up adds milliseconds at random.
            times = {int(k): min(v) for k, v in json.loads(out).items()}
            base = times.pop(4)
            transfer = {n: t - base for n, t in times.items()}
            a, b = fit(transfer)
            entry = {"round_trip_4_bytes_s": base, "transfer_s": transfer, "fit_a_s": a, "fit_rate_gbps": 8 / b / 1e9}
            if gbps is not None:
                entry["rate_eff_over_tbf"] = 8 / b / 1e9 / gbps
                entry["ideal_s"] = {n: n * 8 / (gbps * 1e9) for n in transfer}
            result["rates"]["unshaped" if gbps is None else f"{gbps:g}"] = entry
        result["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
        print(json.dumps(result, indent=1))
    finally:
        for ns in names:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
