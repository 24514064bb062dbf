"""A chunk cache in front of a byte-level BPE: the same ids as `tokenizers`, several times faster.

Byte-level BPE splits text into pre-tokens with the GPT-2 pattern
`'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+` and merges each
pre-token on its own. Every alternative holds a space only as its optional first character, except
the two whitespace runs, and a whitespace run followed by a non-space stops one character short of
it; so wherever a space is followed by a non-whitespace character there is a pre-token boundary
just before that space. `text.split(" ")` cuts at exactly those places when no piece after the
first is empty or starts with whitespace, and then

    ids(text) = ids(chunks[0]) + ids(" " + chunks[1]) + ids(" " + chunks[2]) + ...

where each ids(...) is the library's own encoding of that string alone. Natural text repeats a small
set of such chunks, so each distinct chunk is encoded once by the library (a batch of misses at a
time) and looked up afterwards; the ids of a batch are gathered from a flat table with numpy.

A document with a piece that breaks the rule (two spaces, a space before another whitespace, a
trailing space) or that holds an added token (`<|endoftext|>` in the text: the library matches
added tokens before pre-tokenizing) is encoded whole by the library. "Whitespace" here is Python's
`str.isspace` plus a few characters older Unicode tables call spaces, a superset of the pattern's
`\\s`: a doubt sends the document to the library, never to the cache.

`FastEncoder.usable(bpe)` says whether a tokenizer is one this holds for (no normalizer, the
ByteLevel pre-tokenizer with its regex, a BPE model without dropout, added tokens without spaces).
"""

from __future__ import annotations

import collections
import itertools
import os

import numpy as np

# Characters some Unicode versions class as white space that Python's isspace() does not.
EXTRA_SPACES = frozenset("\u180e\u200b\u200c\u200d\u2060\ufeff")
# Table entries (distinct chunks) kept before the cache is emptied: bounds memory on huge,
# diverse corpora (a few hundred bytes an entry).
MAX_ENTRIES = 2_000_000
# Misses are encoded (one library call) once this many documents or new chunks wait: the documents
# after them in a batch mostly hit.
RESOLVE_DOCUMENTS = 32
RESOLVE_CHUNKS = 8192


def _bad_start(chunk: str) -> bool:
    return not chunk or chunk[0].isspace() or chunk[0] in EXTRA_SPACES


class FastEncoder:
    """Encodes batches of documents to the ids `bpe.encode(text, add_special_tokens=False)` gives."""

    def __init__(self, bpe) -> None:
        self.bpe = bpe
        self.added = [t.content for t in bpe.get_added_tokens_decoder().values()]
        self._reset()

    @staticmethod
    def usable(bpe) -> bool:
        from tokenizers import models, pre_tokenizers

        added = [t.content for t in bpe.get_added_tokens_decoder().values()]
        return (bpe.normalizer is None and isinstance(bpe.pre_tokenizer, pre_tokenizers.ByteLevel)
                and bpe.pre_tokenizer.use_regex and isinstance(bpe.model, models.BPE) and bpe.model.dropout is None
                and all(a and not any(c.isspace() or c in EXTRA_SPACES for c in a) for a in added))

    def _reset(self) -> None:
        self.spaced: dict[str, int] = {}  # chunk c -> entry of the ids of " " + c
        self.plain: dict[str, int] = {}  # first chunk c -> entry of the ids of c
        self.bad: set[str] = set()  # chunks after the first that break the rule
        self.separators: dict[int, int] = {}  # separator id -> its entry
        self.entries: list[list[int]] = []
        self._tables: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    def _has_added(self, chunk: str) -> bool:
        for added in self.added:
            if added in chunk:
                return True
        return False

    def _add(self, table: dict[str, int], keys: list[str], texts: list[str]) -> None:
        for key, encoding in zip(keys, self.bpe.encode_batch_fast(texts, add_special_tokens=False), strict=True):
            table[key] = len(self.entries)
            self.entries.append(encoding.ids)
        self._tables = None

    def _gather(self, index: list[int], dtype) -> np.ndarray:
        if self._tables is None:
            lengths = np.fromiter(map(len, self.entries), np.int64, len(self.entries))
            flat = np.fromiter(itertools.chain.from_iterable(self.entries), np.int64, int(lengths.sum()))
            self._tables = (lengths, np.cumsum(lengths) - lengths, flat)
        lengths, starts, flat = self._tables
        index = np.fromiter(index, np.int64, len(index))  # a third faster than np.asarray on a list
        n = lengths[index]
        if len(n) and (n == 1).all():
            return flat[starts[index]].astype(dtype)
        ends = np.cumsum(n)
        positions = np.arange(ends[-1] if len(ends) else 0) - np.repeat(ends - n - starts[index], n)
        return flat[positions].astype(dtype)

    def encode_batch(self, texts: list[str], dtype) -> list[np.ndarray | list[int]]:
        """Per document, either a list of table entries or (for the library's documents) an array of ids;
        `assemble` turns them into ids."""
        if len(self.entries) > MAX_ENTRIES:
            self._reset()
        spaced, plain, bad = self.spaced, self.plain, self.bad
        get_spaced = spaced.__getitem__
        out: list = [None] * len(texts)
        pending: list[tuple[int, list[str]]] = []
        new_spaced: set[str] = set()
        new_plain: set[str] = set()
        whole: list[int] = []

        def resolve() -> None:
            # The misses of the pending documents in one library call, then their entries.
            if new_spaced:
                keys = sorted(new_spaced)
                self._add(spaced, keys, [" " + c for c in keys])
            if new_plain:
                keys = sorted(new_plain)
                self._add(plain, keys, keys)
            for i, chunks in pending:
                out[i] = [plain[chunks[0]], *map(get_spaced, itertools.islice(chunks, 1, None))]
            new_spaced.clear()
            new_plain.clear()
            pending.clear()

        for i, text in enumerate(texts):
            chunks = text.split(" ")
            try:
                out[i] = [plain[chunks[0]], *map(get_spaced, itertools.islice(chunks, 1, None))]
                continue
            except KeyError:
                pass
            rest = set(itertools.islice(chunks, 1, None)).difference(spaced)
            rest -= new_spaced
            if rest & bad or self._has_added(chunks[0]):
                whole.append(i)
                continue
            broken = {c for c in rest if _bad_start(c) or self._has_added(c)}
            if broken:
                bad |= broken
                whole.append(i)
                continue
            new_spaced |= rest
            if chunks[0] not in plain:
                new_plain.add(chunks[0])
            pending.append((i, chunks))
            if len(pending) >= RESOLVE_DOCUMENTS or len(new_spaced) >= RESOLVE_CHUNKS:
                resolve()
        resolve()
        if whole:
            for i, encoding in zip(whole, self.bpe.encode_batch_fast([texts[i] for i in whole],
                                                                     add_special_tokens=False), strict=True):
                out[i] = np.asarray(encoding.ids, dtype=dtype)
        return out

    def assemble(self, parts: list, separator: int, lead: bool, dtype) -> np.ndarray:
        """The ids of `parts` (from encode_batch) one after another with `separator` between two, and
        before the first too when `lead`."""
        if separator not in self.separators:
            self.separators[separator] = len(self.entries)
            self.entries.append([separator])
            self._tables = None
        sep = self.separators[separator]
        pieces: list[np.ndarray] = []
        run: list[int] = []
        for k, part in enumerate(parts):
            if k or lead:
                run.append(sep)
            if isinstance(part, list):
                run += part
            else:
                if run:
                    pieces.append(self._gather(run, dtype))
                    run = []
                pieces.append(part)
        if run:
            pieces.append(self._gather(run, dtype))
        return np.concatenate(pieces) if pieces else np.zeros(0, dtype)


