"""`attnres-pp prepare`: text files, folders, `.jsonl` (and `.parquet`) into a data folder of token
shards that `attnres-pp train --data DATA_DIR` reads.

The folder (docs/training.md, "Your own data"):

- `meta.json`: format, version, the tokenizer (kind, sha256, vocab size, end-of-text id), the
  shards' dtype, the seed and val fraction of the split, documents, tokens and shards per split;
- `tokenizer.json` (BPE only; none for raw bytes);
- `train_00000.bin`, ..., `val_00000.bin`, ...: flat little-endian arrays of `dtype` (nanoGPT's
  layout, no header), each at most `shard_tokens` tokens. A split's documents follow one another
  in input order, joined by the end-of-text id (BPE) or a b"\\n" byte (raw bytes).

The split is by document: a shuffle of the document indices seeded by `--seed` picks the
validation documents (at least one in each split when there are two or more).

Three passes over the inputs, so that memory stays bounded and nothing is written for a bad
input: a scan (every document decoded and counted: all input errors surface here), the BPE
training, and the encoding, in batches of documents whose ids go to the shards as they fill. The
folder is built as a sibling `DATA_DIR.tmp-<random>` and renamed to DATA_DIR at the end.
"""

from __future__ import annotations

import itertools
import json
import os
import secrets
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from attnres_pp.data.bpe_cache import FastEncoder, WorkerPool
from attnres_pp.data.prepare_inputs import InputError, Source, documents, find_sources
from attnres_pp.data.tokenizer import BYTES, END_OF_TEXT, TOKENIZER_FILE, Tokenizer, _tokenizers_module

FORMAT = "attnres-pp-tokens"
VERSION = 1
META_FILE = "meta.json"
DEFAULT_VOCAB_SIZE = 8192
DEFAULT_VAL_FRACTION = 0.1
DEFAULT_SHARD_TOKENS = 100_000_000  # 200 MB of uint16: a few shards for a GB of text
BYTES_SEPARATOR = b"\n"
MIN_BPE_VOCAB = 257  # the 256 byte symbols of the byte-level alphabet and END_OF_TEXT
MAX_VOCAB = 2**32  # ids 0 .. 2**32 - 1 fit uint32
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


class PrepareError(ValueError):
    """A refused command: one `error:` line, exit 2, nothing written."""


def token_dtype(vocab_size: int) -> str:
    """The shards' dtype for ids 0 .. vocab_size - 1."""
    if not 1 <= vocab_size <= MAX_VOCAB:
        raise PrepareError(f"a vocabulary of {vocab_size} ids does not fit uint32 (at most {MAX_VOCAB})")
    return "uint16" if vocab_size <= 2**16 else "uint32"


def val_mask(n_documents: int, val_fraction: float, seed: int) -> np.ndarray:
    """Per document, whether it is a validation document: a seeded shuffle of the indices, its
    first round(n * fraction) (at least one, and at least one left for training, when n >= 2)."""
    mask = np.zeros(n_documents, dtype=bool)
    if n_documents < 2:
        return mask
    n_val = min(max(round(n_documents * val_fraction), 1), n_documents - 1)
    mask[np.random.default_rng(seed).permutation(n_documents)[:n_val]] = True
    return mask


def train_bpe(texts: Iterable[str], vocab_size: int) -> bytes:
    """The tokenizer.json of a byte-level BPE of `vocab_size` ids (END_OF_TEXT among them) trained on
    `texts`. It may have fewer ids than asked when the text has fewer pairs to merge."""
    tokenizers = _tokenizers_module()
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[END_OF_TEXT], show_progress=False,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(texts, trainer=trainer)
    return bpe.to_str().encode("utf-8")


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


@dataclass
class Prepared:
    """What `prepare` did: the meta.json written, and its timings."""

    meta: dict
    train_s: float = 0.0
    encode_s: float = 0.0

    @property
    def encode_mb_s(self) -> float:
        return self.meta["input_bytes"] / 1e6 / self.encode_s if self.encode_s > 0 else float("inf")


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


