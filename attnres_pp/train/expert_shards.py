"""Checkpoints of expert-parallel ranks (`pipeline.expert_parallel`): a rank holds rows
`[first, first + E / EP)` of each routed-expert tensor `[E, ...]` and of its AdamW moments, but a
checkpoint holds them whole, under the whole model's names and shapes, so that it loads into any EP
and any D (and into one process, or `attnres-pp generate`).

- Saving: the EP ranks of a group gather their rows into the whole tensor (`whole_expert_state`,
  an all-gather over "ep" made of one all-to-all); every rank of the group then holds the same
  whole tensor, which DCP writes once, as it writes the replicas' copies.
- Loading: each expert target is read whole and this rank keeps its rows (`whole_expert_targets`).
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


def whole_expert_state(state: dict, rows: dict[str, slice], collectives: Collectives, ep_size: int) -> dict:
    """`state` with every expert slice (`rows`: parameter name -> rows held, `expert_parallel.expert_rows`)
    and its moments made whole. A collective over "ep": every member calls it with the same keys,
    gathered in sorted order."""
    out = dict(state)
    for key in sorted(state):
        value = state[key]
        if _held(key, value, rows) is None:
            continue
        n_rows = value.shape[0]
        # An all-gather as an all-to-all: the same rows to every member, theirs back in ep order.
        out[key] = collectives.all_to_all(value.detach().repeat(ep_size, *[1] * (value.dim() - 1)),
                                          [n_rows] * ep_size, [n_rows] * ep_size, "ep")
    return out


def whole_expert_targets(state: dict, rows: dict[str, slice], n_experts: int) -> Callable[[dict], dict]:
    """Replace, in place, each expert target of a checkpoint load by an empty whole tensor of
    `n_experts` rows; returns the function that, after the load, gives back this rank's rows."""
    held: dict[str, slice] = {}
    for key, value in list(state.items()):
        rows_held = _held(key, value, rows)
        if rows_held is not None:
            held[key] = rows_held
            state[key] = value.new_empty((n_experts, *value.shape[1:]))

    def restore(loaded: dict) -> dict:
        for key, rows_held in held.items():
            loaded[key] = loaded[key][rows_held]
        return loaded

    return restore
