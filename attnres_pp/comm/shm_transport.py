"""SharedMemoryTransport: ranks on one host hand a hop's tensors over through shared memory, with a
counter per message and a pipe as doorbell; no payload and no message goes through gloo.

Why: over gloo's TCP pairs the sender's isend copies every byte into the socket and the receiver's
gloo thread copies it out again into a buffer allocated per message; and every isend, even of one
byte, takes the pair's lock, which the gloo thread holds while it handles the peer's traffic: on a
host whose cores are all computing, that thread waits for a core and the send waits for it
(measured here: a one-byte isend took ~180 us inside a running pipeline, 13 us alone).
Here the sender copies the hop's tensors once into the message's slot in a file that both ranks
map and bumps the message's counter; the receiver's tensors are views of the slot: no copy, no
allocation. A receive whose counter has moved returns at once; otherwise it raises its 'waiting'
flag and sleeps in poll() on a pipe, which the sender writes a byte to only when it sees the flag
(or until the peer's exit, or the timeout).

Slots: one per message of a step (its tag: direction, sending chunk, microbatch), laid out from
the step's message list, which every rank derives from the same schedule and plan. A slot is
written again only when its message is sent again, in the next step, after every rank has
finished this one (the optimiser step's all-reduce and the driver's step both wait for all ranks),
so the receiver no longer holds views of it. The files are unlinked as soon as every rank has
opened them: nothing is left behind, even after a crash. A message without a slot (not in the
list) goes over gloo whole, as DistTransport sends it. Pipelined evaluation runs its forward-only
passes back to back with no all-reduce between them, so it does not use the slots: the worker
gives its runtime a plain DistTransport (`train.stage_worker`).
Under D x P each replica's ranks map their own files, named by global ranks. With an emulated
slow link (`comm.link`) every rank takes DistTransport, which applies the link's delay.
"""

from __future__ import annotations

import os
import platform
import secrets
import select
import shutil
import socket
import threading
import time

import torch

from attnres_pp.comm.link import LinkModel
from attnres_pp.comm.transport import ByteLedger, DistTransport, TransportTimeout

SHM_DIR = "/dev/shm"
ALIGN_ELEMENTS = 64  # slots start on 256-byte boundaries (fp32)

Message = tuple[int, int, int, tuple[torch.Size, ...]]  # (src, dst, tag, shapes), see pipeline.routes


class _Pair:
    """One direction between two ranks: the slots' views by tag, the counters (one per message,
    then the receiver's 'waiting' flag), the doorbell pipe."""

    def __init__(self, views: dict[int, tuple[torch.Tensor, ...]], index: dict[int, int],
                 counters: torch.Tensor, fd: int) -> None:
        self.views, self.index, self.fd = views, index, fd
        self.counters_tensor = counters  # keeps the mapping alive
        self.counters = counters.numpy()  # element reads and writes without torch's per-call cost
        self.waiting = len(index)  # position of the flag
        self.done = dict.fromkeys(index, 0)  # times each message was sent (sender) or received (receiver)


_FENCE = threading.Lock()


def _fence() -> None:
    """A full memory barrier: taking a lock is an atomic read-modify-write, which x86 orders with
    every load and store around it (plain stores may otherwise pass later loads)."""
    with _FENCE:
        pass


