"""`attnres-pp bench prepare`: the throughput of `attnres-pp prepare` with a byte-level BPE.

A deterministic synthetic corpus (documents of words drawn, Zipf-like, from a fixed made-up
vocabulary by a seeded RNG; 64 MB, quick 8 MB) in .txt files; per round, BPE training at vocab
8,192 on a sample of it and the encoding of all of it, timed apart (the encoding's figure covers
reading, encoding and writing the shards; the encoding is `prepare`'s own: the chunk cache of
`data.bpe_cache.FastEncoder` in front of the library, which sees each distinct space-led chunk once,
in batches of misses). Medians over rounds. Target: >= 20 MB/s of encode.
"""

from __future__ import annotations

import os
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from attnres_pp.bench.common import markdown_table
from attnres_pp.data.prepare import prepare, train_bpe

VOCAB_SIZE = 8192
SYLLABLES = ["ka", "lo", "mi", "tra", "ven", "sor", "pel", "quin", "dor", "ax", "ul", "ber", "ti", "nos", "gre",
             "fa", "é", "th"]
TARGET_MB_S = 20.0


def _corpus(folder: Path, total_bytes: int, seed: int = 0) -> int:
    rng = random.Random(seed)
    words = ["".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 4))) for _ in range(30_000)]
    weights = [1 / (rank + 1) for rank in range(len(words))]
    written = index = 0
    while written < total_bytes:
        text = " ".join(rng.choices(words, weights, k=rng.randint(50, 2000))) + ".\n"
        data = text.encode()
        (folder / f"doc_{index:06d}.txt").write_bytes(data)
        written += len(data)
        index += 1
    return written


def run(quick: bool, out_dir: Path | None, progress: Callable[[str], None]) -> dict:
    del out_dir  # tables only
    total = (8 if quick else 64) * 2**20
    rounds = 3
    scratch = Path(tempfile.mkdtemp(prefix="bench-prepare-"))
    try:
        corpus = scratch / "corpus"
        corpus.mkdir()
        n_bytes = _corpus(corpus, total)
        sample = sorted(corpus.iterdir())[: max(1, len(list(corpus.iterdir())) // 8)]
        sample_bytes = sum(p.stat().st_size for p in sample)
        rows = []
        for r in range(rounds):
            started = time.perf_counter()
            train_bpe((p.read_text() for p in sample), VOCAB_SIZE)
            train_s = time.perf_counter() - started
            out = scratch / f"data_{r}"
            result = prepare([str(corpus)], out, vocab_size=VOCAB_SIZE, log=lambda line: None)
            load = os.getloadavg()[0]
            rows.append({"round": r, "sample_train_s": train_s, "prepare_train_s": result.train_s,
                         "encode_s": result.encode_s, "encode_mb_s": result.encode_mb_s, "load_1min": load,
                         "bytes_per_token": n_bytes / sum(result.meta["tokens"].values())})
            progress(f"  round {r}: train (sample {sample_bytes / 1e6:.1f} MB) {train_s:.1f} s, encode "
                     f"{result.encode_mb_s:.1f} MB/s (load {load:.2f})")
            shutil.rmtree(out)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    median = {key: statistics.median(row[key] for row in rows)
              for key in ("sample_train_s", "prepare_train_s", "encode_s", "encode_mb_s")}
    return {"corpus_bytes": n_bytes, "sample_bytes": sample_bytes, "vocab_size": VOCAB_SIZE, "rounds": rows,
            "median": median, "target_mb_s": TARGET_MB_S, "meets_target": median["encode_mb_s"] >= TARGET_MB_S,
            "tokenizers_parallelism": os.environ.get("TOKENIZERS_PARALLELISM", "(unset)"),
            "cpu_count": os.cpu_count()}


def to_markdown(payload: dict) -> str:
    median = payload["median"]
    rows = [[r["round"], r["sample_train_s"], r["prepare_train_s"], r["encode_s"], r["encode_mb_s"],
             r["bytes_per_token"], r["load_1min"]] for r in payload["rounds"]]
    return "\n".join([
        "## prepare: BPE training and encoding throughput", "",
        f"Synthetic corpus of {payload['corpus_bytes'] / 1e6:.1f} MB; BPE vocab {payload['vocab_size']:,} trained on "
        f"a {payload['sample_bytes'] / 1e6:.1f} MB sample (and, inside `prepare`, on all of it); encoding covers "
        f"reading, the encode (bpe_cache's chunk cache in front of the library, which encodes each distinct "
        f"space-led chunk once) and writing shards. TOKENIZERS_PARALLELISM {payload['tokenizers_parallelism']}.", "",
        f"Median encode **{median['encode_mb_s']:.1f} MB/s** (target {payload['target_mb_s']:.0f}: "
        f"{'met' if payload['meets_target'] else 'not met'}); sample training {median['sample_train_s']:.1f} s.", "",
        markdown_table(["round", "train sample (s)", "train all (s)", "encode (s)", "encode MB/s", "bytes/token",
                        "load (1 min)"], rows)])
