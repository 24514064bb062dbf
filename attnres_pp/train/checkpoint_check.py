"""Checking a checkpoint's metadata tree, its shard files and its tensors against the model, before
anything is read or allocated from it.

`metadata_pickle` guarantees only that `.metadata` unpickled to DCP's classes without running code;
what the fields hold is still the file's word. `check_metadata` checks every field's exact type,
every size (non-negative ints, at most MAX_DIMS dims), every chunk (inside its tensor, with a storage
entry) and every storage entry (a bare shard name `__<int>_<int>.distcp` that resolves inside the
folder to a regular file, its byte range inside that file and long enough for its chunk's elements,
no transforms), all iteratively: no step recurses on what the file nests. Byte entries
(BytesStorageMetadata) are refused: this program never writes them, and DCP would load them with
`torch.load(weights_only=False)`.

`check_expected` then compares the tensors a caller will load against what the model says they are
(name, shape, dtype): the caller allocates from the model, and a checkpoint that disagrees is refused
first. So neither the memory a load takes nor the files it opens are the file's choice.
"""

from __future__ import annotations

import math
import os
import re
import stat
from pathlib import Path, PosixPath

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from attnres_pp.train.metadata_pickle import MAX_DIMS, MAX_TEXT, CheckpointRefused, refusal

SHARD_NAME = re.compile(r"__\d{1,9}_\d{1,9}\.distcp")
_MEMORY_FORMATS = (torch.contiguous_format, torch.channels_last, torch.preserve_format)


def _text(value, *, optional: bool = False) -> bool:
    return (optional and value is None) or (type(value) is str and len(value) <= MAX_TEXT)


def _size(value) -> bool:
    """A torch.Size as `metadata_pickle` lets one be made: at most MAX_DIMS non-negative ints."""
    return type(value) is torch.Size and len(value) <= MAX_DIMS and all(type(d) is int and d >= 0 for d in value)


def _fields(obj, cls) -> bool:
    """`obj` is exactly a `cls` with every one of its dataclass fields set (BUILD may have left some out)."""
    return type(obj) is cls and all(hasattr(obj, name) for name in cls.__dataclass_fields__)


def check_metadata(metadata: Metadata, folder: Path, source: str) -> dict[str, os.stat_result]:
    """Refuse (CheckpointRefused) a metadata tree that this program could not have written, or whose
    storage entries leave `folder` or name bytes that are not there. See the module docstring.
    Returns each shard file's stat as checked (its identity: the reader opens no other file)."""
    def refuse(why: str) -> CheckpointRefused:
        return refusal(source, why)

    if not _fields(metadata, Metadata):
        raise refuse("is not a complete DCP Metadata object")
    tensors = metadata.state_dict_metadata
    if type(tensors) is not dict:
        raise refuse(f"has state_dict_metadata of type {type(tensors).__qualname__}, not a dict")
    chunk_keys: dict[tuple[str, tuple[int, ...]], int] = {}  # (key, chunk offsets) -> bytes its elements need
    for key, md in tensors.items():
        if not _text(key):
            raise refuse("has a state dict key that is not a short string")
        if type(md) is not TensorStorageMetadata:
            raise refuse(f"holds {key!r} as {type(md).__qualname__} (this program writes tensors only; byte "
                         "entries would be unpickled with weights_only=False)")
        _check_tensor(key, md, chunk_keys, refuse)
    _check_planner_data(metadata.planner_data, refuse)
    _check_storage_meta(metadata.storage_meta, refuse)
    if not _text(metadata.version, optional=True):
        raise refuse("has a version that is not a short string")
    return _check_storage(metadata.storage_data, chunk_keys, Path(folder), refuse)


def _check_tensor(key: str, md: TensorStorageMetadata, chunk_keys: dict, refuse) -> None:
    if not _fields(md, TensorStorageMetadata):
        raise refuse(f"has an incomplete entry for {key!r}")
    props = md.properties
    if not (_fields(props, TensorProperties) and type(props.dtype) is torch.dtype and props.layout is torch.strided
            and type(props.requires_grad) is bool and type(props.pin_memory) is bool
            and any(props.memory_format is f for f in _MEMORY_FORMATS)):
        raise refuse(f"has properties for {key!r} that are not a dense tensor's")
    if not _size(md.size):
        raise refuse(f"has a size for {key!r} that is not at most {MAX_DIMS} non-negative ints")
    if type(md.chunks) is not list or not md.chunks:
        raise refuse(f"has no list of chunks for {key!r}")
    itemsize = torch.empty((), dtype=props.dtype, device="meta").element_size()
    for chunk in md.chunks:
        if not (_fields(chunk, ChunkStorageMetadata) and _size(chunk.offsets) and _size(chunk.sizes)
                and len(chunk.offsets) == len(chunk.sizes) == len(md.size)
                and all(o + s <= d for o, s, d in zip(chunk.offsets, chunk.sizes, md.size, strict=True))):
            raise refuse(f"has a chunk of {key!r} that is not inside the tensor")
        chunk_keys[(key, tuple(chunk.offsets))] = math.prod(chunk.sizes) * itemsize