class SharedMemoryTransport(DistTransport):
    """DistTransport whose known messages travel through shared memory (see the module docstring).
    Peers are pipeline ranks, as for DistTransport; `inbox` and `outbox` are keyed by them."""

    def __init__(self, pp_rank: int, timeout_s: float, inbox: dict[int, _Pair], outbox: dict[int, _Pair],
                 ledger: ByteLedger | None = None, peer_ranks: list[int] | None = None) -> None:
        super().__init__(pp_rank, timeout_s, torch.device("cpu"), ledger, peer_ranks=peer_ranks)
        self._in, self._out = inbox, outbox  # by peer rank
        self.timeout_s = timeout_s

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int, label: tuple[str, int, int]) -> None:
        pair = self._out.get(dst)
        if pair is None or tag not in pair.index:
            super().send(tensors, dst, tag, label)
            return
        slot = pair.views[tag]
        if len(tensors) != len(slot) or any(t.shape != v.shape for t, v in zip(tensors, slot, strict=False)):
            raise ValueError(f"rank {self.pp_rank}: message {tag} to rank {dst} carries shapes "
                             f"{[tuple(t.shape) for t in tensors]}, its slot {[tuple(v.shape) for v in slot]}")
        for view, tensor in zip(slot, tensors, strict=True):
            view.copy_(tensor.detach())
        self.ledger.record(*label, tensors)
        count = pair.done[tag] + 1
        pair.done[tag] = count
        pair.counters[pair.index[tag]] = count  # after the payload (x86 keeps stores in order)
        # Ring only a receiver that waits: a doorbell wakes it, and on a busy host the woken
        # receiver may take this core from the sender. The fences on both sides (store, fence, load)
        # make sure one of them sees the other's store: the sender the flag, or the receiver the count.
        _fence()
        if pair.counters[pair.waiting]:
            try:
                os.write(pair.fd, b"\0")
            except BlockingIOError:  # the pipe is full of earlier doorbells: the receiver looks anyway
                pass

    def prepost_recv(self, shapes: list[torch.Size], dtype: torch.dtype, src: int, tag: int) -> None:
        pair = self._in.get(src)
        if pair is None or tag not in pair.index:
            super().prepost_recv(shapes, dtype, src, tag)

    def recv(self, shapes: list[torch.Size], dtype: torch.dtype, src: int, tag: int) -> list[torch.Tensor]:
        pair = self._in.get(src)
        if pair is None or tag not in pair.index:
            return super().recv(shapes, dtype, src, tag)
        expected = pair.done[tag] + 1
        position = pair.index[tag]
        if pair.counters[position] < expected:
            self._wait(pair, position, expected, src, tag)
        pair.done[tag] = expected
        return list(pair.views[tag])

    def _wait(self, pair: _Pair, position: int, expected: int, src: int, tag: int) -> None:
        deadline = time.monotonic() + self.timeout_s
        poller = select.poll()
        poller.register(pair.fd, select.POLLIN)
        counters = pair.counters
        counters[pair.waiting] = 1
        try:
            _fence()
            while counters[position] < expected:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TransportTimeout(f"rank {self.pp_rank}: message {tag} from rank {src} did not come "
                                           f"within {self.timeout_s:.0f} s; is rank {src} still alive?")
                events = poller.poll(min(remaining, 0.05) * 1e3)  # in slices: a look without a bell too
                try:
                    drained = os.read(pair.fd, 1 << 16)
                except BlockingIOError:
                    drained = b"x"
                if events and not drained and counters[position] < expected:  # writer gone: the peer exited
                    raise TransportTimeout(f"rank {self.pp_rank}: rank {src} closed its end before sending "
                                           f"message {tag}; is rank {src} still alive?")
        finally:
            counters[pair.waiting] = 0

    def close(self) -> None:
        for pair in (*self._in.values(), *self._out.values()):
            os.close(pair.fd)
        self._in, self._out = {}, {}


