"""Incremental-decoding state of one batch of sequences on one process or pipeline rank (docs/spec.md section 7).

Two things carry over from one forward pass to the next, both indexed by token position so that a
pass may cover any run of positions (a prefill piece, one new token) and a rank may run its chunks'
passes in any order that keeps each layer's own passes in position order:

- per transformer layer, the attention keys and values of every earlier position (`KVSlot`);
- under MSAR, every depth-attention source the process reads, at every earlier position: a
  source's streams are causal convolutions over the sequence (docs/spec.md section 1.4), so the streams of new
  tokens need the last (kappa - 1) positions of that source. A completed block b_j is keyed
  ("block", j) and its values are the same at every reading site; the open partial differs per
  reading sublayer l, so it is keyed ("partial", l).

Buffers are allocated on first use, for the layers and sources this process actually touches (a
rank holds only its own layers' caches). The model's learned positions end at `seq_len`, so a pass
beyond it is refused (no sliding window: it would change what every later token sees).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnres_pp.model.config import ModelConfig


class ContextFull(ValueError):
    """A pass would run past the model's `seq_len` positions."""


class DecodeState:
    """Caches for one batch of sequences decoded together (the same positions in every sequence).
    Buffers take the batch size, dtype and device of the first tensors stored in them."""

    def __init__(self, cfg: ModelConfig) -> None:
        self.cfg = cfg
        self.max_len = cfg.seq_len
        # Positions of history a source's streams need: the longest kernel reaches kappa - 1 back.
        self.history_len = max(cfg.stream_kernels) - 1 if cfg.residual == "msar" else 0
        self._kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._sources: dict[tuple[str, int], torch.Tensor] = {}

    def step(self, start: int, n_tokens: int) -> DecodeStep:
        """The view of this state for one pass over positions start .. start + n_tokens - 1."""
        if start < 0 or n_tokens < 1:
            raise ValueError(f"a pass needs start >= 0 and at least one token, got start={start}, n={n_tokens}")
        if start + n_tokens > self.max_len:
            raise ContextFull(
                f"positions {start}..{start + n_tokens - 1} run past the model's context of seq_len="
                f"{self.max_len} positions (learned position embeddings): use a shorter prompt or fewer new tokens")
        return DecodeStep(self, start, n_tokens)

    def _kv_buffers(self, layer_index: int, like_BHTE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if layer_index not in self._kv:
            batch, heads, _seq, head_dim = like_BHTE.shape
            shape = (batch, heads, self.max_len, head_dim)
            self._kv[layer_index] = (like_BHTE.new_zeros(shape), like_BHTE.new_zeros(shape))
        return self._kv[layer_index]

    def _source_buffer(self, key: tuple[str, int], like_BTD: torch.Tensor) -> torch.Tensor:
        if key not in self._sources:
            batch, _seq, width = like_BTD.shape
            self._sources[key] = like_BTD.new_zeros((batch, self.max_len, width))
        return self._sources[key]

    def keep_rows(self, rows: list[int]) -> None:
        """Keep only the sequences at batch indices `rows` (in that order), e.g. once the others are
        done; the next pass carries len(rows) sequences."""
        if not rows:
            raise ValueError("keep_rows needs at least one row: reset() to start a new batch")
        self._kv = {layer: tuple(t[rows] for t in pair) for layer, pair in self._kv.items()}
        self._sources = {key: t[rows] for key, t in self._sources.items()}

    @property
    def nbytes(self) -> int:
        tensors = [t for pair in self._kv.values() for t in pair] + list(self._sources.values())
        return sum(t.numel() * t.element_size() for t in tensors)


@dataclass(frozen=True)
class DecodeStep:
    """One forward pass over positions [start, start + n_tokens) of a DecodeState."""

    state: DecodeState
    start: int
    n_tokens: int

    @property
    def stop(self) -> int:
        return self.start + self.n_tokens

    def kv(self, layer_index: int) -> KVSlot:
        return KVSlot(self, layer_index)

    def with_history(self, key: tuple[str, int], v_BTD: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Store source `key` at this pass's positions; return it with up to `history_len` earlier
        positions prepended ([B, n_prefix + T, d]) and n_prefix. Storing is idempotent: every
        reading site of a block stores the same values."""
        buffer_BSD = self.state._source_buffer(key, v_BTD)
        buffer_BSD[:, self.start:self.stop] = v_BTD
        lo = max(0, self.start - self.state.history_len)
        return buffer_BSD[:, lo:self.stop], self.start - lo


@dataclass(frozen=True)
class KVSlot:
    """The key/value cache of one transformer layer for one pass."""

    step: DecodeStep
    layer_index: int

    def append(self, k_BHTE: torch.Tensor, v_BHTE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this pass's keys and values; return those of every position up to the pass's last
        ([B, H, stop, E] views of the cache)."""
        step = self.step
        if k_BHTE.shape[2] != step.n_tokens:
            raise ValueError(f"layer {self.layer_index}: {k_BHTE.shape[2]} tokens in a pass of {step.n_tokens}")
        keys, values = step.state._kv_buffers(self.layer_index, k_BHTE)
        keys[:, :, step.start:step.stop] = k_BHTE
        values[:, :, step.start:step.stop] = v_BHTE
        return keys[:, :, :step.stop], values[:, :, :step.stop]

    def sdpa_mask(self, device: torch.device) -> dict:
        """Keyword arguments of scaled_dot_product_attention for this pass's queries.

        From position 0 the keys are the pass's own, so the ordinary causal flag applies (and a
        whole-prompt prefill runs exactly the training forward's attention). One new token sees
        every key. Otherwise query i (position start + i) sees keys 0 .. start + i.
        """
        step = self.step
        if step.start == 0:
            return {"is_causal": True}
        if step.n_tokens == 1:
            return {}
        query_pos_T1 = torch.arange(step.start, step.stop, device=device).unsqueeze(1)
        return {"attn_mask": torch.arange(step.stop, device=device).unsqueeze(0) <= query_pos_T1}
