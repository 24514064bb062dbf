"""NCCL's point-to-point rules (docs/spec.md section 5) as an executable model, and the proof that a lowered
schedule, run the way the runtime runs it on NCCL, cannot deadlock under them. Pure standard library.

The model (`NcclP2P`), shared by this validator and the in-process loopback that enforces it:
- Tags are ignored. The k-th message rank s sends to rank d is matched with the k-th receive rank d
  posts from rank s; a mismatched pair (another message, or another size) raises `P2PMismatch`.
- A rank issues its wire operations in groups (the runtime issues each maximal run of consecutive
  sends and receives between two computes as one `batch_isend_irecv`, i.e. one NCCL group; a
  group of one operation is a plain isend / irecv). A rank's groups execute in issue order, one
  after another (one NCCL stream; per-pair streams would order less, so a proof here covers them).
- Rendezvous: an operation completes only when its partner is posted and the partner's group is
  executing; a group completes when all of its operations can, and all of them then complete.
- The host blocks on a group that receives until it completes; a group of sends only does not
  block the host (isend), but later groups of that rank still wait for it. Every group must
  complete by the end of the step (the runtime's flush).
Self-hops (two consecutive chunks on one rank) never reach the wire: their send parks the tensors
in memory and their receive needs that send to have run earlier on the rank.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from attnres_pp.schedule.ir import Action, Schedule
from attnres_pp.schedule.prerequisites import ScheduleError, input_grad_actions, prerequisites


class P2PMismatch(RuntimeError):
    """NCCL would pair a send with a receive of another message (FIFO matching ignores tags)."""


class NcclDeadlock(RuntimeError):
    """No rank can progress under NCCL's point-to-point rules."""


def _nth(k: int) -> str:
    return f"{k + 1}{'st' if k == 0 else 'nd' if k == 1 else 'rd' if k == 2 else 'th'}"


@dataclass(eq=False)
class Op:
    """One wire operation: `label` names the message (an action string, or the runtime's message)."""

    rank: int
    peer: int
    is_send: bool
    label: str
    size: int | None = None  # elements (None: not checked)
    name: str = ""  # how reports show it (default: the label)
    payload: object = None  # send: the data; recv: filled on completion
    seq: int = -1  # position among this pair's sends (or receives), in issue order
    group: Group | None = None

    def describe(self) -> str:
        arrow = f"-> rank {self.peer}" if self.is_send else f"<- rank {self.peer}"
        return f"{self.name or self.label} ({arrow})"


@dataclass(eq=False)
class Group:
    rank: int
    index: int  # issue order on its rank
    ops: list[Op] = field(default_factory=list)
    complete: bool = False

    @property
    def receives(self) -> bool:
        return any(not op.is_send for op in self.ops)

    def describe(self) -> str:
        return "[" + " ".join(op.name or op.label for op in self.ops) + "]"


