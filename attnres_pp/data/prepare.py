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

import json
import os
import secrets
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from attnres_pp.data.bpe_train import MAX_BPE_VOCAB, train_bpe
from attnres_pp.data.prepare_encode import SPLITS, ShardWriter, encode_into
from attnres_pp.data.prepare_inputs import InputError, Source, documents, find_sources
from attnres_pp.data.tokenizer import BYTES, END_OF_TEXT, TOKENIZER_FILE, Tokenizer

FORMAT = "attnres-pp-tokens"
VERSION = 1
META_FILE = "meta.json"
DEFAULT_VOCAB_SIZE = 8192
DEFAULT_VAL_FRACTION = 0.1
DEFAULT_SHARD_TOKENS = 100_000_000  # 200 MB of uint16: a few shards for a GB of text
MIN_BPE_VOCAB = 257  # the 256 byte symbols of the byte-level alphabet and END_OF_TEXT
MAX_VOCAB = 2**32  # ids 0 .. 2**32 - 1 fit uint32


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


@dataclass
class Prepared:
    """What `prepare` did: the meta.json written, and its timings."""

    meta: dict
    train_s: float = 0.0
    encode_s: float = 0.0

    @property
    def encode_mb_s(self) -> float:
        return self.meta["input_bytes"] / 1e6 / self.encode_s if self.encode_s > 0 else float("inf")


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
        if vocab_size > MAX_BPE_VOCAB:  # checked before the trainer starts: it would abort, not refuse
            raise PrepareError(f"--vocab-size {vocab_size} is above {MAX_BPE_VOCAB:,}, the most ids a BPE may have "
                               "here (the trainer allocates about 66 bytes an id before it starts, and a larger "
                               "tokenizer.json outgrows what a tokenizer file may hold): choose a smaller one")
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

    result = Prepared(meta={})
    data = None
    if tokenizer == BYTES:
        tok = Tokenizer.raw_bytes()
    else:  # before anything is written: a kill during the (long) training leaves nothing behind
        started = time.perf_counter()
        data = train_bpe(documents(sources, text_key, errors), vocab_size or DEFAULT_VOCAB_SIZE,
                         progress=progress_bar)
        result.train_s = time.perf_counter() - started
        tok = Tokenizer.from_json_bytes(data)
        log(f"trained a byte-level BPE of {tok.vocab_size:,} ids in {result.train_s:.1f} s")
    dtype = token_dtype(tok.vocab_size)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f"{out.name}.tmp-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        if data is not None:
            (tmp / TOKENIZER_FILE).write_bytes(data)

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
    except KeyboardInterrupt:  # `prepare` removed its DATA_DIR.tmp-* on the way out
        print(f"interrupted: nothing written to {args.out}", file=sys.stderr)
        return 130
    for line in summary_lines(Path(args.out), result):
        print(line)
    return 0
