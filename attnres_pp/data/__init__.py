"""Training data: corpora (built-in stdlib bytes, text files, uint16 token files) and
deterministic batches keyed by (seed, step)."""

from attnres_pp.data.batches import batch_at, val_batch_at, val_batches
from attnres_pp.data.corpus import Corpus, builtin_corpus_bytes, load_corpus

__all__ = ["Corpus", "batch_at", "builtin_corpus_bytes", "load_corpus", "val_batch_at", "val_batches"]