def _check_planner_data(planner_data, refuse) -> None:
    # DCP's planner keeps, per flattened key, the path of keys it came from.
    if planner_data is None:
        return
    if type(planner_data) is not dict:
        raise refuse("has planner data that is not a dict")
    for key, path in planner_data.items():
        if not (_text(key) and type(path) is tuple and len(path) <= MAX_DIMS
                and all(_text(part) or type(part) is int for part in path)):
            raise refuse("has planner data that is not key paths")


def _check_storage_meta(meta, refuse) -> None:
    if meta is None:
        return
    if not (_fields(meta, StorageMeta) and (_text(meta.checkpoint_id, optional=True) or type(meta.checkpoint_id)
                                            is PosixPath) and _text(meta.save_id, optional=True)
            and _text(meta.load_id, optional=True) and type(meta.modules) is list
            and len(meta.modules) <= MAX_TEXT and all(_text(m) for m in meta.modules)):
        raise refuse("has storage_meta fields of the wrong types")


def _check_storage(storage, chunk_keys: dict, folder: Path, refuse) -> dict[str, os.stat_result]:
    if type(storage) is not dict:
        raise refuse("has storage_data that is not a dict")
    root = os.path.realpath(folder)
    files: dict[str, os.stat_result] = {}  # shard name -> its stat
    covered = set()
    for index, info in storage.items():
        if not (_fields(index, MetadataIndex) and _fields(info, _StorageInfo)):
            raise refuse("has a storage entry that is not a MetadataIndex -> _StorageInfo pair")
        where = (index.fqn, tuple(index.offset) if index.offset is not None else None)
        if where not in chunk_keys:
            raise refuse(f"has a storage entry for {index.fqn!r} that matches none of its chunks")
        covered.add(where)
        name = info.relative_path
        if type(name) is not str or not SHARD_NAME.fullmatch(name):
            raise refuse("has a storage path that is not a shard file name (__R_I.distcp) of its own folder")
        if name not in files:
            files[name] = _shard_stat(folder, root, name, refuse)
        if not (type(info.offset) is int and type(info.length) is int and info.offset >= 0 and info.length >= 0):
            raise refuse(f"has a byte range for {index.fqn!r} that is not two non-negative ints")
        if info.offset + info.length > files[name].st_size:
            raise refuse(f"places {index.fqn!r} at bytes {info.offset}+{info.length} of {name}, which has "
                         f"{files[name].st_size}: the shard file is truncated")
        if info.length < chunk_keys[where]:
            raise refuse(f"stores {index.fqn!r} in {info.length} bytes, fewer than its {chunk_keys[where]} "
                         "bytes of elements")
        if info.transform_descriptors not in (None, [], ()):
            raise refuse(f"applies storage transforms to {index.fqn!r} (this program writes none)")
    if len(covered) != len(chunk_keys):
        missing = next(key for key, _ in sorted(set(chunk_keys) - covered))
        raise refuse(f"has no storage entry for a chunk of {missing!r}")
    return files


def _shard_stat(folder: Path, root: str, name: str, refuse) -> os.stat_result:
    path = os.path.realpath(folder / name)
    if os.path.dirname(path) != root:
        raise refuse(f"has a shard {name} that resolves outside its folder")
    try:
        info = os.stat(path)
    except OSError:
        raise refuse(f"names a shard {name} that is not in the folder") from None
    if not stat.S_ISREG(info.st_mode):
        raise refuse(f"has a shard {name} that is not a regular file")
    return info


def check_expected(metadata: Metadata, expected: dict[str, tuple[tuple[int, ...], torch.dtype]], source: str) -> None:
    """Refuse unless every key of `expected` (name -> the model's shape and dtype for it) is in the
    checkpoint with exactly that shape and dtype. Run after `check_metadata`."""
    saved = metadata.state_dict_metadata
    missing = sorted(set(expected) - set(saved))
    if missing:
        raise CheckpointRefused(f"checkpoint {source} has no values for {[brief_key(k) for k in missing[:5]]}: it "
                                "was written for another model; resume with the model config it was saved with")
    for key, (shape, dtype) in expected.items():
        md = saved[key]
        if tuple(md.size) != tuple(shape) or md.properties.dtype != dtype:
            raise CheckpointRefused(f"checkpoint {source}: {brief_key(key)} has shape {_shape(md.size)} "
                                    f"{md.properties.dtype}, the model {tuple(shape)} {dtype}: resume with the "
                                    "model config it was saved with")


def brief_key(key: str) -> str:
    return key if len(key) <= 120 else key[:120] + "..."


def _shape(size) -> str:
    return str(tuple(size)) if len(size) <= 8 else f"({len(size)} dims)"
