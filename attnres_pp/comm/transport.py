"""Transports that move one hop's tensors between ranks, and the byte ledger that counts them.

- `DistTransport`: torch.distributed point-to-point (gloo on CPU, nccl on CUDA). One message per hop:
  the hop's tensors are packed into one flat buffer whose size the receiver knows from the plan, so
  there is no shape handshake. Sends are non-blocking (waited at `flush`); every receive waits with a
  timeout so that a lost peer becomes an error, not a hang.
  Under gloo a receive can be posted ahead (`prepost_recv`). gloo sends by rendezvous: the payload
  leaves only once the sender's event-loop thread has seen the receiver's "ready" notice. A receive
  posted when its data is needed therefore waits for that thread on the sender's side, which is late
  whenever the sender is computing on a busy core (measured: +3 to +8 ms per message on 2 cores). A
  receive posted ahead lets the sender's own `isend` write the payload at once. Not under nccl,
  whose p2p calls between a pair of ranks queue on one stream in call order.
  With a `LinkModel` (`--link-gbps`), every message also carries its emulated arrival time (one
  float64 after the payload, computed by the sender as it posts the send) and the receiver waits
  until then: a slow link emulated on one host without blocking the sender (`comm.link`).
- `LoopbackTransport`: an in-process mailbox, so a whole pipeline can run in one process.
Both implement `comm.transport_protocol.Transport`; the message format is `comm.wire`'s.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass, field

import torch

from attnres_pp.comm.link import LinkClock, LinkModel
from attnres_pp.comm.wire import (
    check_dtype,
    pack,
    refuse_self_hop,
    stamp_numel,
    unpack,
    wait_for_arrival,
    with_arrival,
)


class TransportTimeout(RuntimeError):
    pass


@dataclass
class ByteLedger:
    """Every message sent: (direction "fwd"/"bwd", hop index c of c -> c+1, microbatch, tensors, bytes)."""

    records: list[tuple[str, int, int, int, int]] = field(default_factory=list)

    def record(self, direction: str, hop_index: int, microbatch_index: int, tensors: list[torch.Tensor]) -> None:
        n_bytes = sum(t.numel() * t.element_size() for t in tensors)
        self.records.append((direction, hop_index, microbatch_index, len(tensors), n_bytes))

    def clear(self) -> None:
        self.records.clear()

    @property
    def total_bytes(self) -> int:
        return sum(r[4] for r in self.records)

    def tensors_per_hop(self, direction: str, microbatch_index: int) -> dict[int, int]:
        return {hop: n for d, hop, mb, n, _ in self.records if d == direction and mb == microbatch_index}

    def bytes_by_transport(self) -> dict[str, int]:
        """One way for every message: the process group's point-to-point, counted as "gloo" (the
        per-peer ledger, `pair_transport.PairLedger`, also counts "shm")."""
        return {"gloo": self.total_bytes}


class LoopbackTransport:
    """All ranks in one process; messages wait in a shared mailbox keyed by (src, dst, tag)."""

    p2p_semantics = "gloo"
    can_prepost = False  # a message waits in the mailbox whether or not its receive is posted

    def __init__(self, pp_rank: int, mailbox: dict, ledger: ByteLedger | None = None) -> None:
        self.pp_rank = pp_rank
        self.mailbox = mailbox
        self.ledger = ledger or ByteLedger()

    def message_slots(self) -> list:
        """None: every received message is a buffer of its own (`Transport.message_slots`)."""
        return []

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int, label: tuple[str, int, int]) -> None:
        refuse_self_hop(self.pp_rank, dst)
        self.ledger.record(*label, tensors)
        self.mailbox[(self.pp_rank, dst, tag)] = pack(tensors)  # cat already copies: no aliasing

    def ready(self, src: int, tag: int) -> bool:
        return (src, self.pp_rank, tag) in self.mailbox

    def prepost_recv(self, shapes: list[torch.Size], dtype: torch.dtype, src: int, tag: int) -> None:
        pass

    def begin_group(self) -> None:
        pass

    def end_group(self) -> None:
        pass

    def recv(self, shapes: list[torch.Size], dtype: torch.dtype, src: int, tag: int) -> list[torch.Tensor]:
        try:
            flat = self.mailbox.pop((src, self.pp_rank, tag))
        except KeyError:
            raise TransportTimeout(f"rank {self.pp_rank}: no message from rank {src} with tag {tag}") from None
        check_dtype(flat, dtype, self.pp_rank, src, tag)
        return unpack(flat, shapes)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


class DistTransport:
    """torch.distributed p2p within the default process group. Self-hops never reach a transport:
    the executor hands them over in memory. Peers are pipeline ranks; `peer_ranks[p]` is the global
    rank of pipeline rank p in this replica (default: p itself, a run without data parallelism).
    Tag-matched p2p: its messages need no issue groups (`begin_group` / `end_group` do nothing)."""

    p2p_semantics = "gloo"

    def __init__(self, pp_rank: int, timeout_s: float, device: torch.device, ledger: ByteLedger | None = None,
                 peer_ranks: list[int] | None = None, link: LinkModel | None = None):
        self.pp_rank = pp_rank
        self._global = (lambda p: p) if peer_ranks is None else peer_ranks.__getitem__
        self.link_clock = LinkClock(link) if link is not None else None  # emulated slow link, or None
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.device = device
        self.ledger = ledger or ByteLedger()
        self._pending: list = []
        self._posted: dict[tuple[int, int], tuple] = {}  # (src, tag) -> (work, flat buffer)
        self.can_prepost = device.type == "cpu"  # gloo; see the module docstring

    def message_slots(self) -> list:
        """None: every received message is a buffer of its own (`Transport.message_slots`); the
        shared-memory transport overrides this."""
        return []

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int, label: tuple[str, int, int]) -> None:
        import torch.distributed as dist

        refuse_self_hop(self.pp_rank, dst)
        self.ledger.record(*label, tensors)
        # One tensor goes as it is (no packing copy; the pending send keeps it alive).
        flat = (tensors[0].detach().reshape(-1) if len(tensors) == 1 else pack(tensors)).to(self.device)
        if self.link_clock is not None:  # posted now: the emulated link decides when it arrives
            n_bytes = flat.numel() * flat.element_size()
            flat = with_arrival(flat, self.link_clock.arrival(dst, n_bytes, time.perf_counter()))
        # Keep the buffer alive until the send completes.
        self._pending.append((dist.isend(flat, self._global(dst), tag=tag), flat, dst))

    def ready(self, src: int, tag: int) -> bool:
        return True

    def begin_group(self) -> None:
        pass

    def end_group(self) -> None:
        pass

    def close(self) -> None:
        pass

    def prepost_recv(self, shapes: list[torch.Size], dtype: torch.dtype, src: int, tag: int) -> None:
        """Post the receive of (src, tag) now; `recv` of the same message then only waits for it."""
        refuse_self_hop(self.pp_rank, src)
        if (src, tag) not in self._posted:
            self._posted[(src, tag)] = self._irecv(shapes, dtype, src, tag)

    def _irecv(self, shapes: list[torch.Size], dtype: torch.dtype, src: int, tag: int) -> tuple:
        import torch.distributed as dist

        numel = sum(int(torch.Size(s).numel()) for s in shapes)
        if self.link_clock is not None:
            numel += stamp_numel(dtype)
        flat = torch.empty(numel, dtype=dtype, device=self.device)
        return dist.irecv(flat, self._global(src), tag=tag), flat

    def recv(self, shapes: list[torch.Size], dtype: torch.dtype, src: int, tag: int) -> list[torch.Tensor]:
        refuse_self_hop(self.pp_rank, src)
        posted = self._posted.pop((src, tag), None)
        work, flat = posted if posted is not None else self._irecv(shapes, dtype, src, tag)
        try:
            work.wait(self.timeout)
        except RuntimeError as error:
            raise TransportTimeout(
                f"rank {self.pp_rank}: receive from rank {src} (tag {tag}) failed (a peer reset, or no data within "
                f"{self.timeout.total_seconds():.0f} s); is rank {src} still alive? ({error})"
            ) from error
        if self.link_clock is not None:
            flat = wait_for_arrival(flat)
        return unpack(flat, shapes)

    def flush(self) -> None:
        pending, self._pending = self._pending, []
        for work, _buffer, dst in pending:
            try:
                work.wait(self.timeout)
            except RuntimeError as error:
                raise TransportTimeout(
                    f"rank {self.pp_rank}: send to rank {dst} failed (a peer reset, or not delivered within "
                    f"{self.timeout.total_seconds():.0f} s); is rank {dst} still alive? ({error})"
                ) from error
