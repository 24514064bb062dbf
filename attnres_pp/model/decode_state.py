"""Incremental-decoding state of one batch of sequences on one process or pipeline rank (docs/spec.md
sections 7 and 11).

Two things carry over from one forward pass to the next, both indexed by token position so that a
pass may cover any run of positions (a prefill piece, one new token) and a rank may run its chunks'
passes in any order that keeps each layer's own passes in position order:

- per transformer layer, the attention keys and values of the last `window` positions (`KVSlot`), in
  a ring of `window` slots (position p in slot p % window): a token attends to at most `window`
  tokens, itself included, and the cache does not grow with the generated length. A key carries
  its position already (rotated, or a learned embedding), and attention does not depend on the
  order of its keys, so a one-token pass reads the ring in slot order;
- under MSAR, every depth-attention source the process reads, at its last positions: a source's
  streams are causal convolutions over the sequence (docs/spec.md section 1.4), so the streams of new
  tokens need the last (kappa - 1) positions of that source. A completed block b_j is keyed
  ("block", j) and its values are the same at every reading site; the open partial differs per
  reading sublayer l, so it is keyed ("partial", l). A block is read by several chunks, and a
  pipeline rank runs a later chunk's pieces of a pass after an earlier chunk's, so a source may be
  read back to `history_len` positions before its pass's first piece: each source keeps a ring of
  seq_len + history_len positions, which holds that as long as a pass (all its pieces) spans at most
  seq_len positions (`generate.loop.prefill_passes` cuts a longer prompt into several passes). A
  read of a position no longer held is an error, never a silent zero.

Buffers are allocated on first use, for the layers and sources this process actually touches (a
rank holds only its own layers' caches). Rotary positions continue past the trained `seq_len`;
learned positions end there, so for such a model a pass beyond it is refused (`ContextFull`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnres_pp.model.config import ModelConfig


class ContextFull(ValueError):
    """A pass would run past the model's `seq_len` positions (learned position embeddings)."""