def connect_transport(pp_rank: int, n_stages: int, device: torch.device, timeout_s: float,
                      messages: list[Message], dtype: torch.dtype, *, peer_ranks: list[int] | None = None,
                      link: LinkModel | None = None) -> DistTransport:
    """The transport of a rank in an initialised process group: SharedMemoryTransport when every rank
    is on this host, on an x86 CPU, /dev/shm has room for the slots, no link is emulated, and none
    sets ATTNRES_PP_SHM=0; DistTransport otherwise.

    `messages` are in pipeline ranks (`pipeline.routes.wire_messages`); `peer_ranks[p]` is the global
    rank of pipeline rank p in this rank's replica (default p: one replica), as for DistTransport.
    Under D x P every replica maps its own files (named by global ranks). With `link` (an emulated
    slow link) every message goes through DistTransport, which applies the link's delay.
    Collective over the whole default group: every rank calls it with the same messages and link.
    """
    import torch.distributed as dist

    def dist_transport() -> DistTransport:
        return DistTransport(pp_rank, timeout_s, device, peer_ranks=peer_ranks, link=link)

    if link is not None:  # every rank has the same link: none of them takes the collective below
        return dist_transport()
    global_rank = (lambda p: p) if peer_ranks is None else peer_ranks.__getitem__
    world_size = dist.get_world_size()
    n_replicas = max(1, world_size // n_stages)
    element = torch.empty((), dtype=dtype).element_size()
    layout = _layout(messages)
    # The shared memory the ranks of this host map, in bytes: every replica's files.
    need = n_replicas * sum(n for n, _offsets in layout.values()) * element
    # x86 only: the receiver reads a message's counter, then its slot, with no fence between; x86
    # keeps both the sender's stores and the receiver's loads in order, weaker memory models do not.
    wants = (device.type == "cpu" and os.environ.get("ATTNRES_PP_SHM", "1") != "0"
             and platform.machine() in ("x86_64", "AMD64") and os.path.isdir(SHM_DIR) and bool(messages))
    free = shutil.disk_usage(SHM_DIR).free if wants else 0
    facts = [None] * world_size
    dist.all_gather_object(facts, (socket.gethostname(), wants, free, secrets.token_hex(8)))
    if (len({host for host, _w, _f, _t in facts}) != 1 or not all(w for _h, w, _f, _t in facts)
            or 2 * need > min(f for _h, _w, f, _t in facts)):
        return dist_transport()
    base = os.path.join(SHM_DIR, f"attnres-pp-{facts[0][3]}")
    mine = [pair for pair in layout if pp_rank in pair]
    files, fds = {}, {}
    for src, dst in mine:
        stem = f"{base}-{global_rank(src)}-to-{global_rank(dst)}"
        files[(src, dst)] = (f"{stem}.data", f"{stem}.count", f"{stem}.bell")
        if dst == pp_rank:  # the receiver makes the files and opens the pipe's reading end first
            os.mkfifo(files[(src, dst)][2], 0o600)
            fds[(src, dst)] = os.open(files[(src, dst)][2], os.O_RDONLY | os.O_NONBLOCK)
    arenas = {pair: _map(files[pair], *layout[pair], dtype) for pair in mine if pair[1] == pp_rank}
    dist.barrier()
    for src, dst in mine:
        if src == pp_rank:
            arenas[(src, dst)] = _map(files[(src, dst)], *layout[(src, dst)], dtype)
            fds[(src, dst)] = os.open(files[(src, dst)][2], os.O_WRONLY | os.O_NONBLOCK)
    dist.barrier()
    for src, dst in mine:
        if dst == pp_rank:
            for path in files[(src, dst)]:
                os.unlink(path)
    shapes_of = {(src, dst, tag): shapes for src, dst, tag, shapes in messages}
    inbox, outbox = {}, {}
    for src, dst in mine:
        offsets = layout[(src, dst)][1]
        data, counters = arenas[(src, dst)]
        views = {tag: _views(data, offset, shapes_of[(src, dst, tag)]) for tag, offset in offsets.items()}
        pair = _Pair(views, {tag: i for i, tag in enumerate(offsets)}, counters, fds[(src, dst)])
        (inbox if dst == pp_rank else outbox)[src if dst == pp_rank else dst] = pair
    return SharedMemoryTransport(pp_rank, timeout_s, inbox, outbox, peer_ranks=peer_ranks)


def _map(paths: tuple[str, str, str], n_elements: int, offsets: dict[int, int], dtype: torch.dtype):
    data = torch.from_file(paths[0], shared=True, size=max(n_elements, 1), dtype=dtype)
    counters = torch.from_file(paths[1], shared=True, size=len(offsets) + 1, dtype=torch.int64)
    return data, counters


def _layout(messages: list[Message]) -> dict[tuple[int, int], tuple[int, dict[int, int]]]:
    """Per (src, dst): (elements of its data file, tag -> first element of the message's slot)."""
    layout: dict[tuple[int, int], tuple[int, dict[int, int]]] = {}
    for src, dst, tag, shapes in sorted(messages, key=lambda m: (m[0], m[1], m[2])):
        size, offsets = layout.get((src, dst), (0, {}))
        offsets[tag] = size
        numel = sum(torch.Size(s).numel() for s in shapes)
        layout[(src, dst)] = (size + -(-numel // ALIGN_ELEMENTS) * ALIGN_ELEMENTS, offsets)
    return layout


def _views(arena: torch.Tensor, offset: int, shapes: tuple[torch.Size, ...]) -> tuple[torch.Tensor, ...]:
    views, first = [], offset
    for shape in shapes:
        numel = torch.Size(shape).numel()
        views.append(arena[first:first + numel].view(shape))
        first += numel
    return tuple(views)