class NcclP2P:
    """The NCCL point-to-point state of `n_ranks` ranks: posted groups, FIFO matching, completion."""

    def __init__(self, n_ranks: int) -> None:
        self.n_ranks = n_ranks
        self.groups: list[list[Group]] = [[] for _ in range(n_ranks)]
        self.running = [0] * n_ranks  # index of each rank's first incomplete group (the one executing)
        self.sends: dict[tuple[int, int], list[Op]] = {}  # (src, dst) -> sends in issue order
        self.recvs: dict[tuple[int, int], list[Op]] = {}  # (src, dst) -> receives in issue order
        self._ended: set[int] = set()

    def post(self, rank: int, ops: list[Op]) -> Group:
        """Issue one group of operations on `rank` (an empty list is a no-op group)."""
        group = Group(rank, len(self.groups[rank]), list(ops))
        for op in group.ops:
            op.rank, op.group = rank, group
            pair = (rank, op.peer) if op.is_send else (op.peer, rank)
            mine = (self.sends if op.is_send else self.recvs).setdefault(pair, [])
            op.seq = len(mine)
            mine.append(op)
            partner = self.partner(op)
            if partner is not None:
                self._check_match(op if op.is_send else partner, partner if op.is_send else op)
        self.groups[rank].append(group)
        self._progress()
        return group

    def end_step(self, rank: int) -> None:
        """`rank` flushed with every group complete; once all ranks have, start the next step afresh
        (drops the step's payloads; message counts per pair restart from zero on every rank)."""
        self._ended.add(rank)
        if len(self._ended) == self.n_ranks:
            self.__init__(self.n_ranks)

    def partner(self, op: Op) -> Op | None:
        pair = (op.rank, op.peer) if op.is_send else (op.peer, op.rank)
        theirs = (self.recvs if op.is_send else self.sends).get(pair, [])
        return theirs[op.seq] if op.seq < len(theirs) else None

    def _check_match(self, send: Op, recv: Op) -> None:
        if send.label != recv.label or (None not in (send.size, recv.size) and send.size != recv.size):
            sizes = "" if None in (send.size, recv.size) else f" ({send.size} vs {recv.size} elements)"
            raise P2PMismatch(
                f"NCCL pairs rank {send.rank}'s {_nth(send.seq)} send to rank {recv.rank}, {send.name or send.label}, "
                f"with rank {recv.rank}'s {_nth(recv.seq)} receive from rank {send.rank}, {recv.name or recv.label}"
                f"{sizes}: "
                "NCCL matches the messages between two ranks in issue order and ignores tags, so both ranks "
                "must issue them in the same order"
            )

    def executing(self, group: Group) -> bool:
        return group.index <= self.running[group.rank]

    def ready(self, op: Op) -> bool:
        partner = self.partner(op)
        return partner is not None and self.executing(partner.group)

    def _progress(self) -> None:
        changed = True
        while changed:
            changed = False
            for rank in range(self.n_ranks):
                groups = self.groups[rank]
                while self.running[rank] < len(groups):
                    group = groups[self.running[rank]]
                    if not all(self.ready(op) for op in group.ops):
                        break
                    for op in group.ops:
                        if not op.is_send:
                            op.payload = self.partner(op).payload
                    group.complete = True
                    self.running[rank] += 1
                    changed = True

    def why_blocked(self, group: Group) -> list[str]:
        """Readable reasons why `group` cannot complete yet, one per waiting operation."""
        if not self.executing(group):
            ahead = self.groups[group.rank][self.running[group.rank]]
            return [f"queued behind rank {group.rank}'s incomplete group {ahead.describe()}"]
        reasons = []
        for op in group.ops:
            partner = self.partner(op)
            which = f"{_nth(op.seq)} {'receive from' if op.is_send else 'send to'} rank {op.rank}"
            if partner is None:
                reasons.append(f"{op.describe()} waits for rank {op.peer}'s {which}, not posted yet")
            elif not self.executing(partner.group):
                reasons.append(f"{op.describe()} is matched by rank {op.peer}'s {partner.name or partner.label}, "
                               f"which sits in "
                               f"group {partner.group.describe()} behind that rank's incomplete groups")
        return reasons


def message_label(action: Action) -> str:
    """The message a send or receive moves, named the same on both ends (its send's string)."""
    send = action if action.is_send else action.matching()
    return str(send)


# A post plan: for each rank, for each action index i (0 .. len, the last for nothing), the groups
# of wire sends and receives the rank issues when it reaches action i, in order. A send in a group
# at index i is action i itself (its data is produced by the compute just before it).
PostPlan = list[list[list[list[Action]]]]


def _is_wire(schedule: Schedule, action: Action) -> bool:
    return not action.is_compute and schedule.peer(action) != schedule.rank_of(action.chunk_index)


def naive_plan(schedule: Schedule) -> PostPlan:
    """Every send and receive issued alone where it stands (an isend at SF, an irecv at RF): what
    a runtime that ignores NCCL's rules does. 1F1B's crossed sends deadlock under it."""
    plan = [[[] for _ in range(len(actions) + 1)] for actions in schedule.rank_actions]
    for rank, actions in enumerate(schedule.rank_actions):
        for index, action in enumerate(actions):
            if _is_wire(schedule, action):
                plan[rank][index].append([action])
    return plan


@functools.lru_cache(maxsize=16)
def lockstep_plan(schedule: Schedule) -> PostPlan:
    """The runtime's NCCL issue order. Run the schedule in unit-time lockstep under buffered
    (gloo) semantics, which `validate` proves finishes; each step t, every rank issues one group
    holding its own wire send of step t and the receives of every message sent to it at step t,
    posted ahead of need where the rank stands at step t. Matching operations then share a step,
    each rank's groups are in step order, and the earliest incomplete step can always complete,
    so nothing deadlocks under NCCL's rules; `check_nccl` re-checks it on the model. Cached per
    schedule: callers must not modify the plan."""
    lists = schedule.rank_actions
    last_chunk = schedule.n_chunks - 1
    input_grad = input_grad_actions(schedule)  # I (split schedules) or B: what sends a gradient back
    plan = [[[] for _ in range(len(actions) + 1)] for actions in lists]
    cursor = [0] * schedule.n_stages
    done: set[Action] = set()
    while any(cursor[r] < len(lists[r]) for r in range(schedule.n_stages)):
        moves = [lists[r][cursor[r]] if cursor[r] < len(lists[r]) and all(
            p in done for p in prerequisites(lists[r][cursor[r]], last_chunk, True, input_grad)) else None
            for r in range(schedule.n_stages)]
        if not any(moves):
            raise ScheduleError(f"schedule {schedule.name!r} cannot finish even with buffered sends; run validate()")
        groups: dict[int, list[Action]] = {}
        for rank, action in enumerate(moves):
            if action is not None and action.is_send and _is_wire(schedule, action):
                groups.setdefault(rank, []).append(action)
                groups.setdefault(schedule.peer(action), []).append(action.matching())
        for rank in sorted(groups):  # a rank's own send first, then receives by sender
            ordered = sorted(groups[rank], key=lambda a: (not a.is_send, schedule.peer(a)))
            plan[rank][cursor[rank]].append(ordered)
        for rank, action in enumerate(moves):
            if action is not None:
                done.add(action)
                cursor[rank] += 1
    return plan


