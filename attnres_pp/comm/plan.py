"""The hop payload planner (docs/spec.md section 4): the one place that decides which tensors each hop
carries and which ones a rank serves from its cross-stage cache.

The runtime, the simulator and the byte ledger all read this plan. Pure standard library.

Sources are named by `Source(kind, index)`:
- ("block", 0) is the embedding b_0; ("block", j) for j >= 1 is the plain sum of block j;
- ("partial", j) is the running sum of the open block j;
- ("residual", 0) is the standard residual stream h (the `standard` variant only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from attnres_pp.comm.partition import Partition
from attnres_pp.model.config import block_ends_of, completed_blocks

MODES = ("standard", "naive", "cached")


class Source(NamedTuple):
    kind: str
    index: int

    def __str__(self) -> str:
        return {"block": "b", "partial": "p", "residual": "h"}[self.kind] + str(self.index)


RESIDUAL = Source("residual", 0)


@dataclass(frozen=True)
class ChunkIO:
    """What one chunk exchanges, for every microbatch alike.

    received: sources arriving on the hop into this chunk (in wire order);
    cache_reads: blocks this chunk takes from its rank's cache (read or forwarded);
    produced: blocks this chunk completes (b_0 for chunk 0), plus its open partial if any;
    sent: sources on the hop out of this chunk (in wire order);
    cache_puts: completed blocks this chunk stores in its rank's cache (produced or received);
    frees: cache entries this chunk is the last reader of on its rank (freed after its forward).
    """

    chunk_index: int
    received: tuple[Source, ...]
    cache_reads: tuple[Source, ...]
    produced: tuple[Source, ...]
    sent: tuple[Source, ...]
    cache_puts: tuple[Source, ...]
    frees: tuple[Source, ...]


@dataclass(frozen=True)
class PayloadPlan:
    """chunks[c] is ChunkIO of chunk c; hops[c] is the wire order of hop c -> c + 1."""

    mode: str
    partition: Partition
    chunks: tuple[ChunkIO, ...]

    @property
    def hops(self) -> tuple[tuple[Source, ...], ...]:
        """What each hop hands to the next chunk, over the wire or (self-hops) in memory."""
        return tuple(io.sent for io in self.chunks[:-1])

    @property
    def wire_hops(self) -> tuple[tuple[Source, ...], ...]:
        """What each hop sends over the wire: a self-hop (two chunks of one rank) sends nothing."""
        return tuple(() if self.partition.is_self_hop(c) else hop for c, hop in enumerate(self.hops))

    @property
    def fwd_hop_tensors(self) -> list[int]:
        """Tensors over the wire per forward hop (docs/spec.md section 4.1; a self-hop counts zero)."""
        return [len(hop) for hop in self.wire_hops]


def _open_partial(sublayers_done: int, block_ends: tuple[int, ...]) -> Source | None:
    if sublayers_done == 0 or sublayers_done in block_ends:
        return None
    return Source("partial", completed_blocks(sublayers_done, block_ends) + 1)


def plan_payloads(*, n_sublayers: int, block_size: int = 0, block_ends: tuple[int, ...] = (), partition: Partition,
                  mode: str) -> PayloadPlan:
    """Plan every hop and every chunk's cache traffic for one microbatch (identical for all).

    The blocks are every `block_size` sublayers, or end where `block_ends` says (ModelConfig.block_ends:
    ascending, the last one `n_sublayers`); give exactly one of them unless `mode` is standard."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is unknown; choose one of {', '.join(MODES)}")
    if 2 * partition.n_layers != n_sublayers:
        raise ValueError(f"partition holds {partition.n_layers} layers but the model has {n_sublayers // 2}")
    if mode == "standard":
        return _plan_standard(partition)
    if bool(block_size) == bool(block_ends):
        raise ValueError("give exactly one of block_size (sublayers per block) and block_ends (where blocks end)")
    if block_size:
        block_ends = block_ends_of(n_sublayers, block_size=block_size)
    if block_ends[-1] != n_sublayers or list(block_ends) != sorted(set(block_ends)) or block_ends[0] < 1:
        raise ValueError(f"block_ends={block_ends} must rise strictly from >= 1 to n_sublayers={n_sublayers}")

    held_by_rank: list[set[Source]] = [set() for _ in range(partition.n_stages)]
    rows: list[dict] = []
    received: tuple[Source, ...] = ()
    for chunk_index in range(partition.n_chunks):
        rank = partition.rank_of(chunk_index)
        sublayers = partition.sublayer_range(chunk_index)
        # Chunk 0 makes b_0 itself; every later chunk starts with b_0 .. b_n completed.
        available_before = [Source("block", j) for j in range(completed_blocks(sublayers.start, block_ends) + 1)]
        if chunk_index == 0:
            available_before = []
        cache_reads = tuple(s for s in available_before if s not in received)
        if mode == "naive":
            assert not cache_reads, "naive hops carry every completed block"
        done = sublayers.stop
        completed_now = [Source("block", j) for j in range(completed_blocks(sublayers.start, block_ends) + 1,
                                                            completed_blocks(done, block_ends) + 1)]
        if chunk_index == 0:
            completed_now.insert(0, Source("block", 0))
        is_last = chunk_index == partition.n_chunks - 1
        partial = _open_partial(done, block_ends)
        if is_last and partial is not None:  # a short trailing block counts as complete
            completed_now.append(Source("block", partial.index))
            partial = None
        produced = tuple(completed_now) + ((partial,) if partial else ())
        cache_puts: tuple[Source, ...] = ()
        if mode == "cached":
            holds_now = tuple(s for s in received if s.kind == "block") + tuple(completed_now)
            held_by_rank[rank].update(holds_now)
            # Only a later chunk on this rank can read an entry: the rank's last chunk stores none.
            if chunk_index != partition.chunks_of(rank)[-1]:
                cache_puts = holds_now
        sent: tuple[Source, ...] = ()
        if not is_last:
            all_blocks = [Source("block", j) for j in range(completed_blocks(done, block_ends) + 1)]
            receiver = partition.rank_of(chunk_index + 1)
            if mode == "cached":
                all_blocks = [s for s in all_blocks if s not in held_by_rank[receiver]]
            sent = tuple(all_blocks) + ((partial,) if partial else ())
        rows.append(dict(chunk_index=chunk_index, received=received, cache_reads=cache_reads,
                         produced=produced, sent=sent, cache_puts=cache_puts))
        received = sent
    # Every later chunk on a rank reads every block it holds, so an entry's last reader is the
    # rank's last chunk that runs after the entry was stored.
    frees_by_chunk: dict[int, list[Source]] = {}
    for row in rows:
        last_chunk = partition.chunks_of(partition.rank_of(row["chunk_index"]))[-1]
        frees_by_chunk.setdefault(last_chunk, []).extend(row["cache_puts"])
    chunks = tuple(ChunkIO(**row, frees=tuple(frees_by_chunk.get(row["chunk_index"], ()))) for row in rows)
    return PayloadPlan(mode=mode, partition=partition, chunks=chunks)


