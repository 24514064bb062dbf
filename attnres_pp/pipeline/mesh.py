"""The 2-D rank layout of a data-parallel x pipeline-parallel run and the collectives over its axes.

`D` replicas of a `P`-rank pipeline: global rank `rank = dp_rank * P + pp_rank`, the row-major
layout of a `(D, P)` mesh with dimensions ("dp", "pp"). Three axes carry collectives:
    "dp"     the D ranks with the same pp_rank (they hold the same chunks): gradient averaging
    "pp"     the P ranks of one replica: the global gradient norm
    "world"  every rank: MSAR's tied stream convolutions, which every rank holds

Two implementations of `Collectives`, both explicit objects (no global state):
- `MeshCollectives`: torch.distributed over a DeviceMesh. DeviceMesh rather than hand-made groups
  because it is torch's own N-D layout (the one torchtitan and DCP understand): named dimensions, one
  call that creates every subgroup on every rank in the order the backend requires, and the layout
  convention (row-major) in one place.
- `ThreadCollectives`: ranks that are threads of one process (the in-process launcher). Sums run in
  member order and every member copies the same result, so replicas stay bitwise identical, as
  gloo's ring all-reduce keeps them.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Protocol

import torch

AXES = ("dp", "pp", "world")


@dataclass(frozen=True)
class RankCoords:
    """Where global rank `rank` sits in a run of `data_parallel` replicas of `stages` ranks."""

    rank: int
    data_parallel: int
    stages: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside 0..{self.world_size - 1} "
                             f"(data_parallel {self.data_parallel} x stages {self.stages})")

    @property
    def world_size(self) -> int:
        return self.data_parallel * self.stages

    @property
    def dp_rank(self) -> int:
        return self.rank // self.stages

    @property
    def pp_rank(self) -> int:
        return self.rank % self.stages

    def global_rank(self, pp_rank: int) -> int:
        """The global rank of `pp_rank` in this rank's replica (its pipeline peers)."""
        return self.dp_rank * self.stages + pp_rank

    def axis_members(self, axis: str) -> list[int]:
        """Global ranks of this rank's group along `axis`, in group order."""
        if axis == "dp":
            return [d * self.stages + self.pp_rank for d in range(self.data_parallel)]
        if axis == "pp":
            return [self.global_rank(p) for p in range(self.stages)]
        if axis == "world":
            return list(range(self.world_size))
        raise ValueError(f"axis {axis!r} is unknown: choose one of {', '.join(AXES)}")


class Collectives(Protocol):
    def all_reduce(self, tensor: torch.Tensor, axis: str) -> None:
        """Sum `tensor` in place over this rank's group along `axis` ("dp", "pp" or "world")."""


class MeshCollectives:
    """Collectives over a ("dp", "pp") DeviceMesh of the default process group (initialised first)."""

    def __init__(self, coords: RankCoords, device_type: str) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        self.coords = coords
        self.mesh = init_device_mesh(device_type, (coords.data_parallel, coords.stages), mesh_dim_names=("dp", "pp"))
        if tuple(self.mesh.get_coordinate() or ()) != (coords.dp_rank, coords.pp_rank):
            raise RuntimeError(f"rank {coords.rank}: the device mesh puts it at {self.mesh.get_coordinate()}, "
                               f"expected (dp, pp) = ({coords.dp_rank}, {coords.pp_rank})")

    def all_reduce(self, tensor: torch.Tensor, axis: str) -> None:
        import torch.distributed as dist

        if len(self.coords.axis_members(axis)) == 1:
            return
        group = None if axis == "world" else self.mesh.get_group(axis)
        dist.all_reduce(tensor, group=group)


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


class ThreadCollectives:
    """Collectives for ranks that run as threads of one process; build them with `thread_collectives`."""

    def __init__(self, coords: RankCoords, groups: dict[str, tuple[_ThreadGroup, int]]) -> None:
        self.coords = coords
        self._groups = groups

    def all_reduce(self, tensor: torch.Tensor, axis: str) -> None:
        group, index = self._groups[axis]
        if group.size > 1:
            group.all_reduce(index, tensor)


def thread_collectives(data_parallel: int, stages: int, timeout_s: float) -> list[ThreadCollectives]:
    """One `ThreadCollectives` per global rank of a (data_parallel, stages) layout, wired together.
    A member that never arrives makes the others raise threading.BrokenBarrierError after timeout_s."""
    coords = [RankCoords(rank, data_parallel, stages) for rank in range(data_parallel * stages)]
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
