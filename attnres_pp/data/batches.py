"""Batches of training and validation windows, drawn so that a step's batch is a pure function
of (tokens, seed, step): it never depends on what ran before, so runs resume and repeat exactly,
and every engine (single process or pipeline) sees the same global batch."""

from __future__ import annotations

import numpy as np
import torch

# Separate random streams for training steps and for the fixed validation batches.
_TRAIN_STREAM = 0
_VAL_STREAM = 1


def batch_at(
    tokens_N: np.ndarray, step: int, batch_size: int, seq_len: int, seed: int, rows: range | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The global training batch of `step`: `(inputs_BT, targets_BT)`, int64, with
    `B = batch_size`, `T = seq_len` and `targets_BT[b, t] = inputs_BT[b, t + 1]` in the stream.
    `rows` (default all): only those rows of it, read without reading the others (a data-parallel
    replica's share)."""
    rng = np.random.default_rng([seed, _TRAIN_STREAM, step])
    return _windows(tokens_N, rng, batch_size, seq_len, rows)


def val_batch_at(
    tokens_N: np.ndarray, index: int, batch_size: int, seq_len: int, seed: int, rows: range | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validation batch `index` of `val_batches` (or only its `rows`)."""
    return _windows(tokens_N, np.random.default_rng([seed, _VAL_STREAM, index]), batch_size, seq_len, rows)


def val_batches(
    tokens_N: np.ndarray, n_batches: int, batch_size: int, seq_len: int, seed: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`n_batches` fixed validation batches (same for the whole run, derived from `seed`)."""
    return [val_batch_at(tokens_N, index, batch_size, seq_len, seed) for index in range(n_batches)]


def _windows(
    tokens_N: np.ndarray, rng: np.random.Generator, batch_size: int, seq_len: int, rows: range | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    n_starts = len(tokens_N) - seq_len
    if n_starts < 1:
        raise ValueError(
            f"seq_len={seq_len} needs at least {seq_len + 1} tokens, the split has {len(tokens_N)}: "
            "use a smaller --seq-len or more data"
        )
    starts_B = rng.integers(0, n_starts, size=batch_size)  # every row's start is drawn, so rows agree
    if rows is not None:
        starts_B = starts_B[rows.start:rows.stop]
    index_BW = starts_B[:, None] + np.arange(seq_len + 1)[None, :]
    window_BW = torch.from_numpy(np.asarray(tokens_N[index_BW], dtype=np.int64))
    return window_BW[:, :-1].contiguous(), window_BW[:, 1:].contiguous()
