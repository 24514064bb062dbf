"""The 3-D rank layout of a data-parallel x pipeline-parallel x tensor-parallel run and the
collectives over its axes.

`D` replicas of a `P`-rank pipeline whose chunks are each shared by `T` tensor-parallel ranks:
global rank `rank = (dp_rank * P + pp_rank) * T + tp_rank`, the row-major layout of a `(D, P, T)`
mesh with dimensions ("dp", "pp", "tp"). tp is innermost, so a tp group is T consecutive ranks (one
node's, as the launchers place them; docs/spec.md section 10). At T = 1 it is the (D, P) layout
`rank = dp_rank * P + pp_rank`. Four axes carry collectives:
    "dp"     the D ranks with the same pp_rank and tp_rank (they hold the same shards): gradient averaging
    "pp"     the P ranks of one replica with the same tp_rank: the global gradient norm
    "tp"     the T ranks sharing one chunk: the partial gradients of what they hold replicated
    "world"  every rank: MSAR's tied stream convolutions, which every rank holds
    "embed"  the first and the last pp rank of one replica with the same tp_rank (Megatron's embedding
             group): the two copies of a tied embedding matrix, whose gradients they sum; every
             other rank is a group of its own (it holds no copy and never calls it)
Under expert parallelism (EP > 1, docs/spec.md section 12) the dp axis is read as (D / EP, EP),
row-major: `ep_rank = dp_rank % EP`, and two more axes carry collectives:
    "ep"     the EP ranks with the same pp_rank and tp_rank and the same dp_rank // EP: they share
             each MoE sublayer's routed experts, and tokens reach them by all-to-all
    "edp"    the D / EP ranks with the same pp_rank, tp_rank and ep_rank: they hold the same experts,
             whose gradients they sum

Two implementations of `Collectives`, both explicit objects (no global state):
- `MeshCollectives`: torch.distributed over a DeviceMesh. DeviceMesh rather than hand-made groups
  because it is torch's own N-D layout (the one torchtitan, DCP and the DTensor tensor-parallel API
  understand): named dimensions, one call that creates every subgroup on every rank in the order the
  backend requires, and the layout convention (row-major) in one place.
- `ThreadCollectives`: ranks that are threads of one process (the in-process launcher). Sums run in
  member order and every member copies the same result, so replicas stay bitwise identical, as
  gloo's ring all-reduce keeps them.
"""

from __future__ import annotations

import datetime
import threading
from dataclasses import dataclass
from typing import Protocol

import torch

AXES = ("dp", "pp", "tp", "world", "ep", "edp", "embed")


@dataclass(frozen=True)
class RankCoords:
    """Where global rank `rank` sits in a run of `data_parallel` replicas of `stages` ranks, each
    chunk shared by `tensor_parallel` ranks, each stage's experts shared by `expert_parallel` replicas."""

    rank: int
    data_parallel: int
    stages: int
    tensor_parallel: int = 1
    expert_parallel: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            layout = f"data_parallel {self.data_parallel} x stages {self.stages}"
            if self.tensor_parallel > 1:
                layout += f" x tensor_parallel {self.tensor_parallel}"
            raise ValueError(f"rank {self.rank} is outside 0..{self.world_size - 1} ({layout})")
        if self.expert_parallel < 1 or self.data_parallel % self.expert_parallel:
            raise ValueError(f"expert_parallel {self.expert_parallel} does not divide data_parallel "
                             f"{self.data_parallel}: EP groups are taken along the data-parallel axis")

    @property
    def world_size(self) -> int:
        return self.data_parallel * self.stages * self.tensor_parallel

    @property
    def dp_rank(self) -> int:
        return self.rank // (self.stages * self.tensor_parallel)

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tensor_parallel % self.stages

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tensor_parallel

    @property
    def ep_rank(self) -> int:
        return self.dp_rank % self.expert_parallel

    def _rank_at(self, dp_rank: int, pp_rank: int, tp_rank: int) -> int:
        return (dp_rank * self.stages + pp_rank) * self.tensor_parallel + tp_rank

    def global_rank(self, pp_rank: int) -> int:
        """The global rank of `pp_rank` in this rank's replica with this rank's tp_rank (its pipeline
        peers: a hop pairs (d, p, t) with (d, p + 1, t))."""
        return self._rank_at(self.dp_rank, pp_rank, self.tp_rank)

    def axis_members(self, axis: str) -> list[int]:
        """Global ranks of this rank's group along `axis`, in group order."""
        if axis == "dp":
            return [self._rank_at(d, self.pp_rank, self.tp_rank) for d in range(self.data_parallel)]
        if axis == "pp":
            return [self.global_rank(p) for p in range(self.stages)]
        if axis == "tp":
            return [self._rank_at(self.dp_rank, self.pp_rank, t) for t in range(self.tensor_parallel)]
        if axis == "world":
            return list(range(self.world_size))
        if axis == "embed":
            ends = (0, self.stages - 1)
            return [self.global_rank(p) for p in ends] if self.stages > 1 and self.pp_rank in ends else [self.rank]
        ep = self.expert_parallel
        if axis == "ep":
            first = self.dp_rank - self.ep_rank
            return [self._rank_at(first + e, self.pp_rank, self.tp_rank) for e in range(ep)]
        if axis == "edp":
            return [self._rank_at(d, self.pp_rank, self.tp_rank) for d in range(self.ep_rank, self.data_parallel, ep)]
        raise ValueError(f"axis {axis!r} is unknown: choose one of {', '.join(AXES)}")


