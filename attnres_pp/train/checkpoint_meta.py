"""Reading a checkpoint's meta.json, bounded: the one reader `checkpoint` (discovery, resume) and
`shards` (the model a checkpoint's tensors must match) share, kept apart so neither imports the other."""

from __future__ import annotations

import json
from pathlib import Path

from attnres_pp.model.config import LEGACY_RECIPE
from attnres_pp.train.metadata_pickle import CheckpointRefused, brief, read_regular_file

# meta.json holds a run's records (a loss and a time per step): a million steps is tens of MB.
MAX_META_BYTES = 256 << 20


def read_meta(step_dir: str | Path) -> dict:
    """The checkpoint's meta.json, refused (CheckpointRefused, a ValueError) unless it is a regular file
    under MAX_META_BYTES holding a JSON object: a FIFO there, a huge file or a nesting deep enough to
    exhaust the parser's recursion is one error line, not a hang or a traceback."""
    path = Path(step_dir) / "meta.json"
    data = read_regular_file(path, MAX_META_BYTES, str(path))
    try:
        meta = json.loads(data)
    except (ValueError, RecursionError, MemoryError) as error:
        raise CheckpointRefused(f"{path} is not valid JSON ({type(error).__name__}: {brief(str(error))}); "
                                "load an earlier checkpoint, or retrain") from None
    if not isinstance(meta, dict):
        raise CheckpointRefused(f"{path} does not hold a JSON object")
    check_meta_fields(meta, str(path))
    model = meta["config"].get("model")
    if isinstance(model, dict):  # written before the layer recipe was configurable: it was trained with this one
        meta["config"]["model"] = {**LEGACY_RECIPE, **model}
    return meta


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


# What each field this program reads must be, when present (older checkpoints lack some): the
# readers index and convert these, so a wrong type would otherwise surface as a traceback far away.
_FIELDS = {
    "format": ("an integer", _count),
    "steps_done": ("a non-negative integer", _count),
    "config": ("an object of [model], [train], [pipeline] objects",
               lambda v: isinstance(v, dict) and all(isinstance(t, dict) for t in v.values())),
    "checkpointing": ("an object", lambda v: isinstance(v, dict)),
    "final": ("true or false", lambda v: isinstance(v, bool)),
    "data_position": ("an object", lambda v: isinstance(v, dict)),
    "losses": ("a list of numbers", lambda v: isinstance(v, list) and all(map(_number, v))),
    "step_times": ("a list of numbers", lambda v: isinstance(v, list) and all(map(_number, v))),
    "tokens": ("a list of non-negative integers", lambda v: isinstance(v, list) and all(map(_count, v))),
    "val_losses": ("a list of [step, loss] pairs",
                   lambda v: isinstance(v, list) and all(isinstance(e, list) and len(e) == 2 and _count(e[0])
                                                         and _number(e[1]) for e in v)),
    "extras": ("an object", lambda v: isinstance(v, dict)),
    "restarts": ("a non-negative integer", _count),
}


def _describe(value) -> str:
    """A refused value, bounded: scalars quoted briefly, containers named by type (a repr of a large
    one would cost as much as the file)."""
    if isinstance(value, (list, dict)):
        return f"a JSON {'list' if isinstance(value, list) else 'object'} of {len(value)} entries with other contents"
    return brief(repr(value), 60)


def check_meta_fields(meta: dict, where: str) -> None:
    """CheckpointRefused naming the first field of `meta` (from `where`) that is missing or not what
    this program writes: `steps_done` and `config` are always written; the rest is checked when present."""
    for required in ("steps_done", "config"):
        if required not in meta:
            raise CheckpointRefused(f"{where} has no {required!r}: it was not written by attnres-pp train; "
                                    "load an earlier checkpoint, or retrain")
    for key, (what, ok) in _FIELDS.items():
        if key in meta and not ok(meta[key]):
            raise CheckpointRefused(f"{where}: {key!r} must be {what}, not {_describe(meta[key])}; the file is "
                                    "damaged or was not written by attnres-pp train: load an earlier checkpoint")
