"""The per-rank cross-stage block cache (docs/spec.md section 4).

Forward: holds the block summaries a rank produced or received, per microbatch, and serves later
chunks on the same rank with fresh autograd leaves (so no chunk's graph reaches into another's).
Backward: gradients of those reads are *deposited* here and *collected* by the chunk that put the
entry, when its backward runs. Interleaved 1F1B runs a rank's later chunks' backward first, so
every deposit is complete before it is collected; a deposit left over is a bug and raises.
"""

from __future__ import annotations

import torch

from attnres_pp.comm.plan import Source


class CacheError(RuntimeError):
    pass


class BlockCache:
    def __init__(self) -> None:
        self._values: dict[tuple[int, Source], torch.Tensor] = {}
        self._deposits: dict[tuple[int, Source], torch.Tensor] = {}
        # Bytes of the entries and of the deposits, kept as they change: every put and deposit
        # updates a peak, and summing the whole cache there would cost O(entries) per action.
        self._entry_bytes = 0
        self._deposit_bytes = 0
        self.peak_bytes = 0  # entries alone
        self.peak_held_bytes = 0  # entries plus deposits (docs/spec.md section 8's cache_peak_bytes)

    def put(self, microbatch_index: int, source: Source, value: torch.Tensor) -> None:
        key = (microbatch_index, source)
        if key in self._values:
            raise CacheError(f"cache entry {source} of microbatch {microbatch_index} is stored twice")
        self._values[key] = value.detach()
        self._entry_bytes += _bytes(value)
        self.peak_bytes = max(self.peak_bytes, self._entry_bytes)
        self._note_held()

    def read(self, microbatch_index: int, source: Source) -> torch.Tensor:
        """A new leaf that requires grad, sharing storage with the cached value."""
        try:
            value = self._values[(microbatch_index, source)]
        except KeyError:
            raise CacheError(
                f"cache miss: {source} of microbatch {microbatch_index} was never stored on this rank "
                "(the payload plan and the cache disagree)"
            ) from None
        return value.detach().requires_grad_(True)

    def free(self, microbatch_index: int, source: Source) -> None:
        value = self._values.pop((microbatch_index, source), None)
        if value is not None:
            self._entry_bytes -= _bytes(value)

    def deposit(self, microbatch_index: int, source: Source, grad: torch.Tensor) -> None:
        key = (microbatch_index, source)
        held = self._deposits.get(key)
        total = grad if held is None else held + grad
        self._deposits[key] = total
        self._deposit_bytes += _bytes(total) - (0 if held is None else _bytes(held))
        self._note_held()

    def _note_held(self) -> None:
        self.peak_held_bytes = max(self.peak_held_bytes, self.held_bytes)

    def collect(self, microbatch_index: int, source: Source) -> torch.Tensor | None:
        deposit = self._deposits.pop((microbatch_index, source), None)
        if deposit is not None:
            self._deposit_bytes -= _bytes(deposit)
        return deposit

    def check_drained(self, microbatch_index: int) -> None:
        """Raise if a deposit of this microbatch was never collected."""
        left = sorted(str(s) for (mb, s) in self._deposits if mb == microbatch_index)
        if left:
            raise CacheError(f"gradient deposits {left} of microbatch {microbatch_index} were never collected")

    @property
    def nbytes(self) -> int:
        """Bytes of the entries."""
        return self._entry_bytes

    @property
    def held_bytes(self) -> int:
        """Bytes of the entries plus the gradient deposits not yet collected (what the memory meter
        counts as the cache at this moment; `peak_held_bytes` is its maximum)."""
        return self._entry_bytes + self._deposit_bytes

    def __len__(self) -> int:
        return len(self._values)


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