def check_nccl(schedule: Schedule, plan: PostPlan | None = None) -> None:
    """Run the lowered schedule under NCCL's rules with the given issue order (default: the
    runtime's, `lockstep_plan`): a rank issues its planned groups when it reaches each action
    without waiting, waits at a receive until that receive's group has completed, and at the end
    of the step until all its groups have. Raise NcclDeadlock naming the blocked ranks, groups and
    pairs, or P2PMismatch, if it cannot finish."""
    if schedule.n_chunks == 1:
        return  # one chunk: nothing crosses a hop
    if not schedule.has_comm:
        raise ValueError("check_nccl needs a lowered schedule (passes.insert_comm)")
    plan = lockstep_plan(schedule) if plan is None else plan
    n, lists = schedule.n_stages, schedule.rank_actions
    fabric = NcclP2P(n)
    cursor = [0] * n
    posted = [False] * n  # the groups planned at cursor[r] are issued
    recv_ops: dict[tuple[int, Action], Op] = {}
    parked: list[set[tuple]] = [set() for _ in range(n)]  # self-hop messages handed over in memory
    stuck_self: dict[int, Action] = {}
    progress = True
    while progress:
        progress = False
        for rank in range(n):
            while True:
                index = cursor[rank]
                if not posted[rank]:
                    for group in plan[rank][index]:
                        ops = [Op(rank, schedule.peer(a), a.is_send, message_label(a), name=str(a)) for a in group]
                        fabric.post(rank, ops)
                        recv_ops.update({(rank, a): op for a, op in zip(group, ops, strict=True) if a.is_recv})
                    posted[rank] = True
                    progress = True
                if index == len(lists[rank]):
                    break
                action = lists[rank][index]
                if action.is_recv and not _is_wire(schedule, action):
                    if action.message_id not in parked[rank]:
                        stuck_self[rank] = action  # its send comes later on this rank: never
                        break
                elif action.is_send and not _is_wire(schedule, action):
                    parked[rank].add(action.message_id)
                elif action.is_recv:
                    op = recv_ops.get((rank, action))
                    if op is None or not op.group.complete:
                        break
                cursor[rank] += 1
                posted[rank] = False
                progress = True
    unfinished = [r for r in range(n) if cursor[r] < len(lists[r])]
    pending = [g for groups in fabric.groups for g in groups if not g.complete]
    if unfinished or pending:
        raise NcclDeadlock(_report(schedule, cursor, fabric, stuck_self, unfinished, recv_ops))


def _report(schedule, cursor, fabric: NcclP2P, stuck_self, unfinished, recv_ops) -> str:
    lines = [f"schedule {schedule.name!r} (P={schedule.n_stages}, V={schedule.n_virtual}, "
             f"m={schedule.n_microbatches}) deadlocks under NCCL point-to-point semantics (messages between "
             "two ranks match in issue order, a send completes only when its receive is posted):"]
    pairs = set()
    for rank, actions in enumerate(schedule.rank_actions):
        if rank in stuck_self:
            lines.append(f"  rank {rank} is blocked at {stuck_self[rank]}: its self-hop send comes later on this rank")
            continue
        incomplete = [g for g in fabric.groups[rank] if not g.complete]
        if rank not in unfinished and not incomplete:
            lines.append(f"  rank {rank} is done")
            continue
        if rank in unfinished:
            action = actions[cursor[rank]]
            op = recv_ops.get((rank, action))
            waits = "" if op is None else f" (posted in group {op.group.describe()})"
            lines.append(f"  rank {rank} waits at {action}{waits}")
        else:
            lines.append(f"  rank {rank} waits at the end of the step for its sends (flush)")
        for group in incomplete:
            for reason in fabric.why_blocked(group):
                lines.append(f"    group {group.describe()}: {reason}")
            if fabric.executing(group):
                pairs |= {(op.rank, op.peer) if op.is_send else (op.peer, op.rank)
                          for op in group.ops if not fabric.ready(op)}
    if pairs:
        lines.append("blocked pairs (sender -> receiver): " + ", ".join(f"{s} -> {d}" for s, d in sorted(pairs)))
    lines.append("fix: issue each pair's sends and receives in the same order on both ranks, and post the "
                 "receives of crossing messages in one group with the sends (batch_isend_irecv), as "
                 "lockstep_plan does")
    return "\n".join(lines)
