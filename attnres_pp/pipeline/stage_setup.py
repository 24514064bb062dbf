"""What every rank of a pipelined run sets up the same way: the lowered, validated schedule, the
check that a split works (run by the driver before any worker starts) and the process group."""

from __future__ import annotations

import datetime
import os
import socket

import torch

from attnres_pp.comm.partition import Partition, make_partition
from attnres_pp.pipeline.config import PipelineConfig
from attnres_pp.schedule.ir import Schedule
from attnres_pp.schedule.passes import insert_comm
from attnres_pp.schedule.schedules import build_schedule, schedule_placement
from attnres_pp.schedule.validate import validate


def lowered_schedule(pipe: PipelineConfig, n_microbatches: int) -> Schedule:
    """The validated, communication-lowered schedule of a run (identical on every rank); unless the
    run is pinned to gloo's rules, also proven deadlock-free under NCCL's (validate_nccl)."""
    schedule = insert_comm(build_schedule(pipe.schedule, pipe.stages, pipe.virtual, n_microbatches))
    validate(schedule, p2p_semantics="gloo" if pipe.p2p_semantics == "gloo" else "nccl")
    return schedule


def run_partition(n_layers: int, pipe: PipelineConfig) -> Partition:
    """The run's chunks, placed on ranks as its schedule declares."""
    return make_partition(n_layers, pipe.stages, pipe.virtual, pipe.layer_counts,
                          placement=schedule_placement(pipe.schedule))


def check_split(n_layers: int, pipe: PipelineConfig, n_microbatches: int) -> Partition:
    """Raise ValueError (before any worker starts) if the layers do not split into the run's chunks
    or the schedule does not validate; returns the partition."""
    partition = run_partition(n_layers, pipe)
    lowered_schedule(pipe, n_microbatches)
    return partition


def interface_of(address: str) -> str | None:
    """The name of this machine's network interface that holds IPv4 `address`, or None."""
    import fcntl
    import struct

    siocgifaddr = 0x8915  # Linux ioctl: an interface's IPv4 address
    for _index, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            try:
                packed = fcntl.ioctl(probe.fileno(), siocgifaddr, struct.pack("256s", name[:15].encode()))
            except OSError:  # no IPv4 address on it
                continue
        if socket.inet_ntoa(packed[20:24]) == address:
            return name
    return None


def bind_to_address(address: str) -> str:
    """Make this process's gloo and NCCL sockets use the interface that holds `address` (the node's
    address as the cluster knows it): without this gloo takes the address the host name resolves
    to, which is loopback on many hosts (Debian's 127.0.1.1) and in every network namespace, and
    the full mesh then fails to connect. ATTNRES_PP_SOCKET_IFNAME names the interface instead (as
    GLOO_SOCKET_IFNAME would). Returns the interface's name; ValueError if none has the address."""
    name = os.environ.get("ATTNRES_PP_SOCKET_IFNAME") or interface_of(address)
    if name is None:
        raise ValueError(f"no network interface of this host holds {address}, the address the cluster reports "
                         "for this node: start the node with --node-ip-address set to one of its own addresses")
    os.environ["GLOO_SOCKET_IFNAME"] = name
    os.environ["NCCL_SOCKET_IFNAME"] = name
    return name


def init_process_group(init_method: str, rank: int, world_size: int, timeout_s: float,
                       device: str = "cpu") -> tuple[str, torch.device]:
    """Join the run's process group on the device the launch layer decided (`launch.resolve`): "cuda" is
    nccl with this rank's own GPU (LOCAL_RANK when set: the Ray launcher shows the ranks of a node
    all its GPUs and names each rank's own; otherwise local processes take GPU `rank` (their
    global rank) of the node), "cpu" is gloo. Every collective and p2p op times out after
    timeout_s. Ranks on several hosts call `bind_to_address` first."""
    import torch.distributed as dist

    if device not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r} is invalid here: the driver passes 'cpu' or 'cuda'")
    backend = "nccl" if device == "cuda" else "gloo"
    rank_device = torch.device("cpu")
    if device == "cuda":  # LOCAL_RANK (torchrun's and Ray Train's convention): its GPU among the node's
        local = os.environ.get("LOCAL_RANK")
        torch.cuda.set_device(int(local) if local is not None else rank % torch.cuda.device_count())
        rank_device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    if device == "cuda":
        # Initialise the NCCL communicator with every rank now: the first batched p2p call may
        # involve only some ranks, which torch documents as undefined behaviour for a first call.
        dist.all_reduce(torch.zeros(1, device=rank_device))
    return backend, rank_device
