"""Costs per unit of work, and the work of a chunk in units, so that one calibration prices any
schedule, V, m, payload mode, layer split and block size of the same model width and microbatch.

A chunk's forward (and, with their own unit times, its backward) is, per microbatch:
    layers          x layer          attention + MLP sublayers with their norms
    depth reads     phase 1 per segment of a block's sublayers that sit together in the chunk:
                    one read of n completed sources (b_0 .. b_n) for k queries at once; and a
                    merge (phase 2 + the partial sum) for every sublayer with an open partial
    standard        2 adds per layer (the residual stream) instead of the reads
    chunk 0         the embedding
    chunk C - 1     the final read (phase 1 over every block, one query) and the head (output
                    norm, LM head, loss)
exactly as `model.stack.forward_sublayers` and `pipeline.chunk` run them. Phase 1's time is a plane
in (n, k, n k) (fitted to probed points by the measurement lab, `attnres_lab.transfer_fit`). A message costs the sender
send_fixed + bytes x send_per_byte of work, the link latency + bytes x link_per_byte, and the
receiver recv_fixed of work; every action starts after a dispatch gap. Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass

from attnres_pp.comm.partition import Partition
from attnres_pp.model.config import ModelConfig, block_of, block_stop, has_partial_before


@dataclass(frozen=True)
class ChunkWork:
    """The units of one chunk: `segments` are phase-1 reads as (sources n, queries k)."""

    n_layers: int
    segments: tuple[tuple[int, int], ...]
    n_merges: int
    n_adds: int
    has_embed: bool
    has_head: bool


def chunk_work(cfg: ModelConfig, partition: Partition, chunk_index: int) -> ChunkWork:
    """The units chunk `chunk_index` runs for one microbatch (the final read is a segment too)."""
    sublayers = partition.sublayer_range(chunk_index)
    is_last = chunk_index == partition.n_chunks - 1
    if cfg.residual == "standard":
        return ChunkWork(n_layers=len(sublayers) // 2, segments=(), n_merges=0, n_adds=len(sublayers),
                         has_embed=chunk_index == 0, has_head=is_last)
    if cfg.residual != "attnres":
        raise ValueError(f"unit costs model the standard and attnres variants, not {cfg.residual!r}")
    ends = cfg.block_ends
    segments, n_merges, l = [], 0, sublayers.start
    while l < sublayers.stop:
        # A segment runs from here to the end of this block or of the chunk (`forward_sublayers`).
        stop = min(sublayers.stop, block_stop(l, ends))
        segments.append((block_of(l, ends), stop - l))
        l = stop
    n_merges = sum(1 for l in sublayers if has_partial_before(l, ends))
    if is_last:
        segments.append((cfg.n_blocks + 1, 1))
    return ChunkWork(n_layers=len(sublayers) // 2, segments=tuple(segments), n_merges=n_merges, n_adds=0,
                     has_embed=chunk_index == 0, has_head=is_last)


@dataclass(frozen=True, kw_only=True)
class UnitTimes:
    """Seconds of each unit in one direction (forward or backward) for one microbatch.
    phase1 = (a, b, c, e): a + b n + c k + e n k for n sources and k queries. action: the runtime's
    own cost of one chunk action beyond its units (`attnres_lab.action_probe`; 0 where not probed)."""

    layer: float
    add: float
    embed: float
    head: float
    merge: float
    phase1: tuple[float, float, float, float]
    phase1_floor: float  # the least probed phase-1 time: the plane is never taken below it
    action: float = 0.0

    def phase1_s(self, n_sources: int, n_queries: int) -> float:
        a, b, c, e = self.phase1
        return max(self.phase1_floor, a + b * n_sources + c * n_queries + e * n_sources * n_queries)

    def chunk_s(self, work: ChunkWork) -> float:
        seconds = work.n_layers * self.layer + work.n_adds * self.add + work.n_merges * self.merge
        seconds += sum(self.phase1_s(n, k) for n, k in work.segments)
        return seconds + work.has_embed * self.embed + work.has_head * self.head + self.action

    def scaled(self, factor: float) -> UnitTimes:
        return UnitTimes(layer=self.layer * factor, add=self.add * factor, embed=self.embed * factor,
                         head=self.head * factor, merge=self.merge * factor,
                         phase1=tuple(x * factor for x in self.phase1), phase1_floor=self.phase1_floor * factor,
                         action=self.action * factor)

    def shares(self, layer: float, token: float) -> UnitTimes:
        """One tp rank's units (`simulator.tensor_parallel`): the layer's `layer` share, every
        per-token unit's `token` share; the runtime's cost per action is the rank's whole."""
        return UnitTimes(layer=self.layer * layer, add=self.add * token, embed=self.embed * token,
                         head=self.head * token, merge=self.merge * token,
                         phase1=tuple(x * token for x in self.phase1), phase1_floor=self.phase1_floor * token,
                         action=self.action)

    def to_dict(self) -> dict:
        return {"layer": self.layer, "add": self.add, "embed": self.embed, "head": self.head,
                "merge": self.merge, "phase1_a_b_c_e": list(self.phase1), "phase1_floor": self.phase1_floor,
                "action": self.action}

    @classmethod
    def from_dict(cls, values: dict) -> UnitTimes:
        return cls(layer=values["layer"], add=values["add"], embed=values["embed"], head=values["head"],
                   merge=values["merge"], phase1=tuple(values["phase1_a_b_c_e"]), phase1_floor=values["phase1_floor"],
                   action=values.get("action", 0.0))


@dataclass(frozen=True, kw_only=True)
class MessageCosts:
    """Per message: the sender's work send_fixed_s + bytes x send_s_per_byte; on the link
    link_latency_s + bytes x link_s_per_byte; the receiver's work recv_fixed_s once it has arrived.
    dispatch_s: the runtime's gap before every action."""

    send_fixed_s: float
    send_s_per_byte: float
    recv_fixed_s: float
    link_latency_s: float
    link_s_per_byte: float
    dispatch_s: float

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not value >= 0:
                raise ValueError(f"MessageCosts.{name}={value!r} must be >= 0")

    def to_dict(self) -> dict:
        return dict(vars(self))
