"""`attnres-pp prepare`'s third pass: documents encoded batch by batch (in this process or in forked
workers) into each split's token shards (`ShardWriter`), a split's documents joined by the
end-of-text id (BPE) or a b"\\n" byte (raw bytes)."""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from attnres_pp.data.bpe_cache import FastEncoder, WorkerPool
from attnres_pp.data.tokenizer import BYTES, Tokenizer

BYTES_SEPARATOR = b"\n"
# A batch of documents handed to encode_batch: enough text that both cores stay busy, little
# enough that its ids (a Python list each) stay a few hundred MB at most.
ENCODE_BATCH_BYTES = 8 * 2**20
ENCODE_BATCH_DOCUMENTS = 4096
# With worker processes (prepare(workers=2)): a job's text. Off by default: on the 2 shared cores of
# the 2026-12-03 measurement, 64 MB encoded at 14 MB/s in two workers against 25 in one process
# (cold caches per worker, the pickling and the reading in the parent). With the first batch warmed
# before the fork (WARM_BEFORE_FORK), the same 64 MB, 4 rounds alternating, load 3.5-4.3: 14.9 MB/s
# in two warm workers, 11.9 in two cold ones, 16.2 in one process (medians): one process still wins.
WORKER_JOB_BYTES = 2**20
# With worker processes: the first batch (ENCODE_BATCH_BYTES) is encoded here before the fork, so
# that every worker starts with its chunks cached (shared copy-on-write) instead of a cold cache.
WARM_BEFORE_FORK = True
SPLITS = ("train", "val")


