"""SharedMemoryTransport: ranks on one node hand a hop's tensors over through shared memory, with a
counter per message and a pipe as doorbell; no payload of those messages goes through gloo. Which
pairs of ranks get slots comes from the node map (`comm.node_map`); the others' messages go over gloo.

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
so by then the receiver holds no views of it. A receive checks that the counter is exactly the
one it expects: a sender one send ahead would have overwritten a slot not yet read, and that
raises (MessageOutOfStep) naming the peer and the message rather than being read silently.

Set-up and clean-up: the receiver of each pair makes its files with every page allocated
(posix_fallocate), so a full tmpfs is a SharedMemoryFull at start, never a SIGBUS when a page is
first written mid-step. Each phase (allocate, then open the peers' files) ends in a collective
that tells every rank every rank's outcome, so all go on or all raise the same error. The files
carry the run's random prefix and every rank removes all of them as soon as the set-up ends,
whether it succeeded, failed, or a peer died in it: nothing is left behind, even after a crash.
Should every rank of a run die inside its set-up (a SIGKILL of all), its files stay: each file's
name carries its creator's pid (`attnres-pp-TOKEN-SRC-to-DST-pPID.data`), and every set-up first
removes this project's files in the directory whose creator is no longer alive (`remove_stale`;
ranks of one machine share a pid namespace, as under Ray and the netns harness).
A doorbell rung at a receiver that has just closed its end (it saw the message and left) is no
error; one whose receiver died inside its wait (its flag still up) is a PeerGone naming it.
A message without a slot (not in the
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
from attnres_pp.comm.node_map import RankFacts, shm_pairs
from attnres_pp.comm.shm_files import (
    Message,
    SharedMemoryFull,
    create_files,
    file_stem,
    open_files,
    remove_stale,
    slot_layout,
    slot_views,
    unlink_run,
)
from attnres_pp.comm.transport import ByteLedger, DistTransport, TransportTimeout

SHM_DIR = "/dev/shm"


class SlotPair:
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


class MessageOutOfStep(RuntimeError):
    """A slot's counter is past the message the receiver expects: its sender is ahead."""


class PeerGone(TransportTimeout):
    """A peer's process ended in the middle of an exchange with this rank."""


