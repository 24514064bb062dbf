"""What one rank reads from the data source: its replica's rows of each global batch, split into
microbatches; inputs only on the rank of the first chunk, targets only on the rank of the last.

Batches are pure functions of (seed, step) (`data.batches`), so a rank reads its share straight
from the corpus by (step, dp_rank) and the driver sends no tensors. A rank that runs neither end
of the pipeline never loads the corpus at all.
"""

from __future__ import annotations

from pathlib import Path

import torch

from attnres_pp.data import Corpus, batch_at, load_corpus, val_batch_at
from attnres_pp.train.config import RunConfig

MicrobatchLists = tuple[list[torch.Tensor] | None, list[torch.Tensor] | None]


def resolve_data_path(spec: str) -> str:
    """`spec` as every rank can open it: 'builtin', or an absolute path (a rank's working directory,
    e.g. a Ray actor's, is not the driver's). Several nodes need the file at that path on each."""
    return spec if spec == "builtin" else str(Path(spec).expanduser().resolve())


def replica_rows(batch_size: int, data_parallel: int, dp_rank: int) -> range:
    """The rows of each global batch of `batch_size` rows that replica `dp_rank` of D reads."""
    share = batch_size // data_parallel
    return range(dp_rank * share, (dp_rank + 1) * share)


class RankData:
    """Replica `dp_rank`'s rows of every batch: rows [dp_rank * B / D, (dp_rank + 1) * B / D) of the
    global batch of B sequences, cut into m equal microbatches of consecutive rows."""

    def __init__(self, run_cfg: RunConfig, dp_rank: int, *, needs_inputs: bool, needs_targets: bool,
                 corpus: Corpus | None = None, data_path: str | None = None) -> None:
        train = run_cfg.train
        self.run_cfg = run_cfg
        self.needs_inputs, self.needs_targets = needs_inputs, needs_targets
        self.rows = replica_rows(train.batch_size, run_cfg.pipeline.data_parallel, dp_rank)
        self._corpus = corpus
        self._data_path = data_path or train.data

    @property
    def corpus(self) -> Corpus:
        if self._corpus is None:  # loaded on first use: middle ranks never need it
            self._corpus = load_corpus(self._data_path)
        return self._corpus

    def train_microbatches(self, step: int) -> MicrobatchLists:
        """This rank's microbatches of training step `step`."""
        if not (self.needs_inputs or self.needs_targets):
            return None, None
        train = self.run_cfg.train
        inputs_bT, targets_bT = batch_at(self.corpus.train_tokens_N, step, train.batch_size,
                                         self.run_cfg.model.seq_len, train.seed, self.rows)
        return self.split(inputs_bT, targets_bT)

    def val_microbatches(self, index: int) -> MicrobatchLists:
        """This rank's microbatches of the run's validation batch `index`."""
        if not (self.needs_inputs or self.needs_targets):
            return None, None
        train = self.run_cfg.train
        inputs_bT, targets_bT = val_batch_at(self.corpus.val_tokens_N, index, train.batch_size,
                                             self.run_cfg.model.seq_len, train.seed, self.rows)
        return self.split(inputs_bT, targets_bT, self.run_cfg.eval_microbatches)

    def split(self, inputs_bT: torch.Tensor | None, targets_bT: torch.Tensor | None,
              m: int | None = None) -> MicrobatchLists:
        """This replica's rows cut into `m` microbatches (default the training's m); only the halves
        this rank needs."""
        m = self.run_cfg.train.microbatches if m is None else m

        def cut(rows_bT: torch.Tensor | None) -> list[torch.Tensor] | None:
            if rows_bT is None:
                return None
            if rows_bT.shape[0] != len(self.rows):
                raise ValueError(f"a replica's batch has {len(self.rows)} rows, got {rows_bT.shape[0]}")
            return list(rows_bT.chunk(m))

        return (cut(inputs_bT) if self.needs_inputs else None, cut(targets_bT) if self.needs_targets else None)
