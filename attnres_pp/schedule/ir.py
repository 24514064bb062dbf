"""The schedule IR: actions, per-rank action lists, and their short text form (docs/spec.md section 5).

A schedule is data. Generators (`schedules.py`) return compute-only schedules; `passes.insert_comm`
adds the communication; `validate.validate` checks it; the runtime and the simulator execute the
same lists. Pure standard library.

Action strings (`str(action)`, `Action.parse`):
    F3.1   forward of chunk 3, microbatch 1
    B3.1   backward of chunk 3, microbatch 1 (input and weight gradients: the fused pair I + W)
    I3.1   input gradients of chunk 3, microbatch 1: what goes back over the hop and into the
           rank's cache deposits (split-backward schedules)
    W3.1   weight gradients of chunk 3, microbatch 1 (after I3.1; sends and receives nothing)
    SF3.1  send chunk 3's forward output (hop 3 -> 4), on chunk 3's rank
    RF4.1  receive chunk 4's forward input (hop 3 -> 4), on chunk 4's rank
    SB4.1  send chunk 4's input gradients (backward hop 4 -> 3), on chunk 4's rank
    RB3.1  receive chunk 3's output gradients (backward hop 4 -> 3), on chunk 3's rank
Every action runs on the rank of its own chunk index, as the schedule's placement says
(`comm.partition.chunk_rank`: loop, rank = chunk % P; or vshape).
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

from attnres_pp.comm.partition import check_placement, chunk_rank


class ActionKind(enum.StrEnum):
    """A str enum (StrEnum is str + Enum): the value is the printed prefix."""

    F = "F"
    B = "B"
    I = "I"  # noqa: E741  (the name the zero-bubble literature gives the input-gradient half)
    W = "W"
    SEND_F = "SF"
    RECV_F = "RF"
    SEND_B = "SB"
    RECV_B = "RB"


COMPUTE_KINDS = frozenset({ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W})
# The action that makes a chunk's input gradients (and so its backward hop and deposits): B or I.
INPUT_GRAD_KINDS = frozenset({ActionKind.B, ActionKind.I})
SEND_KINDS = frozenset({ActionKind.SEND_F, ActionKind.SEND_B})
RECV_KINDS = frozenset({ActionKind.RECV_F, ActionKind.RECV_B})

_ACTION_RE = re.compile(r"^(SF|RF|SB|RB|F|B|I|W)(\d+)\.(\d+)$")


@dataclass(frozen=True)
class Action:
    kind: ActionKind
    chunk_index: int
    microbatch_index: int

    def __str__(self) -> str:
        return f"{self.kind.value}{self.chunk_index}.{self.microbatch_index}"

    @classmethod
    def parse(cls, text: str) -> Action:
        match = _ACTION_RE.match(text.strip())
        if match is None:
            raise ValueError(
                f"cannot parse action {text!r}: expected KIND<chunk>.<microbatch> with KIND one of "
                f"F, B, I, W, SF, RF, SB, RB (e.g. 'F3.1')"
            )
        kind, chunk, microbatch = match.groups()
        return cls(ActionKind(kind), int(chunk), int(microbatch))

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS

    @property
    def is_send(self) -> bool:
        return self.kind in SEND_KINDS

    @property
    def is_recv(self) -> bool:
        return self.kind in RECV_KINDS

    @property
    def message_id(self) -> tuple[str, int, int]:
        """(direction "F"/"B", sending chunk, microbatch): equal for a send and its receive.

        The runtime uses it as the message tag, so messages between one pair of ranks may be
        received in any order (no FIFO assumption anywhere).
        """
        kind = self.kind
        if kind is ActionKind.SEND_F:
            return ("F", self.chunk_index, self.microbatch_index)
        if kind is ActionKind.RECV_F:
            return ("F", self.chunk_index - 1, self.microbatch_index)
        if kind is ActionKind.SEND_B:
            return ("B", self.chunk_index, self.microbatch_index)
        if kind is ActionKind.RECV_B:
            return ("B", self.chunk_index + 1, self.microbatch_index)
        raise ValueError(f"{self} is a compute action and carries no message")

    def matching(self) -> Action:
        """The other end of a communication action (SF3.1 <-> RF4.1, SB4.1 <-> RB3.1)."""
        kind, chunk, microbatch = self.kind, self.chunk_index, self.microbatch_index
        if kind is ActionKind.SEND_F:
            return Action(ActionKind.RECV_F, chunk + 1, microbatch)
        if kind is ActionKind.RECV_F:
            return Action(ActionKind.SEND_F, chunk - 1, microbatch)
        if kind is ActionKind.SEND_B:
            return Action(ActionKind.RECV_B, chunk - 1, microbatch)
        if kind is ActionKind.RECV_B:
            return Action(ActionKind.SEND_B, chunk + 1, microbatch)
        raise ValueError(f"{self} is a compute action and has no matching communication")


def F(chunk_index: int, microbatch_index: int) -> Action:
    return Action(ActionKind.F, chunk_index, microbatch_index)


def B(chunk_index: int, microbatch_index: int) -> Action:
    return Action(ActionKind.B, chunk_index, microbatch_index)


def I(chunk_index: int, microbatch_index: int) -> Action:  # noqa: E743
    return Action(ActionKind.I, chunk_index, microbatch_index)


def W(chunk_index: int, microbatch_index: int) -> Action:
    return Action(ActionKind.W, chunk_index, microbatch_index)


_HEADER_RE = re.compile(r"^schedule\s+(\S+)\s+P=(\d+)\s+V=(\d+)\s+m=(\d+)(?:\s+placement=(\w+))?$")
_RANK_RE = re.compile(r"^rank\s+(\d+):(.*)$")


@dataclass(frozen=True)
class Schedule:
    """rank_actions[pp_rank] is the ordered action list of rank pp_rank; `placement` maps chunks to
    ranks (a schedule declares it: loop for GPipe, 1F1B and interleaved; vshape for ZB-V)."""

    name: str
    n_stages: int
    n_virtual: int
    n_microbatches: int
    rank_actions: tuple[tuple[Action, ...], ...]
    placement: str = "loop"

    def __post_init__(self) -> None:
        for field_name in ("n_stages", "n_virtual", "n_microbatches"):
            if getattr(self, field_name) < 1:
                raise ValueError(f"Schedule.{field_name}={getattr(self, field_name)} must be >= 1")
        check_placement(self.placement, self.n_stages, self.n_virtual)
        if len(self.rank_actions) != self.n_stages:
            raise ValueError(
                f"schedule has {len(self.rank_actions)} action lists for {self.n_stages} ranks: "
                f"give one list per rank"
            )

    @property
    def n_chunks(self) -> int:
        return self.n_stages * self.n_virtual

    def rank_of(self, chunk_index: int) -> int:
        return chunk_rank(chunk_index, self.n_stages, self.placement)

    def chunks_of(self, pp_rank: int) -> list[int]:
        return [c for c in range(self.n_chunks) if self.rank_of(c) == pp_rank]

    def peer(self, action: Action) -> int:
        """The rank at the other end of a communication action (it may be this rank when P == 1)."""
        return self.rank_of(action.matching().chunk_index)

    @property
    def has_comm(self) -> bool:
        return any(not a.is_compute for actions in self.rank_actions for a in actions)

    def __str__(self) -> str:
        placement = "" if self.placement == "loop" else f" placement={self.placement}"
        lines = [f"schedule {self.name} P={self.n_stages} V={self.n_virtual} m={self.n_microbatches}{placement}"]
        for pp_rank, actions in enumerate(self.rank_actions):
            lines.append(f"rank {pp_rank}: " + " ".join(str(a) for a in actions))
        return "\n".join(lines)

    @classmethod
    def parse(cls, text: str) -> Schedule:
        lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
        header = _HEADER_RE.match(lines[0]) if lines else None
        if header is None:
            raise ValueError(
                "a schedule's text starts with a header like 'schedule 1f1b P=4 V=1 m=8', "
                f"got {lines[0] if lines else 'nothing'!r}"
            )
        name, n_stages, n_virtual, n_microbatches, placement = header.groups()
        rank_actions: list[tuple[Action, ...]] = []
        for expected_rank, line in enumerate(lines[1:]):
            match = _RANK_RE.match(line)
            if match is None or int(match.group(1)) != expected_rank:
                raise ValueError(f"expected a line 'rank {expected_rank}: ACTIONS...', got {line!r}")
            rank_actions.append(tuple(Action.parse(word) for word in match.group(2).split()))
        return cls(name=name, n_stages=int(n_stages), n_virtual=int(n_virtual),
                   n_microbatches=int(n_microbatches), rank_actions=tuple(rank_actions),
                   placement=placement or "loop")
