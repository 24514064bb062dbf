"""Partition of the model's transformer layers into C = P * V chunks (SPEC section 3).

Pure standard library: the simulator and the payload planner use it without torch.
Chunk c runs on rank c % P ("loop" placement); chunk 0 also holds the embedding and chunk C - 1
the final read, output norm, LM head and loss.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Partition:
    """layers_per_chunk[c] transformer layers go to chunk c, in order."""

    n_stages: int
    n_virtual: int
    layers_per_chunk: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.n_stages < 1:
            raise ValueError(f"stages={self.n_stages} is invalid: need at least 1 pipeline rank")
        if self.n_virtual < 1:
            raise ValueError(f"virtual={self.n_virtual} is invalid: need at least 1 chunk per rank")
        if len(self.layers_per_chunk) != self.n_chunks:
            raise ValueError(
                f"layer counts {list(self.layers_per_chunk)} give {len(self.layers_per_chunk)} chunks, "
                f"but stages x virtual = {self.n_chunks}: give one count per chunk"
            )
        if any(n < 1 for n in self.layers_per_chunk):
            raise ValueError(
                f"layer counts {list(self.layers_per_chunk)}: every chunk needs at least one layer"
            )

    @property
    def n_chunks(self) -> int:
        return self.n_stages * self.n_virtual

    @property
    def n_layers(self) -> int:
        return sum(self.layers_per_chunk)

    def rank_of(self, chunk_index: int) -> int:
        return chunk_index % self.n_stages

    def chunks_of(self, pp_rank: int) -> list[int]:
        return list(range(pp_rank, self.n_chunks, self.n_stages))

    def layer_range(self, chunk_index: int) -> range:
        start = sum(self.layers_per_chunk[:chunk_index])
        return range(start, start + self.layers_per_chunk[chunk_index])

    def sublayer_range(self, chunk_index: int) -> range:
        layers = self.layer_range(chunk_index)
        return range(2 * layers.start, 2 * layers.stop)


def make_partition(
    n_layers: int, n_stages: int, n_virtual: int, layer_counts: list[int] | tuple[int, ...] | None = None
) -> Partition:
    """Uniform split (earlier chunks take the remainder) or an explicit list of layer counts."""
    n_chunks = n_stages * n_virtual
    if layer_counts is None:
        if n_chunks > n_layers:
            raise ValueError(
                f"{n_layers} layers cannot fill stages x virtual = {n_chunks} chunks: "
                f"use at most {n_layers} chunks or more layers"
            )
        base, extra = divmod(n_layers, n_chunks)
        layer_counts = [base + (1 if c < extra else 0) for c in range(n_chunks)]
    partition = Partition(n_stages=n_stages, n_virtual=n_virtual, layers_per_chunk=tuple(layer_counts))
    if partition.n_layers != n_layers:
        raise ValueError(
            f"layer counts {list(layer_counts)} sum to {partition.n_layers}, but the model has "
            f"{n_layers} layers: make them add up"
        )
    return partition