def _plan_standard(partition: Partition) -> PayloadPlan:
    chunks = []
    for chunk_index in range(partition.n_chunks):
        is_last = chunk_index == partition.n_chunks - 1
        chunks.append(ChunkIO(
            chunk_index=chunk_index,
            received=(RESIDUAL,) if chunk_index else (),
            cache_reads=(),
            produced=() if is_last else (RESIDUAL,),
            sent=() if is_last else (RESIDUAL,),
            cache_puts=(),
            frees=(),
        ))
    return PayloadPlan(mode="standard", partition=partition, chunks=tuple(chunks))


def plan_for_model(cfg, partition: Partition, cache: bool) -> PayloadPlan:
    """The plan a run of `cfg` (a ModelConfig) uses: standard, or naive/cached AttnRes."""
    mode = "standard" if cfg.residual == "standard" else ("cached" if cache else "naive")
    return plan_payloads(n_sublayers=cfg.n_sublayers, block_ends=cfg.block_ends, partition=partition, mode=mode)


def shard_tokens(tokens: int, tensor_parallel: int = 1, sequence_parallel: bool = False) -> int:
    """Tokens of a microbatch that one tensor-parallel rank holds of every tensor between layers, and so
    of every hop tensor, cache entry and deposit (docs/spec.md section 10): `tokens / T` under sequence
    parallelism (its sequence shard), all of them without it (each tp rank holds the whole tensor).

    The one rule for the bytes of a hop pair (d, p, t) -> (d, p + 1, t): the plan's tensor count x
    `shard_tokens(...)` x width x element size. The simulator and the runtime's tp ranks
    (`train.tp_rank`) both read it. ValueError unless T divides the tokens under sequence parallelism."""
    if isinstance(tensor_parallel, bool) or not isinstance(tensor_parallel, int) or tensor_parallel < 1:
        raise ValueError(f"tensor_parallel={tensor_parallel!r} is invalid: must be an integer >= 1")
    if not sequence_parallel or tensor_parallel == 1:
        return tokens
    if tokens % tensor_parallel:
        raise ValueError(f"{tokens} tokens per microbatch are not divisible by --tensor-parallel "
                         f"{tensor_parallel}: sequence parallelism splits every sequence into T equal shards")
    return tokens // tensor_parallel


def hop_bytes_per_rank(plan: PayloadPlan, *, tokens: int, width: int, element_bytes: int, tensor_parallel: int = 1,
                       sequence_parallel: bool = False) -> list[int]:
    """Bytes each forward hop sends from one tp rank to its peer (d, p + 1, t), one microbatch (the
    backward sends the same again): tensors x `shard_tokens` x width x element size."""
    per_tensor = shard_tokens(tokens, tensor_parallel, sequence_parallel) * width * element_bytes
    return [n * per_tensor for n in plan.fwd_hop_tensors]
