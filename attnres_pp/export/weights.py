"""model.safetensors of an exported folder, split into numbered shards with an index above a size
(transformers' layout: `model-00001-of-0000N.safetensors` and `model.safetensors.index.json`)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    """Bytes of a size such as "5GB", "200MB", "1000" (decimal units; KiB/MiB/GiB binary)."""
    raw = text.strip().upper()
    digits = raw.rstrip("BKMGI")
    unit = raw[len(digits):]
    try:
        value = float(digits)
    except ValueError:
        value = -1.0
    if unit not in UNITS or not value > 0:
        raise ValueError(f"--max-shard-size {text!r} is not a size: give e.g. 5GB, 200MB or a byte count")
    return max(1, int(value * UNITS[unit]))


def shard_groups(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[list[str]]:
    """Names in order, cut into shards of at most `max_bytes` (a larger tensor alone in its shard)."""
    groups: list[list[str]] = [[]]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if groups[-1] and size + nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    return groups


def write_weights(tensors: dict[str, torch.Tensor], out: Path, max_bytes: int) -> list[str]:
    """Write `tensors` under `out`; returns the files written (the index last, when sharded)."""
    from safetensors.torch import save_file

    groups = shard_groups(tensors, max_bytes)
    if len(groups) == 1:
        save_file(tensors, str(out / SINGLE), metadata={"format": "pt"})
        return [SINGLE]
    files, weight_map = [], {}
    for number, names in enumerate(groups, start=1):
        name = f"model-{number:05d}-of-{len(groups):05d}.safetensors"
        save_file({n: tensors[n] for n in names}, str(out / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, name))
        files.append(name)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (out / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
                             + "\n")
    return [*files, INDEX]
