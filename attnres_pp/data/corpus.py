"""Token corpora and their train/validation split.

Three sources, chosen by one string (`TrainConfig.data`):

- ``"builtin"``: the bytes of the Python standard library's own ``.py`` files, read in sorted path
  order and capped at `BUILTIN_MAX_BYTES`. Every Python installation has them, so the default run
  needs no download. The text depends on the Python version, so compare runs on one interpreter.
- a path ending in ``.txt``: the file's UTF-8 bytes (vocabulary 256).
- a path ending in ``.bin``: a flat array of uint16 token ids (the nanoGPT layout), memory-mapped.
- a directory: a data folder of `attnres-pp prepare` (`data.token_folder`): its train and val shards,
  memory-mapped and read as one stream per split without being concatenated; its meta.json names
  the vocabulary size and the tokenizer.

For the files the split is deterministic: the last `VAL_FRACTION` of the token stream is validation;
a data folder has its own.
"""

from __future__ import annotations

import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from attnres_pp.data.token_folder import ShardedTokens, open_token_folder
from attnres_pp.data.tokenizer import BYTES

BUILTIN_MAX_BYTES = 6 * 1024 * 1024
VAL_FRACTION = 0.1
# Folders of the stdlib that are not the standard library's own source (or are huge test data).
_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"})


@dataclass(frozen=True)
class Corpus:
    """A token stream split in two. `train_tokens_N` / `val_tokens_N` are 1-D numpy arrays
    (uint8 for byte sources, uint16 for `.bin` files) or, for a data folder, `ShardedTokens` views
    that index like them; `max_token` is the largest id present (for a folder, the largest its
    vocabulary allows: its shards are not scanned). A data folder also sets `folder`, `vocab_size`
    and its tokenizer's kind and sha256; text sources are raw bytes, a `.bin` file names none."""

    name: str
    train_tokens_N: np.ndarray | ShardedTokens
    val_tokens_N: np.ndarray | ShardedTokens
    max_token: int
    folder: str | None = None
    vocab_size: int | None = None
    tokenizer_kind: str | None = None
    tokenizer_sha256: str | None = None

    @property
    def n_tokens(self) -> int:
        return len(self.train_tokens_N) + len(self.val_tokens_N)

    def check_fits(self, *, vocab_size: int, seq_len: int) -> None:
        """Raise ValueError with a fix if the model cannot read this corpus."""
        if self.max_token >= vocab_size:
            raise ValueError(
                f"ModelConfig.vocab_size={vocab_size} is too small for data {self.name!r}, whose largest "
                f"token id is {self.max_token}: set [model] vocab_size >= {self.max_token + 1}"
            )
        for split, tokens_N in (("train", self.train_tokens_N), ("validation", self.val_tokens_N)):
            if len(tokens_N) < seq_len + 1:
                raise ValueError(
                    f"ModelConfig.seq_len={seq_len} is too long for the {split} split of {self.name!r} "
                    f"({len(tokens_N)} tokens): use a smaller --seq-len or a larger data file"
                )


def load_corpus(spec: str) -> Corpus:
    """Load the corpus named by `spec`: "builtin", a path to a `.txt` or `.bin` file, or a data folder."""
    if spec == "builtin":
        return _split("builtin", np.frombuffer(builtin_corpus_bytes(), dtype=np.uint8), bytes_source=True)
    path = Path(spec).expanduser()
    if path.is_dir():
        folder = open_token_folder(path)
        return Corpus(name=str(path), train_tokens_N=folder.train, val_tokens_N=folder.val,
                      max_token=folder.vocab_size - 1, folder=str(path), vocab_size=folder.vocab_size,
                      tokenizer_kind=folder.tokenizer_kind, tokenizer_sha256=folder.tokenizer_sha256)
    suffix = path.suffix.lower()
    if suffix not in (".txt", ".bin"):
        raise ValueError(
            f"TrainConfig.data={spec!r} is invalid: use 'builtin', a UTF-8 '.txt' file, a uint16 '.bin' file or "
            "a data folder of `attnres-pp prepare`"
        )
    if not path.is_file():
        raise ValueError(f"TrainConfig.data={spec!r} is invalid: no such file; check the path")
    if not os.access(path, os.R_OK):
        raise ValueError(f"TrainConfig.data={spec!r} is invalid: the file is not readable; check its permissions")
    try:
        return _read(spec, path, suffix)
    except OSError as error:  # access() always passes for root, yet a read can still fail
        raise ValueError(f"TrainConfig.data={spec!r} cannot be read ({error.strerror or error}): check the file "
                         "or choose another --data") from None


def _read(spec: str, path: Path, suffix: str) -> Corpus:
    if suffix == ".txt":
        return _split(str(path), np.frombuffer(path.read_bytes(), dtype=np.uint8), bytes_source=True)
    if path.stat().st_size % 2:
        raise ValueError(
            f"TrainConfig.data={spec!r} is invalid: a '.bin' file holds uint16 tokens, so its size must be "
            f"even (it is {path.stat().st_size} bytes); rewrite it with numpy's tofile on a uint16 array"
        )
    if path.stat().st_size == 0:
        raise ValueError(f"TrainConfig.data={spec!r} is invalid: the file is empty")
    return _split(str(path), np.memmap(path, dtype=np.uint16, mode="r"))


def builtin_corpus_bytes(max_bytes: int = BUILTIN_MAX_BYTES) -> bytes:
    """The first `max_bytes` bytes of the stdlib's `.py` sources, concatenated in sorted path order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts: list[bytes] = []
    total = 0
    for path in _stdlib_sources(root):
        data = path.read_bytes()
        parts.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if total == 0:
        raise ValueError(
            f"TrainConfig.data='builtin' is unavailable: no .py files under {root} (a zipped stdlib?); "
            "pass --data FILE.txt instead"
        )
    return b"".join(parts)[:max_bytes]


def _stdlib_sources(root: Path) -> list[Path]:
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIPPED_DIRS)
        found.extend(Path(dirpath) / f for f in filenames if f.endswith(".py"))
    # Sort on the path relative to the root so the order does not depend on where Python lives.
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def _split(name: str, tokens_N: np.ndarray, bytes_source: bool = False) -> Corpus:
    n_val = max(1, int(len(tokens_N) * VAL_FRACTION))
    if len(tokens_N) < 2 * n_val or len(tokens_N) < 4:
        raise ValueError(f"TrainConfig.data={name!r} is invalid: only {len(tokens_N)} tokens; use a larger file")
    max_token = int(tokens_N.max())
    return Corpus(
        name=name,
        train_tokens_N=tokens_N[:-n_val],
        val_tokens_N=tokens_N[-n_val:],
        max_token=max_token,
        tokenizer_kind=BYTES if bytes_source else None,
        tokenizer_sha256=BYTES if bytes_source else None,
    )
