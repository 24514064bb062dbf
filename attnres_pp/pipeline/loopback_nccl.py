"""The in-process loopback transport under NCCL's point-to-point rules (docs/spec.md section 5), for
`--launcher inprocess --p2p-semantics nccl` and the tests: every rank's transport shares one
`validate_nccl.NcclP2P`, which matches the messages between two ranks in issue order (tags are
ignored; a pair that NCCL would match wrongly, by message or by size, raises P2PMismatch) and
completes a send only once its receive is posted and executing.

The executor drives it as it drives NCCL: `begin_group` / `end_group` around each planned group of
`prepost_recv`s and the action's own `send` (one batch_isend_irecv on a GPU); a receive waits
until its group has completed (`ready`, then `recv`); `flush` fails if a group never completes.
"""

from __future__ import annotations

import torch

from attnres_pp.comm.transport import ByteLedger, TransportTimeout
from attnres_pp.comm.wire import check_dtype, pack, refuse_self_hop, unpack
from attnres_pp.schedule.validate_nccl import NcclDeadlock, NcclP2P, Op


def _numel(shapes: list[torch.Size]) -> int:
    return sum(int(torch.Size(s).numel()) for s in shapes)


class NcclLoopbackTransport:
    """One rank's end of an in-process pipeline whose messages obey NCCL's rules."""

    p2p_semantics = "nccl"
    can_prepost = False  # receives are posted where the NCCL plan says, not by the gloo look-ahead

    def __init__(self, pp_rank: int, fabric: NcclP2P, ledger: ByteLedger | None = None) -> None:
        self.pp_rank = pp_rank
        self.fabric = fabric
        self.ledger = ledger or ByteLedger()
        self._open: list[Op] | None = None
        self._posted: dict[tuple[int, int], Op] = {}

    def message_slots(self) -> list:
        """None: every received message is a buffer of its own (`Transport.message_slots`)."""
        return []

    def begin_group(self) -> None:
        if self._open is not None:
            raise RuntimeError(f"rank {self.pp_rank}: begin_group inside an open group")
        self._open = []

    def end_group(self) -> None:
        ops, self._open = self._open, None
        if ops:
            self.fabric.post(self.pp_rank, ops)

    def _issue(self, op: Op) -> None:
        if self._open is None:
            self.fabric.post(self.pp_rank, [op])  # a lone isend / irecv
        else:
            self._open.append(op)

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int, label: tuple[str, int, int]) -> None:
        refuse_self_hop(self.pp_rank, dst)
        self.ledger.record(*label, tensors)
        flat = pack(tensors)  # cat copies: the receiver never aliases the sender's tensors
        self._issue(Op(self.pp_rank, dst, True, f"tag {tag}", size=flat.numel(), payload=flat,
                       name=f"send tag {tag} ({label[0]} hop {label[1]}, microbatch {label[2]})"))

    def prepost_recv(self, shapes: list[torch.Size], dtype: torch.dtype, src: int, tag: int) -> None:
        refuse_self_hop(self.pp_rank, src)
        if (src, tag) in self._posted:
            raise RuntimeError(f"rank {self.pp_rank}: the receive from rank {src} with tag {tag} is posted twice")
        op = Op(self.pp_rank, src, False, f"tag {tag}", size=_numel(shapes), name=f"recv tag {tag}")
        self._posted[(src, tag)] = op
        self._issue(op)

    def ready(self, src: int, tag: int) -> bool:
        op = self._posted.get((src, tag))
        return op is not None and op.group is not None and op.group.complete

    def recv(self, shapes: list[torch.Size], dtype: torch.dtype, src: int, tag: int) -> list[torch.Tensor]:
        op = self._posted.pop((src, tag), None)
        if op is None:
            raise TransportTimeout(f"rank {self.pp_rank}: receive from rank {src} with tag {tag} was never posted; "
                                   "under NCCL semantics every receive is posted as the runtime's plan says")
        if op.group is None or not op.group.complete:
            reasons = "; ".join(self.fabric.why_blocked(op.group)) if op.group is not None else "group still open"
            raise NcclDeadlock(f"rank {self.pp_rank}: receive from rank {src} with tag {tag} cannot complete: "
                               f"{reasons}")
        check_dtype(op.payload, dtype, self.pp_rank, src, tag)
        return unpack(op.payload, shapes)

    def flush(self) -> None:
        stuck = [g for g in self.fabric.groups[self.pp_rank] if not g.complete]
        if stuck:
            reasons = "; ".join(f"{g.describe()}: {', '.join(self.fabric.why_blocked(g))}" for g in stuck)
            raise NcclDeadlock(f"rank {self.pp_rank}: groups never completed by the end of the step: {reasons}")
        self.fabric.end_step(self.pp_rank)

    def close(self) -> None:
        pass
