"""The completed sources of one forward pass over a range of sublayers, kept in preallocated buffers
so that every depth read sees them as one tensor without a `torch.stack` copy per read.

`RowBuffer` is one such buffer: `capacity` rows along `row_axis`, filled in order by `append`. The
rows read so far are `rows()`, a view of the buffer's prefix. Autograd sees `rows()` as a function
of the appended segments (`_Rows`): its backward hands each segment its rows of the gradient, so
gradients from every read of a source add up at that source once, and flow on from there.

Appending writes through `storage.data`, whose version counter is not the buffer's: the rows a read
saved for its backward are never written again (appends only fill rows past them), so the version
check that would refuse the write has nothing to protect here.
"""

from __future__ import annotations

import torch


class _Rows(torch.autograd.Function):
    """The first `n_rows` rows of a RowBuffer; gradient rows go back to the segments that wrote them."""

    @staticmethod
    def forward(ctx, buffer: RowBuffer, n_rows: int, *segments: torch.Tensor) -> torch.Tensor:
        ctx.row_axis = buffer.row_axis
        ctx.bounds = buffer.bounds[: len(segments)]
        return buffer.storage.narrow(buffer.row_axis, 0, n_rows)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return (None, None, *(grad.narrow(ctx.row_axis, start, stop - start) for start, stop in ctx.bounds))


class RowBuffer:
    """A tensor of `shape` whose axis `row_axis` (its length the capacity) is filled row by row."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, row_axis: int = 0) -> None:
        self.row_axis = row_axis
        self.storage = torch.empty(shape, dtype=dtype, device=device)
        self.segments: list[torch.Tensor] = []
        self.bounds: list[tuple[int, int]] = []
        self.n_rows = 0

    def append(self, segment: torch.Tensor) -> None:
        """Write `segment` (the buffer's shape with k rows) into the next k rows."""
        start, stop = self.n_rows, self.n_rows + segment.shape[self.row_axis]
        if stop > self.storage.shape[self.row_axis]:
            raise RuntimeError(f"source buffer full: {stop} rows > capacity {self.storage.shape[self.row_axis]}")
        with torch.no_grad():
            self.storage.data.narrow(self.row_axis, start, stop - start).copy_(segment)
        self.segments.append(segment)
        self.bounds.append((start, stop))
        self.n_rows = stop

    def rows(self) -> torch.Tensor:
        """Every row appended so far as one tensor (a view of the buffer), differentiable in the segments."""
        if torch.is_grad_enabled() and any(s.requires_grad for s in self.segments):
            return _Rows.apply(self, self.n_rows, *self.segments)
        return self.storage.narrow(self.row_axis, 0, self.n_rows)