class DecodeState:
    """Caches for one batch of sequences decoded together (the same positions in every sequence).
    Buffers take the batch size, dtype and device of the first tensors stored in them.

    `window`: keys and values a token attends to, itself included (default the trained `seq_len`)."""

    def __init__(self, cfg: ModelConfig, window: int | None = None) -> None:
        window = cfg.seq_len if window is None else window
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"the attention window must be an integer >= 1, got {window!r}")
        self.cfg = cfg
        self.window = window
        # Learned positions end at seq_len: such a model never holds more than seq_len positions.
        self.max_len = cfg.seq_len if cfg.positions == "learned" else None
        self.ring_len = window if self.max_len is None else min(window, self.max_len)
        # Positions of history a source's streams need: the longest kernel reaches kappa - 1 back.
        self.history_len = max(cfg.stream_kernels) - 1 if cfg.residual == "msar" else 0
        self._kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # A source is read at positions back to history_len before the first piece of a pass, and a
        # pipeline rank runs a later chunk's pieces after an earlier chunk's, so its ring holds a
        # whole pass (at most seq_len positions: `generate.loop.prefill_passes`) and its history.
        self.source_ring_len = cfg.seq_len + (self.history_len if self.max_len is None else 0)
        # source key -> (ring [B, source_ring_len, d], the position each slot holds, -1 for none)
        self._sources: dict[tuple[str, int], tuple[torch.Tensor, list[int]]] = {}

    def step(self, start: int, n_tokens: int) -> DecodeStep:
        """The view of this state for one pass over positions start .. start + n_tokens - 1."""
        if start < 0 or n_tokens < 1:
            raise ValueError(f"a pass needs start >= 0 and at least one token, got start={start}, n={n_tokens}")
        if self.max_len is not None and start + n_tokens > self.max_len:
            raise ContextFull(
                f"positions {start}..{start + n_tokens - 1} run past the model's context of seq_len="
                f"{self.max_len} positions (learned position embeddings): use a shorter prompt or fewer new tokens")
        return DecodeStep(self, start, n_tokens)

    def _kv_ring(self, layer_index: int, like_BGTE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if layer_index not in self._kv:
            batch, heads, _seq, head_dim = like_BGTE.shape
            shape = (batch, heads, self.ring_len, head_dim)
            self._kv[layer_index] = (like_BGTE.new_zeros(shape), like_BGTE.new_zeros(shape))
        return self._kv[layer_index]

    def _source_ring(self, key: tuple[str, int], like_BTD: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        if key not in self._sources:
            batch, _seq, width = like_BTD.shape
            self._sources[key] = (like_BTD.new_zeros((batch, self.source_ring_len, width)),
                                  [-1] * self.source_ring_len)
        return self._sources[key]

    def keep_rows(self, rows: list[int]) -> None:
        """Keep only the sequences at batch indices `rows` (in that order), e.g. once the others are
        done; the next pass carries len(rows) sequences."""
        if not rows:
            raise ValueError("keep_rows needs at least one row: reset() to start a new batch")
        self._kv = {layer: tuple(t[rows] for t in pair) for layer, pair in self._kv.items()}
        self._sources = {key: (t[rows], held) for key, (t, held) in self._sources.items()}

    @property
    def nbytes(self) -> int:
        """Bytes held between passes: every key/value ring and every source's history."""
        tensors = [t for pair in self._kv.values() for t in pair] + [t for t, _held in self._sources.values()]
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
        state = self.state
        lo = max(0, self.start - state.history_len)
        ring_BSD, held_S = state._source_ring(key, v_BTD)
        ring = ring_BSD.shape[1]
        missing = [p for p in range(lo, self.start) if held_S[p % ring] != p]
        if missing:
            raise RuntimeError(f"source {key}: positions {missing[0]}..{missing[-1]} are no longer held: a pass "
                               f"reached more than seq_len={state.cfg.seq_len} positions back, or skipped some")
        slots = torch.arange(lo, self.start, device=ring_BSD.device) % ring
        v_BSD = torch.cat([ring_BSD.index_select(1, slots), v_BTD], dim=1)
        kept = min(self.n_tokens, ring)
        ring_BSD.index_copy_(1, torch.arange(self.stop - kept, self.stop, device=ring_BSD.device) % ring,
                             v_BTD[:, -kept:])
        for p in range(self.stop - kept, self.stop):
            held_S[p % ring] = p
        return v_BSD, self.start - lo


@dataclass(frozen=True)
class KVSlot:
    """The key/value cache of one transformer layer for one pass: a ring of `ring_len` slots."""

    step: DecodeStep
    layer_index: int

    @property
    def _first_key(self) -> int:
        """The oldest position a query of this pass attends to: window - 1 before the first query."""
        return max(0, self.step.start - self.step.state.window + 1)

    def append(self, k_BGTE: torch.Tensor, v_BGTE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this pass's keys and values; return those this pass's queries read, `[B, G, S, E]`:
        one new token: the ring itself (every held position is within its window; slot order);
        several: positions first_key .. stop - 1 in order (the held ones before the pass, then the
        pass's own), to be read through `sdpa_mask`'s banded causal mask."""
        step, ring = self.step, self.step.state.ring_len
        if k_BGTE.shape[2] != step.n_tokens:
            raise ValueError(f"layer {self.layer_index}: {k_BGTE.shape[2]} tokens in a pass of {step.n_tokens}")
        keys, values = step.state._kv_ring(self.layer_index, k_BGTE)
        if step.n_tokens == 1:
            slot = step.start % ring
            keys[:, :, slot:slot + 1] = k_BGTE
            values[:, :, slot:slot + 1] = v_BGTE
            return keys[:, :, :min(step.stop, ring)], values[:, :, :min(step.stop, ring)]
        # Read the held positions before the ring slots are overwritten by this pass's own.
        held_slots = torch.arange(self._first_key, step.start, device=keys.device) % ring
        keys_S = torch.cat([keys.index_select(2, held_slots), k_BGTE], dim=2)
        values_S = torch.cat([values.index_select(2, held_slots), v_BGTE], dim=2)
        kept = min(step.n_tokens, ring)  # a pass longer than the ring leaves only its last positions
        new_slots = torch.arange(step.stop - kept, step.stop, device=keys.device) % ring
        keys.index_copy_(2, new_slots, k_BGTE[:, :, -kept:])
        values.index_copy_(2, new_slots, v_BGTE[:, :, -kept:])
        return keys_S, values_S

    def sdpa_mask(self, device: torch.device) -> dict:
        """Keyword arguments of scaled_dot_product_attention for this pass's queries over `append`'s keys.

        From position 0, with the whole pass inside the window, the keys are the pass's own, so the
        ordinary causal flag applies (and a whole-prompt prefill runs exactly the training forward's
        attention). One new token sees every key returned. Otherwise query i (position start + i)
        sees the keys of positions start + i - window + 1 .. start + i: a banded causal mask.
        """
        step, window = self.step, self.step.state.window
        if step.n_tokens == 1:
            return {}
        if step.start == 0 and step.n_tokens <= window:
            return {"is_causal": True}
        query_pos_T1 = torch.arange(step.start, step.stop, device=device).unsqueeze(1)
        key_pos_1S = torch.arange(self._first_key, step.stop, device=device).unsqueeze(0)
        return {"attn_mask": (key_pos_1S <= query_pos_T1) & (key_pos_1S > query_pos_T1 - window)}
