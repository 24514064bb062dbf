"""Checkpoints of expert-parallel ranks (`pipeline.expert_parallel`): a rank holds rows
`[first, first + E / EP)` of each routed-expert tensor `[E, ...]` and of its AdamW moments, but a
checkpoint holds them under the whole model's names and shapes, so that it loads into any EP and
any D (and into one process, or `attnres-pp generate`).

- Rank processes (a torch.distributed group with the "ep" mesh dimension, `mesh.MeshCollectives`):
  each slice is handed to DCP as a DTensor `Shard(0)` over the rank's EP group, so DCP writes each
  rank's rows as one chunk of the global tensor (the replicas' equal chunks once) and, on load,
  reads just the rows the rank holds, at whatever EP wrote them. Nothing is gathered.
- Thread ranks (rank 0 writes every rank's state as one process's, `shard_saves`): the EP group
  gathers its slices into the whole tensor (an all-to-all over "ep"), and a rank loading reads the
  whole tensor and keeps its rows.
- Under `--dp-shard fsdp` with D > EP a slice is itself FSDP2-sharded over "edp" (`train.fsdp`): a
  save writes each rank's shard as it is, a DTensor over the stage's (ep, edp) ranks placed
  `(Shard(0), Shard(0))` (rows split over ep, then each slice's over edp by torch.chunk, as FSDP2
  splits it), so nothing is gathered; a load reads the slice's rows as above and keeps its own edp
  rows, as a DTensor of the parameter's own layout. So the checkpoint is the same global tensors
  whatever D, EP or sharding wrote it, and loads into any of them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from attnres_pp.pipeline.mesh import Collectives


def _rows_of_key(key: str, rows: dict[str, slice]) -> slice | None:
    """The rows held of checkpoint key `key` (a parameter, or `optim.<parameter>.<field>`), or None."""
    if key in rows:
        return rows[key]
    if key.startswith("optim."):
        return rows.get(key[len("optim."):].rsplit(".", 1)[0])
    return None


def _held(key: str, value, rows: dict[str, slice]) -> slice | None:
    """The held rows when `value` is a slice of an expert tensor (AdamW's 0-dim step is not)."""
    held = _rows_of_key(key, rows)
    if held is None or not torch.is_tensor(value) or value.dim() == 0:
        return None
    return held


def ep_mesh(collectives: Collectives | None):
    """The 1-D device mesh of this rank's EP group, or None (thread ranks)."""
    expert_mesh = getattr(collectives, "expert_mesh", None)
    return None if expert_mesh is None else expert_mesh["ep"]


def whole_expert_state(state: dict, rows: dict[str, slice], collectives: Collectives, ep_size: int) -> dict:
    """`state` with every expert slice (`rows`: parameter name -> rows held, `expert_parallel.expert_rows`)
    and its moments in the whole tensor's shape: DTensor shards over the EP group (rank processes), or
    gathered whole (thread ranks: a collective over "ep", every member calling it with the same keys)."""
    mesh = ep_mesh(collectives)
    out = dict(state)
    for key in sorted(state):
        value = state[key]
        if _held(key, value, rows) is None:
            continue
        if mesh is not None:
            from torch.distributed.tensor import DTensor, Shard

            if _is_dtensor(value):  # FSDP2's shard over edp: written as it is
                out[key] = _over_ep_and_edp(value, collectives.expert_mesh, ep_size)
            else:
                out[key] = DTensor.from_local(value.detach(), mesh, [Shard(0)], run_check=False)
            continue
        value = _whole_slice(value)
        n_rows = value.shape[0]
        # An all-gather as an all-to-all: the same rows to every member, theirs back in ep order.
        out[key] = collectives.all_to_all(value.detach().repeat(ep_size, *[1] * (value.dim() - 1)),
                                          [n_rows] * ep_size, [n_rows] * ep_size, "ep")
    return out


def _over_ep_and_edp(shard, expert_mesh, ep_size: int):
    """FSDP2's edp shard of an expert slice as a shard of the whole tensor [E, ...]: a DTensor over
    this stage's ranks arranged (ep, edp), `(Shard(0), Shard(0))`: the rows split over ep first (the
    slices), then each slice's over edp (torch.chunk's rows, FSDP2's). The expert mesh is ("edp",
    "ep", ...) with ep inner, so this mesh is its transpose; it only places the shards (DCP reads the
    coordinates), so it creates no process group."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    coordinate = expert_mesh.get_coordinate()
    ranks = expert_mesh.mesh[(slice(None), slice(None), *coordinate[2:])].transpose(0, 1)
    mesh = DeviceMesh(expert_mesh.device_type, ranks, mesh_dim_names=("ep", "edp"), _init_backend=False)
    shape = torch.Size((shard.shape[0] * ep_size, *shard.shape[1:]))
    return DTensor.from_local(shard.to_local().detach(), mesh, [Shard(0), Shard(0)], run_check=False,
                              shape=shape, stride=_contiguous_strides(shape))


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def expert_targets(rows: dict[str, slice], n_experts: int, collectives: Collectives | None
                   ) -> Callable[[dict], Callable[[dict], dict]]:
    """`shards.load_shard`'s `layout_targets`: replace, in place, each expert target of a load by one
    of the whole tensor's shape (`n_experts` rows): a DTensor shard over the EP group (rank processes)
    or an empty whole tensor (thread ranks); returns the function that, after the load, gives back
    the rows this rank holds as plain tensors."""
    mesh = ep_mesh(collectives)

    def replace(state: dict) -> Callable[[dict], dict]:
        held: dict[str, slice] = {}
        edp_layouts: dict[str, tuple] = {}  # the FSDP2 layout over edp of a sharded slice's targets
        for key, value in list(state.items()):
            rows_held = _held(key, value, rows)
            if rows_held is None:
                continue
            held[key] = rows_held
            if _is_dtensor(value):
                edp_layouts[key] = (value.device_mesh, value.placements)
            whole_slice = torch.empty(value.shape, dtype=value.dtype, device=_local(value).device)
            if mesh is not None:
                from torch.distributed.tensor import DTensor, Shard

                state[key] = DTensor.from_local(whole_slice, mesh, [Shard(0)], run_check=False)
            else:
                state[key] = value.new_empty((n_experts, *value.shape[1:]))

        def restore(loaded: dict) -> dict:
            for key, rows_held in held.items():
                loaded[key] = loaded[key].to_local() if mesh is not None else loaded[key][rows_held]
                if key in edp_layouts:
                    from torch.distributed.tensor import distribute_tensor

                    # No communication: each member keeps its own chunk of the slice it read.
                    loaded[key] = distribute_tensor(loaded[key], *edp_layouts[key], src_data_rank=None)
            return loaded

        return restore

    return replace


def _is_dtensor(value) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


def _local(value: torch.Tensor) -> torch.Tensor:
    return value.to_local() if _is_dtensor(value) else value


def _whole_slice(value: torch.Tensor) -> torch.Tensor:
    """A slice FSDP2 shards over edp, all-gathered over edp (a collective of its members); a plain one as is."""
    return value.full_tensor() if _is_dtensor(value) else value