class Collectives(Protocol):
    def all_reduce(self, tensor: torch.Tensor, axis: str) -> None:
        """Sum `tensor` in place over this rank's group along `axis` ("dp", "pp", "tp" or "world")."""

    def all_to_all(self, send: torch.Tensor, send_splits: list[int], recv_splits: list[int], axis: str) -> torch.Tensor:
        """Rows `send_splits[j]` of `send` (in order) to member j of this rank's group along `axis`;
        returns the rows every member sent here, member by member (`recv_splits[j]` from member j)."""


class MeshCollectives:
    """Collectives over a ("dp", "pp") DeviceMesh of the default process group (initialised first),
    or a ("dp", "pp", "tp") one when `coords.tensor_parallel` > 1; `mesh["tp"]` is then the 1-D mesh
    the DTensor tensor-parallel API shards each layer over (`pipeline.tensor_parallel`)."""

    def __init__(self, coords: RankCoords, device_type: str, timeout_s: float | None = None, *,
                 embedding_group: bool = False) -> None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        self.coords, self.timeout_s = coords, timeout_s
        if dist.get_world_size() != coords.world_size:
            raise ValueError(f"T x P x D = {coords.tensor_parallel} x {coords.stages} x {coords.data_parallel} = "
                             f"{coords.world_size} is not the {dist.get_world_size()} ranks of the process group: "
                             "the mesh (dp, pp, tp) must use every rank")
        shape, names = (coords.data_parallel, coords.stages), ("dp", "pp")
        expected = (coords.dp_rank, coords.pp_rank)
        if coords.tensor_parallel > 1:  # at T = 1 the mesh stays 2-D, as DCP's and FSDP2's plans expect it
            shape, names = (*shape, coords.tensor_parallel), (*names, "tp")
            expected = (*expected, coords.tp_rank)
        self.mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
        if tuple(self.mesh.get_coordinate() or ()) != expected:
            raise RuntimeError(f"rank {coords.rank}: the device mesh puts it at {self.mesh.get_coordinate()}, "
                               f"expected {names} = {expected}")
        # Expert parallelism reads dp as (D / EP, EP): the same row-major layout, so a second mesh of
        # the same ranks whose "ep" and "edp" dimensions are the groups of those axes.
        self.expert_mesh = None
        if coords.expert_parallel > 1:
            ep = coords.expert_parallel
            self.expert_mesh = init_device_mesh(device_type, (coords.data_parallel // ep, ep, *shape[1:]),
                                                mesh_dim_names=("edp", "ep", *names[1:]))
        self.embed_group = self._embedding_group(timeout_s) if embedding_group else None

    def _embedding_group(self, timeout_s: float | None):
        """The "embed" group of this rank (None where it is a group of one). At P = 2 it is the pp
        group; otherwise every rank creates every replica's group in the same order (`new_group` is
        collective over the whole process group) and keeps its own."""
        import torch.distributed as dist

        c = self.coords
        if c.stages == 1:
            return None
        if c.stages == 2:
            return self.mesh.get_group("pp")
        mine = None
        timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
        for d in range(c.data_parallel):
            for t in range(c.tensor_parallel):
                members = [c._rank_at(d, 0, t), c._rank_at(d, c.stages - 1, t)]
                group = dist.new_group(members, timeout=timeout)
                if c.rank in members:
                    mine = group
        return mine

    def _group(self, axis: str):
        if axis == "world":
            return None
        if axis == "embed":
            if self.embed_group is None:
                raise RuntimeError(f"rank {self.coords.rank}: no embedding group was made "
                                   "(MeshCollectives(embedding_group=True) makes it)")
            return self.embed_group
        return (self.expert_mesh if axis in ("ep", "edp") else self.mesh).get_group(axis)

    def all_reduce(self, tensor: torch.Tensor, axis: str) -> None:
        import torch.distributed as dist

        if len(self.coords.axis_members(axis)) == 1:
            return
        dist.all_reduce(tensor, group=self._group(axis))

    def all_to_all(self, send: torch.Tensor, send_splits: list[int], recv_splits: list[int], axis: str) -> torch.Tensor:
        import torch.distributed as dist

        if len(self.coords.axis_members(axis)) == 1:
            return send
        recv = send.new_empty((sum(recv_splits), *send.shape[1:]))
        work = dist.all_to_all_single(recv, send.contiguous(), recv_splits, send_splits, group=self._group(axis),
                                      async_op=True)
        # The subgroups carry the backend's default timeout, not the run's: the wait is bounded here.
        if self.timeout_s is None:
            work.wait()
        else:
            work.wait(timeout=datetime.timedelta(seconds=self.timeout_s))
        return recv


class _ThreadGroup:
    """One group of thread-ranks: members post their tensors, then all read the same sum."""

    def __init__(self, size: int, timeout_s: float) -> None:
        self.size = size
        self.slots: list[torch.Tensor | None] = [None] * size
        self.barrier = threading.Barrier(size, timeout=timeout_s)

    def all_reduce(self, index: int, tensor: torch.Tensor) -> None:
        self.slots[index] = tensor
        self.barrier.wait()
        total = self.slots[0].clone()
        for other in self.slots[1:]:
            total += other
        self.barrier.wait()  # every member has read every slot before anyone overwrites its own
        tensor.copy_(total)

    def all_to_all(self, index: int, send: torch.Tensor, send_splits: list[int]) -> torch.Tensor:
        self.slots[index] = send.split(send_splits)
        self.barrier.wait()
        recv = torch.cat([pieces[index].to(send.device) for pieces in self.slots])
        self.barrier.wait()
        return recv


class ThreadCollectives:
    """Collectives for ranks that run as threads of one process; build them with `thread_collectives`."""

    def __init__(self, coords: RankCoords, groups: dict[str, tuple[_ThreadGroup, int]]) -> None:
        self.coords = coords
        self._groups = groups

    def all_reduce(self, tensor: torch.Tensor, axis: str) -> None:
        group, index = self._groups[axis]
        if group.size > 1:
            group.all_reduce(index, tensor)
            if axis == "tp":  # a sum of partial gradients: tp traffic no dispatcher sees
                from attnres_pp.pipeline.tp_bytes import count_outside_dispatch

                count_outside_dispatch(2 * (group.size - 1) * tensor.numel() * tensor.element_size() // group.size,
                                       c10d_op=False)

    def all_to_all(self, send: torch.Tensor, send_splits: list[int], recv_splits: list[int], axis: str) -> torch.Tensor:
        group, index = self._groups[axis]
        if group.size == 1:
            return send
        recv = group.all_to_all(index, send, send_splits)
        if recv.shape[0] != sum(recv_splits):
            raise RuntimeError(f"all-to-all over {axis}: {recv.shape[0]} rows arrived, {sum(recv_splits)} expected")
        return recv


def thread_collectives(data_parallel: int, stages: int, timeout_s: float,
                       tensor_parallel: int = 1, expert_parallel: int = 1) -> list[ThreadCollectives]:
    """One `ThreadCollectives` per global rank of a (data_parallel, stages, tensor_parallel) layout
    (with `expert_parallel` EP ranks along dp sharing experts), wired together. A member that never
    arrives makes the others raise threading.BrokenBarrierError after timeout_s."""
    world = data_parallel * stages * tensor_parallel
    coords = [RankCoords(rank, data_parallel, stages, tensor_parallel, expert_parallel) for rank in range(world)]
    shared: dict[tuple[str, tuple[int, ...]], _ThreadGroup] = {}
    out = []
    for c in coords:
        groups = {}
        for axis in AXES:
            members = tuple(c.axis_members(axis))
            group = shared.setdefault((axis, members), _ThreadGroup(len(members), timeout_s))
            groups[axis] = (group, members.index(c.rank))
        out.append(ThreadCollectives(c, groups))
    return out
