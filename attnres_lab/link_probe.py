"""What one real link between two hosts costs a pipeline message: a probe over that link, run
before the pipelined runs it is used to predict (`attnres-lab fidelity --hosts`), never fitted to them.

Two probe ranks, one in each host's namespace, talk gloo over TCP exactly as pipeline ranks do.
For each direction (rank 0 -> 1 and 1 -> 0) and each size, the sender sends the tensor and the
receiver answers with one element; the round trip less half that of a one-element message is the
tensor's one-way time (the fastest of the repeats: on a loaded machine a wake-up adds milliseconds
at random); the sizes alternate within each repeat. Messages are `gap_s` apart, as a pipeline's
hops are (a token bucket refills between them). Then two measurements of what the model assumes
about flows that meet on the link:

    back to back   two messages of one size sent one after the other in one direction: the second
                   should arrive one wire time after the first (the simulator queues messages
                   between one pair of ranks on one link).
    both ways      both ranks send one size to each other at once: on a full-duplex link each
                   direction keeps its own rate (the simulator gives each direction its own link).

Each direction is fitted as one-way seconds = fixed + bytes x s_per_byte (least squares over the
sizes): `fixed` holds the network stack's per-message cost (system calls, wake-ups, gloo's
framing) and whatever a token bucket lets through at line rate; `s_per_byte` the rate the payload
gets, frame headers included. A round runs idle or `busy` (each rank computing in a thread
meanwhile, as pipeline ranks do): under load the stack's work waits for a core, which an idle probe
does not see. A busy round also measures the share of a core each rank's compute loses while rank
0 streams to rank 1 (the busy thread's progress against its progress with the link quiet): the
stack's CPU per packet, which a slow link spreads over the whole transfer. The ranks are driven
over stdin by the process that shapes the link between rounds (`HostBench.probe_links`): one line
per round, one result file per round.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import sys
import threading
import time
from pathlib import Path

from attnres_pp.comm.link import LinkModel

DONE = "@@link-probe-done"  # printed by rank 0 after each round's result file is written
SIZES_KIB = (16, 64, 256, 1024, 2048)
REPEATS = 9
GAP_S = 0.005
WARMUP = 2
ACK_BYTES = 4
STREAM_S = 0.4  # how long the CPU-share measurement streams (and first stays quiet)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LinkFit:
    """One direction of one link: one-way seconds = fixed_s + bytes x s_per_byte."""

    fixed_s: float
    s_per_byte: float
    residual_s: float  # the largest |fit - measured| over the probed sizes
    # False: the times did not grow with the size (a link faster than the machine's noise); the rate
    # is then a bound, the largest message's time over its bytes, and fixed_s the fastest message's
    resolved: bool = True

    @property
    def gbps(self) -> float:
        return 8.0 / self.s_per_byte / 1e9

    def message_s(self, n_bytes: int) -> float:
        return self.fixed_s + n_bytes * self.s_per_byte

    def link(self, busy_s: float = 0.0, send_share: float = 0.0, recv_share: float = 0.0) -> LinkModel:
        """The simulator's link for this direction; `busy_s`: the part of a message's fixed cost the
        simulator already prices as the sender's and receiver's own work (not the link's); the
        shares: of a core each end's stack takes from the compute while the link carries."""
        return LinkModel(gbps=self.gbps, latency_s=max(0.0, self.fixed_s - busy_s), sender_cpu_share=send_share,
                         receiver_cpu_share=recv_share)

    def to_dict(self) -> dict:
        return {"fixed_s": self.fixed_s, "s_per_byte": self.s_per_byte, "gbps": self.gbps,
                "residual_s": self.residual_s, "resolved": self.resolved}


def fit_line(points: dict[int, float]) -> tuple[float, float]:
    """Least-squares (a, b) of seconds = a + b x bytes over `points` {bytes: seconds}."""
    xs, ys = list(points), list(points.values())
    if len(xs) < 2:
        raise ValueError(f"a link fit needs at least two sizes, got {len(xs)}")
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / sum((x - mean_x) ** 2 for x in xs)
    return mean_y - slope * mean_x, slope


def fit_direction(round_trips: dict[int, float]) -> LinkFit:
    """A direction's fit from its fastest round trips {bytes: seconds} (ACK_BYTES included: the
    reply's own one-way time, half its round trip, is taken out of every size's)."""
    reply_s = round_trips[ACK_BYTES] / 2
    one_way = {n: t - reply_s for n, t in round_trips.items() if n != ACK_BYTES}
    one_way[ACK_BYTES] = reply_s
    fixed, slope = fit_line(one_way)
    resolved = slope > 0
    if not resolved:  # a link faster than the noise: bound its rate by the largest message alone
        largest = max(one_way)
        fixed, slope = max(0.0, min(one_way.values())), max(one_way[largest], 1e-9) / largest
    residual = max(abs(fixed + slope * n - t) for n, t in one_way.items())
    return LinkFit(fixed_s=max(0.0, fixed), s_per_byte=slope, residual_s=residual, resolved=resolved)


def summarize(rank0: dict, rank1: dict) -> dict:
    """One round's result from both ranks' files: a fit per direction and the two flow checks."""
    forward = fit_direction({int(n): min(t) for n, t in rank0["round_trips"].items()})
    backward = fit_direction({int(n): min(t) for n, t in rank1["round_trips"].items()})
    size = max(int(n) for n in rank0["back_to_back"])
    back_to_back = min(rank0["back_to_back"][str(size)])
    both_ways = min(max(a, b) for a, b in zip(rank0["both_ways"][str(size)], rank1["both_ways"][str(size)],
                                              strict=True))
    shares = {}
    if "cpu_share" in rank0 and "cpu_share" in rank1:
        stream = rank0["cpu_share"]
        streamed_bits = stream["messages"] * stream["bytes"] * 8
        shares = {"cpu_share": {"send": stream["share"], "recv": rank1["cpu_share"]["share"],
                                "stream_gbps": streamed_bits / max(stream["stream_s"], 1e-9) / 1e9}}
    return {**shares, "forward": forward.to_dict(), "backward": backward.to_dict(), "flow_bytes": size,
            # measured / modelled: 1 where the model's queueing and duplex assumptions hold
            "back_to_back_over_model": back_to_back / (forward.message_s(size) + size * forward.s_per_byte),
            "both_ways_over_one_way": both_ways / max(forward.message_s(size), backward.message_s(size)),
            "sizes_bytes": sorted(int(n) for n in rank0["round_trips"])}


def fit_from_dict(values: dict) -> LinkFit:
    return LinkFit(fixed_s=values["fixed_s"], s_per_byte=values["s_per_byte"], residual_s=values["residual_s"],
                   resolved=values.get("resolved", True))


def _round(rank: int, sizes: list[int], repeats: int, gap_s: float) -> dict:
    """One probe round between the two ranks (gloo initialised): this rank's own timings."""
    import torch
    import torch.distributed as dist

    peer = 1 - rank
    ack = torch.zeros(ACK_BYTES // 4)
    round_trips: dict[int, list[float]] = {}
    payloads = {n_bytes: torch.zeros(max(1, n_bytes // 4)) for n_bytes in [ACK_BYTES, *sizes]}
    for sender in (0, 1):
        # Sizes alternate within each repeat, so that drift of the machine's load reaches every size alike.
        for index in range(repeats + WARMUP):
            for n_bytes, payload in payloads.items():
                time.sleep(gap_s)
                if rank == sender:
                    start = time.perf_counter()
                    dist.send(payload, peer)
                    dist.recv(ack, peer)
                    if index >= WARMUP:
                        round_trips.setdefault(n_bytes, []).append(time.perf_counter() - start)
                else:
                    dist.recv(payload, peer)
                    dist.send(ack, peer)
    size = max(sizes)
    first, second = torch.zeros(size // 4), torch.zeros(size // 4)
    back_to_back: list[float] = []
    both_ways: list[float] = []
    for index in range(repeats + WARMUP):
        time.sleep(gap_s)
        # Two messages in a row from rank 0: the time until rank 1 has both, less the reply's way.
        if rank == 0:
            start = time.perf_counter()
            dist.send(first, 1)
            dist.send(second, 1)
            dist.recv(ack, 1)
            if index >= WARMUP:
                back_to_back.append(time.perf_counter() - start - _half(round_trips))
        else:
            dist.recv(first, 0)
            dist.recv(second, 0)
            dist.send(ack, 0)
        time.sleep(gap_s)
        dist.barrier()
        start = time.perf_counter()
        out, into = torch.zeros(size // 4), torch.zeros(size // 4)
        works = [dist.isend(out, peer), dist.irecv(into, peer)]
        for work in works:
            work.wait()
        if index >= WARMUP:
            both_ways.append(time.perf_counter() - start)
    return {"round_trips": round_trips, "back_to_back": {str(size): back_to_back},
            "both_ways": {str(size): both_ways}}


@contextlib.contextmanager
def _busy(on: bool):
    """With `on`, a thread of this rank multiplies matrices meanwhile, as a pipeline rank computes
    while its messages travel: the network stack's work then waits for a core as it does in a run.
    Yields the thread's progress counter ([products done]; None when off)."""
    import torch

    stop = threading.Event()
    done = [0]

    def compute() -> None:
        a = torch.randn(128, 128)
        while not stop.is_set():
            a = torch.tanh(a @ a)
            done[0] += 1

    worker = threading.Thread(target=compute, daemon=True) if on else None
    if worker is not None:
        worker.start()
    try:
        yield done if on else None
    finally:
        stop.set()
        if worker is not None:
            worker.join(timeout=10)


def _cpu_share(rank: int, progress: list[int], size: int) -> dict:
    """The share of a core each rank's busy thread loses while rank 0 streams `size`-byte messages
    to rank 1, against its progress with the link quiet: the network stack's CPU (system calls,
    gloo's threads, the kernel's per-packet work and the qdisc's timers) taken from the compute."""
    import torch
    import torch.distributed as dist

    def rate_over(run) -> tuple[float, float]:
        """(the busy thread's products per second while `run` runs, its seconds)."""
        start_count, start = progress[0], time.perf_counter()
        run()
        seconds = time.perf_counter() - start
        return (progress[0] - start_count) / seconds, seconds

    dist.barrier()
    quiet, _ = rate_over(lambda: time.sleep(STREAM_S))
    payload = torch.zeros(size // 4)
    count = torch.zeros(1, dtype=torch.int64)
    if rank == 0:  # as many messages as fill STREAM_S at the rate one takes alone
        started = time.perf_counter()
        dist.send(payload, 1)
        dist.recv(count, 1)  # the answer carries nothing: the round trip times one message
        count[0] = max(4, min(400, int(STREAM_S / max(time.perf_counter() - started, 1e-6))))
    else:
        dist.recv(payload, 0)
        dist.send(count, 0)
    dist.broadcast(count, 0)
    dist.barrier()

    def stream() -> None:
        for _ in range(int(count)):
            if rank == 0:
                dist.send(payload, 1)
            else:
                dist.recv(payload, 0)
        dist.barrier()

    loaded, stream_s = rate_over(stream)
    return {"share": max(0.0, 1.0 - loaded / quiet) if quiet > 0 else 0.0, "messages": int(count),
            "bytes": size, "stream_s": stream_s}


def _half(round_trips: dict[int, list[float]]) -> float:
    return min(round_trips[ACK_BYTES]) / 2 if round_trips.get(ACK_BYTES) else 0.0


def rank_main(rank: int, address: str, port: int, timeout_s: float) -> int:
    """A probe rank: rank 0 reads one JSON line per round from stdin ({"sizes", "repeats", "gap_s",
    "busy", "out"}: out a path prefix, each rank writes `<out>.<rank>.json`) and passes it to rank 1; an
    empty line ends both. Rank 0 prints DONE after each round."""
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{address}:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        while True:
            length = torch.zeros(1, dtype=torch.int64)
            if rank == 0:
                line = sys.stdin.readline().strip().encode()
                length[0] = len(line)
            dist.broadcast(length, 0)
            if int(length) == 0:
                return 0
            text = torch.frombuffer(bytearray(line), dtype=torch.uint8) if rank == 0 else torch.zeros(
                int(length), dtype=torch.uint8)
            dist.broadcast(text, 0)
            request = json.loads(bytes(text.tolist()).decode())
            with _busy(bool(request.get("busy"))) as progress:
                result = _round(rank, [int(n) for n in request["sizes"]], int(request["repeats"]),
                                float(request["gap_s"]))
                if progress is not None:
                    result["cpu_share"] = _cpu_share(rank, progress, max(int(n) for n in request["sizes"]))
            Path(f"{request['out']}.{rank}.json").write_text(json.dumps(result))
            dist.barrier()
            if rank == 0:
                print(DONE, flush=True)
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="a link-probe rank (started by attnres-lab fidelity --hosts)")
    parser.add_argument("--rank", type=int, choices=(0, 1), required=True)
    parser.add_argument("--address", required=True, help="rank 0's address (its host's)")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds any collective may wait")
    args = parser.parse_args(argv)
    return rank_main(args.rank, args.address, args.port, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