class ShardWriter:
    """One split's shards: `write` appends ids, a shard is closed (and announced) when it holds
    `shard_tokens`, the next one opened on the next write."""

    def __init__(self, folder: Path, split: str, dtype: str, shard_tokens: int,
                 announce: Callable[[str, dict], None]) -> None:
        self.folder, self.split, self.shard_tokens, self.announce = folder, split, shard_tokens, announce
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self.shards: list[dict] = []
        self.tokens = 0
        self._file = None

    def write(self, ids: np.ndarray) -> None:
        ids = ids.astype(self.dtype, copy=False)
        while len(ids):
            if self._file is None:
                self.shards.append({"file": f"{self.split}_{len(self.shards):05d}.bin", "tokens": 0})
                self._file = open(self.folder / self.shards[-1]["file"], "wb")  # noqa: SIM115 - spans writes
            shard = self.shards[-1]
            part = ids[: self.shard_tokens - shard["tokens"]]
            self._file.write(part.tobytes())
            shard["tokens"] += len(part)
            self.tokens += len(part)
            ids = ids[len(part):]
            if shard["tokens"] == self.shard_tokens:
                self._close()

    def close(self) -> None:
        if self._file is not None:
            self._close()

    def _close(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self._file = None
        self.announce(self.split, self.shards[-1])


def _batches(texts: Iterator[str]) -> Iterator[list[str]]:
    batch: list[str] = []
    size = 0
    for text in texts:
        batch.append(text)
        size += len(text)
        if size >= ENCODE_BATCH_BYTES or len(batch) >= ENCODE_BATCH_DOCUMENTS:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def encode_into(tokenizer: Tokenizer, texts: Iterator[str], is_val: np.ndarray, writers: dict[str, ShardWriter],
                progress: Callable[[int], None] = lambda n: None, fast: bool = True, workers: int = 1) -> None:
    """Encode `texts` (document i goes to val where is_val[i]) batch by batch into the writers, each
    split's documents joined by the separator. `progress` gets the UTF-8 bytes of each batch.

    A BPE goes through the chunk cache of bpe_cache.FastEncoder when `fast` and the tokenizer allows
    it, in `workers` forked processes when more than one (jobs of WORKER_JOB_BYTES, written in
    order); `fast=False` is the twin that asks the library for every document: same ids, same bytes."""
    dtype = writers["train"].dtype
    separator_id = tokenizer.eot_id if tokenizer.eot_id is not None else BYTES_SEPARATOR[0]
    separator = np.array([separator_id], dtype)
    started = dict.fromkeys(SPLITS, False)
    encoder = (FastEncoder(tokenizer._bpe) if fast and tokenizer.kind != BYTES and FastEncoder.usable(tokenizer._bpe)
               else None)
    index = 0
    if encoder is not None and workers > 1:
        _encode_in_workers(tokenizer, texts, is_val, writers, progress, workers, separator)
        return
    for batch in _batches(texts):
        n_bytes = sum(map(len, batch))  # characters first; UTF-8 bytes below where they differ
        if encoder is not None:
            parts = encoder.encode_batch(batch, dtype)
            by_split: dict[str, list] = {split: [] for split in SPLITS}
            for part in parts:
                by_split["val" if is_val[index] else "train"].append(part)
                index += 1
            for split, split_parts in by_split.items():
                if split_parts:
                    writers[split].write(encoder.assemble(split_parts, separator_id, started[split], dtype))
                    started[split] = True
        else:
            if tokenizer.kind == BYTES:
                ids = [np.frombuffer(text.encode("utf-8"), dtype=np.uint8) for text in batch]
            else:
                # encode_batch_fast: the same ids without the offsets, ~20% faster on 2 cores (bench prepare).
                encodings = tokenizer._bpe.encode_batch_fast(batch, add_special_tokens=False)
                ids = [np.asarray(e.ids, dtype=dtype) for e in encodings]
            pieces: dict[str, list[np.ndarray]] = {split: [] for split in SPLITS}
            for doc_ids in ids:
                split = "val" if is_val[index] else "train"
                index += 1
                if started[split]:
                    pieces[split].append(separator)
                started[split] = True
                pieces[split].append(doc_ids.astype(dtype, copy=False))
            for split, parts in pieces.items():
                if parts:
                    writers[split].write(np.concatenate(parts))
        if not all(map(str.isascii, batch)):
            n_bytes = sum(len(text.encode("utf-8")) for text in batch)
        progress(n_bytes)


def _encode_in_workers(tokenizer: Tokenizer, texts: Iterator[str], is_val: np.ndarray,
                       writers: dict[str, ShardWriter], progress: Callable[[int], None], workers: int,
                       separator: np.ndarray) -> None:
    started = dict.fromkeys(SPLITS, False)

    def write(done: list) -> None:
        for n_bytes, ids in done:
            for split in SPLITS:
                if split in ids:
                    if started[split]:
                        writers[split].write(separator)
                    writers[split].write(ids[split])
                    started[split] = True
            progress(n_bytes)

    index = 0
    warm = None
    if WARM_BEFORE_FORK:
        # The first batch in this process, before the fork: the workers start with its chunks cached.
        texts = iter(texts)
        first = next(_batches(texts), [])
        if first:
            saved = os.environ.get("TOKENIZERS_PARALLELISM")
            os.environ["TOKENIZERS_PARALLELISM"] = "false"  # no library threads before the fork
            try:
                warm = FastEncoder(tokenizer._bpe)
                parts = warm.encode_batch(first, writers["train"].dtype)
            finally:
                if saved is None:
                    del os.environ["TOKENIZERS_PARALLELISM"]
                else:
                    os.environ["TOKENIZERS_PARALLELISM"] = saved
            dtype = writers["train"].dtype
            by_split: dict[str, list] = {split: [] for split in SPLITS}
            for part in parts:
                by_split["val" if is_val[index] else "train"].append(part)
                index += 1
            write([(sum(len(t.encode("utf-8")) for t in first),
                    {split: warm.assemble(p, int(separator[0]), False, dtype)
                     for split, p in by_split.items() if p})])
    pool = WorkerPool(tokenizer._bpe, workers, warm=warm)
    try:
        job: list[str] = []
        size = 0
        dtype = writers["train"].dtype.str
        for text in itertools.chain(texts, [None]):
            if text is not None:
                job.append(text)
                size += len(text)
            if job and (text is None or size >= WORKER_JOB_BYTES):
                n_bytes = sum(len(t.encode("utf-8")) if not t.isascii() else len(t) for t in job)
                flags = is_val[index:index + len(job)].tolist()
                index += len(job)
                write(pool.submit((job, flags, int(separator[0]), dtype, n_bytes)))
                job, size = [], 0
        write(pool.drain())
    finally:
        pool.close()