class SharedMemoryTransport(DistTransport):
    """DistTransport whose known messages travel through shared memory (see the module docstring).
    Peers are pipeline ranks, as for DistTransport; `inbox` and `outbox` are keyed by them."""

    def __init__(self, pp_rank: int, timeout_s: float, inbox: dict[int, SlotPair], outbox: dict[int, SlotPair],
                 ledger: ByteLedger | None = None, peer_ranks: list[int] | None = None) -> None:
        super().__init__(pp_rank, timeout_s, torch.device("cpu"), ledger, peer_ranks=peer_ranks)
        self._in, self._out = inbox, outbox  # by peer rank
        self.timeout_s = timeout_s

    def peers_with_slots(self) -> set[int]:
        """The pipeline ranks this rank exchanges messages with through shared memory."""
        return set(self._in) | set(self._out)

    def message_slots(self) -> list[tuple[torch.Tensor, list[tuple[int, int]]]]:
        """Per inbox arena (one per peer): (first byte, bytes) of each message's slot. A received
        tensor is a view of its slot, so the activation meter counts a saved one by its message, not
        by the arena of every message from that peer."""
        slots = []
        for pair in self._in.values():
            ranges = [(views[0].storage_offset() * views[0].element_size(),
                       sum(v.numel() * v.element_size() for v in views)) for views in pair.views.values() if views]
            arena = next((views[0] for views in pair.views.values() if views), None)
            if arena is not None:
                slots.append((arena, ranges))
        return slots

    def has_slot(self, dst: int, tag: int) -> bool:
        """Whether message `tag` to pipeline rank `dst` goes through shared memory (else gloo)."""
        pair = self._out.get(dst)
        return pair is not None and tag in pair.index

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int, label: tuple[str, int, int]) -> None:
        pair = self._out.get(dst)
        if pair is None or tag not in pair.index:
            super().send(tensors, dst, tag, label)
            return
        slot = pair.views[tag]
        if len(tensors) != len(slot) or any(t.shape != v.shape for t, v in zip(tensors, slot, strict=True)):
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
            self._ring(pair, dst, tag)

    def _ring(self, pair: SlotPair, dst: int, tag: int) -> None:
        try:
            os.write(pair.fd, b"\0")
        except BlockingIOError:  # the pipe is full of earlier doorbells: the receiver looks anyway
            pass
        except BrokenPipeError:
            # The receiver closed its end after this send saw its flag. If it has lowered the flag,
            # it left its wait (it saw this message, or its wait ended in an error it reports
            # itself) and then closed the transport or exited: nothing is lost by the bell. A flag
            # still raised means it died inside the wait: that, not the broken pipe, is the cause.
            _fence()
            if pair.counters[pair.waiting]:
                raise PeerGone(f"rank {self.pp_rank}: rank {dst} exited while waiting for a message from this "
                               f"rank (its doorbell closed with its waiting flag up; message {tag} was written "
                               f"for it); is rank {dst} still alive? Its own error, if any, is the cause") from None

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
        count = int(pair.counters[position])
        if count < expected:
            self._wait(pair, position, expected, src, tag)
            count = int(pair.counters[position])
        if count != expected:  # the sender wrote the slot again before this rank read it
            raise MessageOutOfStep(
                f"rank {self.pp_rank}: message {tag} from rank {src} has been sent {count} times, but this rank "
                f"has received it {expected - 1} times: rank {src} is {count - expected} send(s) ahead and "
                "overwrote a slot not yet read (the ranks are out of step: a schedule or step boundary is wrong)")
        pair.done[tag] = expected
        return list(pair.views[tag])

    def _wait(self, pair: SlotPair, position: int, expected: int, src: int, tag: int) -> None:
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
                      link: LinkModel | None = None, directory: str = SHM_DIR,
                      node: str | None = None) -> DistTransport:
    """The transport of a rank in an initialised process group: SharedMemoryTransport holding a slot
    for each message between this rank and a peer on its node (`comm.node_map.shm_pairs`: same
    `node`, both ranks on an x86 CPU with `directory`, a tmpfs such as /dev/shm, present and
    ATTNRES_PP_SHM not 0, and room on the node), the other messages over gloo; DistTransport when
    this rank has no such peer, or a link is emulated.

    `messages` are in pipeline ranks (`pipeline.routes.wire_messages`); `peer_ranks[p]` is the global
    rank of pipeline rank p in this rank's replica (default p: one replica), as for DistTransport.
    `node`: this rank's node identity (a Ray node id; default the host name). Under D x P the pairs
    are chosen per replica, and every replica maps its own files (named by global ranks). With
    `link` (an emulated slow link) every message goes through DistTransport, which applies the
    link's delay. Collective over the whole default group: every rank calls it with the same
    messages and link, whether or not it has a peer on its node. Raises SharedMemoryFull (on every
    rank) if the slots cannot be allocated in full, and PeerGone if a peer dies during the setup;
    either way no file of the run is left in `directory`.
    """
    import torch.distributed as dist

    def dist_transport() -> DistTransport:
        return DistTransport(pp_rank, timeout_s, device, peer_ranks=peer_ranks, link=link)

    if link is not None:  # every rank has the same link: none of them takes the collective below
        return dist_transport()
    outside = [m[:3] for m in messages if not (0 <= m[0] < n_stages and 0 <= m[1] < n_stages)]
    if outside:
        raise ValueError(f"messages {outside} name pipeline ranks outside 0-{n_stages - 1}: give the messages "
                         "of this replica's schedule in pipeline ranks (pipeline.routes.wire_messages)")
    global_rank = (lambda p: p) if peer_ranks is None else peer_ranks.__getitem__
    element = torch.empty((), dtype=dtype).element_size()
    # x86 only: the receiver reads a message's counter, then its slot, with no fence between; x86
    # keeps both the sender's stores and the receiver's loads in order, weaker memory models do not.
    able = (device.type == "cpu" and os.environ.get("ATTNRES_PP_SHM", "1") != "0"
            and platform.machine() in ("x86_64", "AMD64") and os.path.isdir(directory))
    incoming = {global_rank(src): n * element for (src, dst), (n, _offsets) in slot_layout(messages).items()
                if dst == pp_rank and src != pp_rank}
    if able:
        remove_stale(directory)
    mine_facts = RankFacts(node=node or socket.gethostname(), able=able, incoming=incoming,
                           free=shutil.disk_usage(directory).free if able else 0, token=secrets.token_hex(8),
                           pid=os.getpid())
    facts = [None] * dist.get_world_size()
    dist.all_gather_object(facts, mine_facts)
    pairs = shm_pairs(facts)
    if not pairs:  # every rank sees the same facts: none of them takes the set-up's collectives
        return dist_transport()
    layout = slot_layout([m for m in messages if (global_rank(m[0]), global_rank(m[1])) in pairs])
    base = os.path.join(directory, f"attnres-pp-{facts[0].token}")
    mine = [pair for pair in layout if pp_rank in pair]
    stems = {(src, dst): file_stem(base, global_rank(src), global_rank(dst), facts[global_rank(dst)].pid)
             for src, dst in mine}
    arenas, fds = {}, {}
    try:
        # The receiver makes the files, allocated in full, and opens the pipe's reading end first.
        _agree(pp_rank, "allocating the shared-memory slots", lambda: [
            create_files(pair, stems[pair], *layout[pair], dtype, arenas, fds) for pair in mine if pair[1] == pp_rank])
        _agree(pp_rank, "opening the peers' shared-memory slots", lambda: [
            open_files(pair, stems[pair], *layout[pair], dtype, arenas, fds) for pair in mine if pair[0] == pp_rank])
    except BaseException:
        for fd in fds.values():
            os.close(fd)
        raise
    finally:  # every rank has opened its files (or the setup failed): no name is needed any more
        unlink_run(base)
    if not mine:  # this rank took part in the set-up for the others' sake
        return dist_transport()
    shapes_of = {(src, dst, tag): shapes for src, dst, tag, shapes in messages}
    inbox, outbox = {}, {}
    for src, dst in mine:
        offsets = layout[(src, dst)][1]
        data, counters = arenas[(src, dst)]
        views = {tag: slot_views(data, offset, shapes_of[(src, dst, tag)]) for tag, offset in offsets.items()}
        pair = SlotPair(views, {tag: i for i, tag in enumerate(offsets)}, counters, fds[(src, dst)])
        (inbox if dst == pp_rank else outbox)[src if dst == pp_rank else dst] = pair
    return SharedMemoryTransport(pp_rank, timeout_s, inbox, outbox, peer_ranks=peer_ranks)