# Worker processes: each holds its own tokenizer and cache and encodes whole jobs (a run of documents),
# returned in submission order, so the shards are those of one process.
_worker: FastEncoder | None = None
_warm: FastEncoder | None = None  # the parent's encoder at the fork: its cache, shared copy-on-write


def _init_worker(tokenizer_json: str) -> None:
    global _worker
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core a worker: the workers are the parallelism
    os.environ["RAYON_NUM_THREADS"] = "1"
    from tokenizers import Tokenizer

    _worker = FastEncoder(Tokenizer.from_str(tokenizer_json))
    if _warm is not None:  # the parent's chunks, already encoded: a warm start (same ids, same library)
        for name in ("spaced", "plain", "bad", "separators", "entries", "_tables"):
            setattr(_worker, name, getattr(_warm, name))


def _encode_job(job: tuple[list[str], list[bool], int, str]) -> dict[str, np.ndarray]:
    """Per split ("train", "val") the ids of the job's documents of it, joined by the separator."""
    texts, is_val, separator, dtype = job
    parts = _worker.encode_batch(texts, dtype)
    by_split: dict[str, list] = {"train": [], "val": []}
    for part, val in zip(parts, is_val, strict=True):
        by_split["val" if val else "train"].append(part)
    return {split: _worker.assemble(p, separator, False, dtype) for split, p in by_split.items() if p}


class WorkerPool:
    """`processes` forked workers; `submit` a job, `results` yields them in order, at most `ahead`
    waiting at a time so memory stays bounded."""

    def __init__(self, bpe, processes: int, ahead: int = 4, warm: FastEncoder | None = None) -> None:
        import multiprocessing

        global _warm

        saved = os.environ.get("TOKENIZERS_PARALLELISM")
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # read at the fork: no fork warning, no threads
        _warm = warm
        try:
            self.pool = multiprocessing.get_context("fork").Pool(processes, _init_worker, (bpe.to_str(),))
        finally:
            _warm = None
            if saved is None:
                del os.environ["TOKENIZERS_PARALLELISM"]
            else:
                os.environ["TOKENIZERS_PARALLELISM"] = saved
        self.ahead = ahead
        self.waiting: collections.deque = collections.deque()

    def submit(self, job) -> list:
        """Queue `job`; the results (with their tags) that are due, oldest first."""
        self.waiting.append((job[-1], self.pool.apply_async(_encode_job, (job[:-1],))))
        done = []
        while len(self.waiting) > self.ahead:
            tag, result = self.waiting.popleft()
            done.append((tag, result.get()))
        return done

    def drain(self) -> list:
        done = [(tag, result.get()) for tag, result in self.waiting]
        self.waiting.clear()
        return done

    def close(self) -> None:
        self.pool.terminate()
        self.pool.join()