def _scan(sources: list[Source], text_key: str, errors: str) -> tuple[int, int]:
    """(documents, UTF-8 bytes) of the inputs; every input error is raised here."""
    n_documents = n_bytes = 0
    for text in documents(sources, text_key, errors):
        n_documents += 1
        n_bytes += len(text.encode("utf-8"))
    if n_documents == 0:
        raise PrepareError("the inputs hold no document: every file (or .jsonl line) is empty")
    return n_documents, n_bytes


def check_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        what = "is not empty" if out.is_dir() else "is a file"
        raise PrepareError(f"--out {out} {what}: choose another --out or remove it")


def check_options(tokenizer: str, vocab_size: int | None, val_fraction: float, shard_tokens: int) -> None:
    if vocab_size is not None:
        if tokenizer == BYTES:
            raise PrepareError("--vocab-size applies to --tokenizer bpe only (raw bytes have 256 ids)")
        if vocab_size < MIN_BPE_VOCAB:
            raise PrepareError(f"--vocab-size {vocab_size} is too small: a byte-level BPE needs at least "
                               f"{MIN_BPE_VOCAB} ids (256 bytes and {END_OF_TEXT})")
        if vocab_size > MAX_VOCAB:
            raise PrepareError(f"--vocab-size {vocab_size} is above what uint32 ids hold ({MAX_VOCAB})")
    if not 0 < val_fraction < 1:
        raise PrepareError(f"--val-fraction {val_fraction} is outside (0, 1)")
    if shard_tokens < 1:
        raise PrepareError(f"--shard-tokens {shard_tokens} is invalid: expected an integer >= 1")


def prepare(inputs: list[str], out: str | Path, *, tokenizer: str = "bpe", vocab_size: int | None = None,
            val_fraction: float = DEFAULT_VAL_FRACTION, shard_tokens: int = DEFAULT_SHARD_TOKENS,
            glob: str = "*.txt", text_key: str = "text", errors: str = "strict", seed: int = 0,
            log: Callable[[str], None] = print, progress_bar: bool = False, fast: bool = True,
            workers: int = 1) -> Prepared:
    """Write the data folder `out`; PrepareError (or InputError) before anything is written. `fast`
    False encodes every document with the library alone (the twin of the chunk cache: same bytes);
    `workers` the encoding processes (1: in this one)."""
    out = Path(out)
    check_options(tokenizer, vocab_size, val_fraction, shard_tokens)
    check_out(out)
    sources = find_sources(inputs, glob)
    n_documents, n_bytes = _scan(sources, text_key, errors)
    is_val = val_mask(n_documents, val_fraction, seed)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f"{out.name}.tmp-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        result = Prepared(meta={})
        if tokenizer == BYTES:
            tok = Tokenizer.raw_bytes()
        else:
            started = time.perf_counter()
            data = train_bpe(documents(sources, text_key, errors), vocab_size or DEFAULT_VOCAB_SIZE)
            result.train_s = time.perf_counter() - started
            (tmp / TOKENIZER_FILE).write_bytes(data)
            tok = Tokenizer.from_json_bytes(data)
            log(f"trained a byte-level BPE of {tok.vocab_size:,} ids in {result.train_s:.1f} s")
        dtype = token_dtype(tok.vocab_size)

        def announce(split: str, shard: dict) -> None:
            if not progress_bar:
                log(f"wrote {shard['file']}: {shard['tokens']:,} tokens")

        writers = {split: ShardWriter(tmp, split, dtype, shard_tokens, announce) for split in SPLITS}
        done = [0]

        def progress(n: int) -> None:
            done[0] += n
            if progress_bar:
                filled = int(40 * done[0] / max(n_bytes, 1))
                print(f"\rencoding [{'#' * filled}{'.' * (40 - filled)}] {done[0] / 1e6:,.1f} / "
                      f"{n_bytes / 1e6:,.1f} MB", end="", flush=True)

        started = time.perf_counter()
        encode_into(tok, documents(sources, text_key, errors), is_val, writers, progress, fast=fast,
                    workers=workers)
        for writer in writers.values():
            writer.close()
        result.encode_s = time.perf_counter() - started
        if progress_bar:
            print(flush=True)
        n_val = int(is_val.sum())
        result.meta = {
            "format": FORMAT, "version": VERSION, "tokenizer": tok.kind, "tokenizer_sha256": tok.sha256,
            "vocab_size": tok.vocab_size, "dtype": dtype, "eot_id": tok.eot_id, "seed": seed,
            "val_fraction": val_fraction, "shard_tokens": shard_tokens,
            "documents": {"train": n_documents - n_val, "val": n_val},
            "tokens": {split: writers[split].tokens for split in SPLITS},
            "input_bytes": n_bytes,
            "shards": {split: writers[split].shards for split in SPLITS},
        }
        with open(tmp / META_FILE, "w") as file:
            file.write(json.dumps(result.meta, indent=2) + "\n")
            file.flush()
            os.fsync(file.fileno())
        check_out(out)  # another writer may have filled it meanwhile: never merge into it
        if out.exists():
            out.rmdir()  # empty (checked): rename(2) replaces an empty folder, but not on every platform
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return result


