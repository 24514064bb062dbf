"""Partition of the model's transformer layers into C = P * V chunks, and the placement of chunks on
ranks (docs/spec.md section 3).

Pure standard library: the simulator and the payload planner use it without torch.
Placements: "loop" (chunk c on rank c % P; GPipe, 1F1B, interleaved schedules) and "vshape" (V = 2;
chunk c on rank c for c < P, on rank 2P - 1 - c otherwise; ZB-V). Chunk 0 also holds the embedding
and chunk C - 1 the final read, output norm, LM head and loss (under tied embeddings, on two ranks, each
holds a copy of the matrix: `tied_copy_ranks`). Two consecutive chunks on one rank
exchange their tensors in memory (a self-hop): nothing goes over the wire.
"""

from __future__ import annotations

from dataclasses import dataclass

PLACEMENTS = ("loop", "vshape")


def check_placement(placement: str, n_stages: int, n_virtual: int) -> None:
    """Raise ValueError saying how to fix an unknown placement or one that does not fit P x V."""
    if placement not in PLACEMENTS:
        raise ValueError(f"placement={placement!r} is unknown: choose one of {', '.join(PLACEMENTS)}")
    if placement == "vshape" and n_virtual != 2:
        raise ValueError(f"placement 'vshape' puts exactly 2 chunks on each rank, but virtual={n_virtual}: "
                         "use virtual=2 (or the 'loop' placement)")


def chunk_rank(chunk_index: int, n_stages: int, placement: str = "loop") -> int:
    """The rank that runs chunk `chunk_index` under `placement` (docs/spec.md section 3)."""
    if placement == "loop":
        return chunk_index % n_stages
    return chunk_index if chunk_index < n_stages else 2 * n_stages - 1 - chunk_index


@dataclass(frozen=True, kw_only=True)
class Partition:
    """layers_per_chunk[c] transformer layers go to chunk c, in order; chunk c runs on
    `rank_of(c)` under `placement`."""

    n_stages: int
    n_virtual: int
    layers_per_chunk: tuple[int, ...]
    placement: str = "loop"

    def __post_init__(self) -> None:
        check_placement(self.placement, self.n_stages, self.n_virtual)
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
        return chunk_rank(chunk_index, self.n_stages, self.placement)

    def chunks_of(self, pp_rank: int) -> list[int]:
        """The chunks of `pp_rank` in the order a microbatch visits them."""
        if not 0 <= pp_rank < self.n_stages:
            return []
        if self.placement == "loop":  # chunk c on rank c % P
            return list(range(pp_rank, self.n_chunks, self.n_stages))
        return [pp_rank, 2 * self.n_stages - 1 - pp_rank]  # vshape: down the V and back up

    def is_self_hop(self, chunk_index: int) -> bool:
        """True if hop `chunk_index` -> `chunk_index + 1` joins two chunks of one rank (in memory)."""
        return self.rank_of(chunk_index) == self.rank_of(chunk_index + 1)

    def layer_range(self, chunk_index: int) -> range:
        start = sum(self.layers_per_chunk[:chunk_index])
        return range(start, start + self.layers_per_chunk[chunk_index])

    def sublayer_range(self, chunk_index: int) -> range:
        layers = self.layer_range(chunk_index)
        return range(2 * layers.start, 2 * layers.stop)


def make_partition(
    n_layers: int, n_stages: int, n_virtual: int, layer_counts: list[int] | tuple[int, ...] | None = None,
    placement: str = "loop",
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
    partition = Partition(n_stages=n_stages, n_virtual=n_virtual, layers_per_chunk=tuple(layer_counts),
                          placement=placement)
    if partition.n_layers != n_layers:
        raise ValueError(
            f"layer counts {list(layer_counts)} sum to {partition.n_layers}, but the model has "
            f"{n_layers} layers: make them add up"
        )
    return partition


def tied_copy_ranks(tied_embeddings: bool, partition: Partition) -> tuple[int, ...]:
    """The pipeline ranks that hold a copy of a tied embedding matrix: () when the embedding is not
    tied or the embedding (chunk 0) and the LM head (the last chunk) share a rank (one process, P = 1,
    the V placement: one matrix, one parameter); otherwise (first rank, last rank), which hold one copy
    each, initialised equal and kept equal by summing their two gradients every step (the embedding
    group, `train.grad_sync.sync_tied_copies`)."""
    first, last = partition.rank_of(0), partition.rank_of(partition.n_chunks - 1)
    return (first, last) if tied_embeddings and first != last else ()