def _agree(pp_rank: int, what: str, work) -> None:
    """Run this rank's part of a setup phase, then learn every rank's outcome (a collective over
    the default group): all ranks go on together, or all raise, the same error, naming each failed
    rank. A no-room error is a SharedMemoryFull; a peer lost or late in the exchange ends it too."""
    import torch.distributed as dist

    failure = None
    try:
        work()
    except SharedMemoryFull as error:
        failure = ("full", f"rank {pp_rank}: {error}")
    except Exception as error:  # reported to every rank below, so that none waits for this one
        failure = ("error", f"rank {pp_rank}: {type(error).__name__}: {error}")
    outcomes = [None] * dist.get_world_size()
    try:
        dist.all_gather_object(outcomes, failure)
    except RuntimeError as error:  # gloo: a peer closed its connection, or did not come in time
        raise PeerGone(f"rank {pp_rank}: {what} failed: a peer exited or did not answer within the process "
                       f"group's timeout ({error})") from error
    failed = [outcome for outcome in outcomes if outcome is not None]
    if any(kind == "full" for kind, _ in failed):
        raise SharedMemoryFull("; ".join(message for kind, message in failed if kind == "full"))
    if failed:
        raise RuntimeError(f"{what} failed: " + "; ".join(message for _kind, message in failed))


