"""A data folder written by `attnres-pp prepare`: `meta.json`, the tokenizer (`tokenizer.json`, BPE
only) and the token shards `{train,val}_NNNNN.bin`, flat little-endian arrays of `dtype` without a
header (the nanoGPT layout) whose documents are joined by `eot_id` (BPE) or a newline byte (bytes).

Reading never copies a split into memory: each shard is memory-mapped read-only and `ShardedTokens`
gives one split as a view over its shards, so a corpus larger than memory trains as a small one does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from attnres_pp.data.tokenizer import BYTES, TOKENIZER_FILE, Tokenizer

FORMAT = "attnres-pp-tokens"
VERSION = 1
META_FILE = "meta.json"
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
SPLITS = ("train", "val")
# meta.json lists one entry per shard: a few MB even for a huge corpus.
MAX_META_BYTES = 64 << 20
_REPREPARE = "run `attnres-pp prepare` again to rewrite the folder"


def is_token_folder(spec: str | Path) -> bool:
    return Path(spec).expanduser().is_dir()


class ShardedTokens:
    """One split as a single 1-D token stream over its memory-mapped shards, in shard order.

    Windows may cross a shard boundary: shards are cuts of one stream at every `shard_tokens`
    tokens (documents are joined by a separator, not padded per shard), so a window across the cut
    is a window of the stream like any other. This keeps every start position of the concatenated
    stream equally likely, and the batches identical to those of the concatenated array."""

    def __init__(self, shards: list[np.ndarray]) -> None:
        if not shards:
            raise ValueError("a split needs at least one shard")
        self._shards = shards
        sizes = np.array([len(s) for s in shards], dtype=np.int64)
        # starts[i]: the stream index of shard i's first token; ends at the stream's length.
        self._starts = np.concatenate([[0], np.cumsum(sizes)])
        self.dtype = shards[0].dtype

    def __len__(self) -> int:
        return int(self._starts[-1])

    @property
    def shape(self) -> tuple[int]:
        return (len(self),)

    @property
    def n_shards(self) -> int:
        return len(self._shards)

    def __getitem__(self, index):
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                return self[np.arange(start, stop, step)]
            return self._range(start, stop)
        if isinstance(index, (int, np.integer)):
            i = int(index) + (len(self) if index < 0 else 0)
            if not 0 <= i < len(self):
                raise IndexError(f"token index {index} is out of range for {len(self)} tokens")
            return self[np.array([i])][0]
        index = np.asarray(index, dtype=np.int64)
        if index.size and (index.min() < 0 or index.max() >= len(self)):
            raise IndexError(f"token indices must be in [0, {len(self)})")
        flat = index.ravel()
        shard_of = np.searchsorted(self._starts, flat, side="right") - 1
        out = np.empty(flat.shape, dtype=self.dtype)
        first, last = (int(shard_of.min()), int(shard_of.max())) if flat.size else (0, -1)
        for s in range(first, last + 1):  # a batch of windows touches few shards
            mask = shard_of == s
            if mask.any():
                out[mask] = self._shards[s][flat[mask] - self._starts[s]]
        return out.reshape(index.shape)

    def _range(self, start: int, stop: int) -> np.ndarray:
        if stop <= start:
            return np.empty(0, dtype=self.dtype)
        parts = []
        for s in range(int(np.searchsorted(self._starts, start, side="right") - 1), len(self._shards)):
            lo, hi = self._starts[s], self._starts[s + 1]
            if lo >= stop:
                break
            parts.append(self._shards[s][max(start, lo) - lo:min(stop, hi) - lo])
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def __array__(self, dtype=None, copy=None):  # np.asarray(x): the whole split, for small corpora and tests
        whole = self._range(0, len(self))
        return whole if dtype is None else whole.astype(dtype)


@dataclass(frozen=True)
class TokenFolder:
    """A checked data folder: its path, its meta.json, and the two splits as `ShardedTokens`."""

    path: Path
    meta: dict
    train: ShardedTokens
    val: ShardedTokens

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    @property
    def tokenizer_kind(self) -> str:
        return self.meta["tokenizer"]

    @property
    def tokenizer_sha256(self) -> str:
        return self.meta["tokenizer_sha256"]

    @property
    def tokenizer_path(self) -> Path | None:
        return None if self.tokenizer_kind == BYTES else self.path / TOKENIZER_FILE

    def tokenizer(self) -> Tokenizer:
        return Tokenizer.raw_bytes() if self.tokenizer_path is None else Tokenizer.load(self.tokenizer_path)


def _fail(path: Path, what: str, fix: str = _REPREPARE) -> None:
    raise ValueError(f"data folder {path}: {what}; {fix}")


def read_folder_meta(path: str | Path) -> dict:
    """meta.json of the data folder `path`, its fields checked (not the shards: `open_token_folder`)."""
    path = Path(path).expanduser()
    meta_path = path / META_FILE
    if not meta_path.is_file():
        _fail(path, f"no {meta_path} (it is a directory, but not a data folder)",
              "write the folder with `attnres-pp prepare`, or give --data a .txt or .bin file")
    try:
        size = meta_path.stat().st_size
    except OSError as error:
        _fail(path, f"{meta_path} cannot be read ({error.strerror or error})")
    if size > MAX_META_BYTES:
        _fail(path, f"{meta_path} is over {MAX_META_BYTES:,} bytes, more than a data folder's meta.json holds")
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as error:
        _fail(path, f"{meta_path} cannot be read as JSON ({type(error).__name__})")
    if not isinstance(meta, dict):
        _fail(path, f"{meta_path} does not hold a JSON object")
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        _fail(path, f"{meta_path} has format {meta.get('format')!r} version {meta.get('version')!r}, this program "
                    f"reads format {FORMAT!r} version {VERSION}")
    if meta.get("dtype") not in DTYPES:
        _fail(path, f"{meta_path}: dtype {meta.get('dtype')!r} is not one of {', '.join(DTYPES)}")
    if meta.get("tokenizer") not in (BYTES, "bpe"):
        _fail(path, f"{meta_path}: tokenizer {meta.get('tokenizer')!r} is not 'bytes' or 'bpe'")
    vocab = meta.get("vocab_size")
    if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 1 or vocab > 2 ** (
            8 * DTYPES[meta["dtype"]].itemsize):
        _fail(path, f"{meta_path}: vocab_size {vocab!r} is not a count that dtype {meta['dtype']} holds")
    if not isinstance(meta.get("tokenizer_sha256"), str):
        _fail(path, f"{meta_path} has no tokenizer_sha256")
    shards, tokens = meta.get("shards"), meta.get("tokens")
    if not isinstance(shards, dict) or not isinstance(tokens, dict):
        _fail(path, f"{meta_path} has no 'shards' and 'tokens' objects")
    for split in SPLITS:
        entries = shards.get(split)
        if not isinstance(entries, list) or not entries or not all(
                isinstance(e, dict) and isinstance(e.get("file"), str) and isinstance(e.get("tokens"), int)
                and e["tokens"] >= 0 and Path(e["file"]).name == e["file"] for e in entries):
            _fail(path, f"{meta_path}: shards.{split} must be a non-empty list of {{'file': NAME, 'tokens': N}}")
        listed = sum(e["tokens"] for e in entries)
        if tokens.get(split) != listed:
            _fail(path, f"{meta_path}: tokens.{split} = {tokens.get(split)!r} but its shards hold {listed} tokens")
    return meta


def open_token_folder(path: str | Path) -> TokenFolder:
    """The data folder `path`, checked (meta.json, every shard present with its listed size, the
    tokenizer file for BPE) and memory-mapped; ValueError naming the file and what to do."""
    path = Path(path).expanduser()
    meta = read_folder_meta(path)
    dtype = DTYPES[meta["dtype"]]
    if meta["tokenizer"] != BYTES and not (path / TOKENIZER_FILE).is_file():
        _fail(path, f"no {path / TOKENIZER_FILE}, which a 'bpe' folder holds")
    splits = {}
    for split in SPLITS:
        maps = []
        for entry in meta["shards"][split]:
            file = path / entry["file"]
            if not file.is_file():
                _fail(path, f"shard {file} is missing")
            want = entry["tokens"] * dtype.itemsize
            have = file.stat().st_size
            if have != want:
                _fail(path, f"shard {file} is {have} bytes, but meta.json lists {entry['tokens']} {meta['dtype']} "
                            f"tokens ({want} bytes): the shard is truncated or from another folder")
            if entry["tokens"]:  # an empty file cannot be mapped, and adds nothing to the stream
                maps.append(np.memmap(file, dtype=dtype, mode="r"))
        if not maps:
            _fail(path, f"the {split} split has no tokens")
        splits[split] = ShardedTokens(maps)
    return TokenFolder(path, meta, splits["train"], splits["val"])
