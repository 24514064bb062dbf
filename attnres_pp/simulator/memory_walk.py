"""The walk over one rank's action order (docs/spec.md section 8): what its activations, its cache
entries and deposits, and (fsdp, reshard after forward always) its all-gathered parameters hold after
each action, and the peaks, as the runtime's meter counts them (`pipeline.memory_meter`). F(c, mb)
adds chunk c's saved bytes, B frees them; I frees them too but leaves the W store, which W frees
(chunk 0's I has no inputs: its W is the whole backward); a recomputing backward adds a transient
alive only inside it. `RankMemory` is one rank's prediction (`simulator.memory.predict_ranks`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from attnres_pp.comm.plan import PayloadPlan
from attnres_pp.simulator.memory_activation import ChunkActivation


@dataclass(frozen=True, kw_only=True)
class RankMemory:
    """One rank's prediction: `terms` has the MEMORY_KEYS; `peak_action` is the action at whose end
    (or, for a recomputing backward, during which) activations + cache peak."""

    terms: dict[str, int]
    peak_bytes: int
    peak_action: str
    dominant: str = field(default="")
    gathered_bytes: int = 0  # fsdp: the all-gathered parameters inside peak_bytes (none unless fsdp)


def walk_rank(actions, *, saved_by_chunk: list[ChunkActivation], plan: PayloadPlan | None,
              tensor_bytes: int, resident_by_chunk: list[int] | None = None) -> tuple[int, int, int, str]:
    """(activation peak, cache peak, peak of both together, action of that peak) over one rank's
    actions (objects with kind, chunk_index, microbatch_index).

    `resident_by_chunk`: bytes the activation term counts from a chunk's first F to the end of its
    last backward whatever the microbatch (FSDP2's all-gathered parameters, saved by every forward:
    one storage each). They are not in the peak of both together, which the caller adds them to
    for the whole step (FSDP2 holds them from the first all-gather to the reduce-scatter)."""
    return walk_rank_gathered(actions, saved_by_chunk=saved_by_chunk, plan=plan, tensor_bytes=tensor_bytes,
                              resident_by_chunk=resident_by_chunk)[:4]


def walk_rank_gathered(actions, *, saved_by_chunk: list[ChunkActivation], plan: PayloadPlan | None,
                       tensor_bytes: int, resident_by_chunk: list[int] | None = None,
                       gathered_by_chunk: list[int] | None = None) -> tuple[int, int, int, str, int]:
    """`walk_rank`'s four figures and the all-gathered parameter bytes inside the peak of both together.

    `gathered_by_chunk` (fsdp, reshard after forward always; `chunk_gathered_bytes`): a chunk's
    units are unsharded by its first action that finds them sharded (every action of `train.fsdp`
    unshards first), stay so through any backward, and are resharded at the end of each F: the
    whole gathered copy of chunk c is in the peak of both together while c is unsharded, and the
    parameters its forwards saved (`resident_by_chunk`, views of that copy, freed with it) count as
    activations only while c is unsharded and a graph of c is alive. The step starts sharded.
    Without it, the fifth figure is 0 (resharding never: the caller adds the whole copy)."""
    actions = list(actions)
    walk = _RankWalk(actions, saved_by_chunk=saved_by_chunk, plan=plan, tensor_bytes=tensor_bytes,
                     resident_by_chunk=resident_by_chunk, gathered_by_chunk=gathered_by_chunk)
    for position, action in enumerate(actions):
        walk.step(position, action)
    return walk.act_peak, walk.cache_peak, walk.total_peak, walk.peak_action, walk.gathered_at_peak


class _RankWalk:
    """The running counts of `walk_rank_gathered`: `act` (saved activations and W stores), `cache_live`
    (cache entries and gradient deposits), `resident` (saved all-gathered parameters), and the peaks."""

    def __init__(self, actions: list, *, saved_by_chunk: list[ChunkActivation], plan: PayloadPlan | None,
                 tensor_bytes: int, resident_by_chunk: list[int] | None,
                 gathered_by_chunk: list[int] | None) -> None:
        self.saved_by_chunk, self.tensor_bytes = saved_by_chunk, tensor_bytes
        self.ios = plan.chunks if plan is not None else None
        self.resident_by_chunk, self.gathered_by_chunk = resident_by_chunk, gathered_by_chunk
        self.always = gathered_by_chunk is not None
        self.unsharded: set[int] = set()
        self.graphs: dict[int, int] = {}  # chunk -> microbatches whose graph (or W store) is alive
        self.deposits: dict[int, set] = {}  # microbatch -> the sources whose gradient deposit is alive
        self.cache_entries: dict[int, int] = {}  # microbatch -> len(deposits[mb]) as counted in cache_live
        self.started: set[int] = set()
        self.last_backward = {a.chunk_index: i for i, a in enumerate(actions) if a.kind.value in ("B", "W")}
        self.act = self.cache_live = self.resident = 0
        self.act_peak = self.cache_peak = self.total_peak = self.gathered_at_peak = 0
        self.peak_action = ""

    def step(self, position: int, action) -> None:
        """Count one action: what it adds, the moment it may peak at, what it frees."""
        kind, c, mb = action.kind.value, action.chunk_index, action.microbatch_index
        unit = self.saved_by_chunk[c]
        if self.always:
            self.unsharded.add(c)
        if kind == "F":
            self._forward(c, unit)
            extra = 0
        elif kind in ("B", "I"):
            # I's peak comes early, as B's (the last layer recomputed, the head's gradients), late,
            # once the W store is whole and what F saved is gone, or in between, by `input_transient`
            # above the larger of those (`attnres_lab.memory_units` measures it so).
            extra = (unit.transient if kind == "B" else 0 if c == 0  # chunk 0's I runs nothing
                     else max(unit.transient, unit.stored - unit.saved) + unit.input_transient)
        else:  # W of chunk 0 is its whole backward (its I had no inputs to start from)
            extra = unit.transient if c == 0 else 0
        moment = self.act + self.cache_live + extra  # a backward's: before its deposits change the cache
        if kind in ("B", "I") and self.ios is not None:
            self._deposit(c, mb)
        gathered = self._unsharded_bytes() if self.always else 0
        moment += gathered
        self.act_peak = max(self.act_peak, self.act + extra + self.resident)
        if moment > self.total_peak:
            self.total_peak, self.peak_action, self.gathered_at_peak = moment, f"{kind}{c}.{mb}", gathered
        self._free(position, kind, c, unit)

    def _forward(self, c: int, unit: ChunkActivation) -> None:
        if self.resident_by_chunk is not None and c not in self.started and not self.always:
            self.started.add(c)
            self.resident += self.resident_by_chunk[c]
        if self.always:
            self.graphs[c] = self.graphs.get(c, 0) + 1
        self.act += unit.saved
        if self.ios is not None:
            self.cache_live += len(self.ios[c].cache_puts) * self.tensor_bytes
        self.cache_peak = max(self.cache_peak, self.cache_live)

    def _deposit(self, c: int, mb: int) -> None:
        """Collect the deposits into the entries chunk c put, then deposit its cache reads (a later
        deposit into a live one is added in place: no new tensor)."""
        alive = self.deposits.setdefault(mb, set())
        alive.difference_update(self.ios[c].cache_puts)
        alive.update(self.ios[c].cache_reads)
        self.cache_live -= self.cache_entries.get(mb, 0) * self.tensor_bytes
        self.cache_entries[mb] = len(alive)
        self.cache_live += len(alive) * self.tensor_bytes
        self.cache_peak = max(self.cache_peak, self.cache_live)

    def _unsharded_bytes(self) -> int:
        """Resharding always: the gathered copies of the unsharded chunks, and (into `resident`) the
        parameters their live graphs saved."""
        if self.resident_by_chunk:
            self.resident = sum(self.resident_by_chunk[k] for k in self.unsharded if self.graphs.get(k))
        else:
            self.resident = 0
        return sum(self.gathered_by_chunk[k] for k in self.unsharded)

    def _free(self, position: int, kind: str, c: int, unit: ChunkActivation) -> None:
        if kind == "F" and self.ios is not None:
            self.cache_live -= len(self.ios[c].frees) * self.tensor_bytes
        elif kind == "B":
            self.act -= unit.saved
        elif kind == "I" and c != 0:  # the graph dies with I; what W needs stays in the store
            self.act += unit.stored - unit.saved
        elif kind == "W":
            self.act -= unit.saved if c == 0 else unit.stored
        if self.always:
            # A microbatch's graph of c ends with B, or with W (the store I leaves); I ends none.
            if kind == "B" or kind == "W":
                self.graphs[c] -= 1
            if kind == "F":
                self.unsharded.discard(c)
        elif self.resident_by_chunk is not None and self.last_backward.get(c) == position:
            self.resident -= self.resident_by_chunk[c]
