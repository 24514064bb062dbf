"""Reading a checkpoint's meta.json, bounded: the one reader `checkpoint` (discovery, resume) and
`shards` (the model a checkpoint's tensors must match) share, kept apart so neither imports the other."""

from __future__ import annotations

import json
from pathlib import Path

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
    return meta