def summary_lines(out: Path, result: Prepared) -> list[str]:
    meta = result.meta
    tokens = meta["tokens"]["train"] + meta["tokens"]["val"]
    lines = [f"prepared {out}: tokenizer {meta['tokenizer']} ({meta['vocab_size']:,} ids, {meta['dtype']} shards)",
             f"documents: train {meta['documents']['train']:,}, val {meta['documents']['val']:,}",
             f"tokens: train {meta['tokens']['train']:,}, val {meta['tokens']['val']:,} "
             f"({meta['input_bytes'] / max(tokens, 1):.2f} bytes per token)"]
    if meta["tokenizer"] != BYTES:
        lines.append(f"bpe training: {result.train_s:.1f} s")
    lines.append(f"encoding: {result.encode_s:.1f} s for {meta['input_bytes'] / 1e6:,.1f} MB of text, "
                 f"{result.encode_mb_s:,.1f} MB/s")
    return lines


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "prepare", help="tokenize text files, folders or .jsonl into a data folder for train --data",
        description="Tokenize documents (text files, folders of them, .jsonl, .parquet with pyarrow) into "
                    "DATA_DIR: meta.json, tokenizer.json (bpe) and train/val token shards, split by document.")
    parser.add_argument("--input", metavar="PATH", nargs="+", action="extend", required=True,
                        help="text files (one document each), folders (read recursively), .jsonl or .parquet")
    parser.add_argument("--out", metavar="DATA_DIR", required=True, help="the data folder (must not exist or be empty)")
    parser.add_argument("--tokenizer", choices=("bytes", "bpe"), default="bpe",
                        help="a byte-level BPE trained on the input (default) or raw UTF-8 bytes")
    parser.add_argument("--vocab-size", type=int, default=None, metavar="N",
                        help=f"ids of the BPE, END_OF_TEXT included (default {DEFAULT_VOCAB_SIZE})")
    parser.add_argument("--val-fraction", type=float, default=DEFAULT_VAL_FRACTION, metavar="F",
                        help=f"share of the documents for validation, in (0, 1) (default {DEFAULT_VAL_FRACTION})")
    parser.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS, metavar="N",
                        help=f"tokens per shard at most (default {DEFAULT_SHARD_TOKENS:,})")
    parser.add_argument("--glob", default="*.txt", metavar="PATTERN",
                        help="the files of a folder input that are read (default '*.txt')")
    parser.add_argument("--text-key", default="text", metavar="KEY",
                        help="the field of a .jsonl line (column of a .parquet) holding the document (default text)")
    parser.add_argument("--errors", choices=("strict", "replace"), default="strict",
                        help="non-UTF-8 input: refuse it (default) or substitute U+FFFD")
    parser.add_argument("--seed", type=int, default=0, help="seed of the train/val split (default 0)")
    parser.set_defaults(func=main)


def main(args) -> int:
    try:
        result = prepare(args.input, args.out, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
                         val_fraction=args.val_fraction, shard_tokens=args.shard_tokens, glob=args.glob,
                         text_key=args.text_key, errors=args.errors, seed=args.seed,
                         progress_bar=sys.stdout.isatty())
    except (PrepareError, InputError) as error:
        # The CLI's one refusal style (cli_flags.refuse), which this layer may not import.
        print(f"error: {error}", file=sys.stderr)
        return 2
    for line in summary_lines(Path(args.out), result):
        print(line)
    return 0
