"""The transport of a rank whose pipeline peers may sit on other nodes: each peer by the cheapest
way that reaches it, shared memory for a peer on the same node, gloo p2p over the network otherwise,
both at once in a mixed placement; and the bytes each way carried.

"Same node" comes from the node map, the node identity each rank states (its Ray node id, or its
host name for processes of one machine), gathered from every rank: never from a file being
mappable, since network namespaces (several "hosts" of one machine, `attnres_lab.netns_cluster`)
share /dev/shm, and never from host names compared across the group. The pairs are decided one by
one (`comm.node_map.shm_pairs`), so a replica spread over two nodes goes over gloo while another
keeps its hops in shared memory; `shm_transport.connect_transport` makes the slots of those pairs,
and a message without a slot goes over gloo whole. What this module adds: `PairTransport`, which
counts each message's bytes by the way it went (`bytes_by_transport`, reset with the ledger each
step).
"""

from __future__ import annotations

import torch

from attnres_pp.comm.link import LinkModel
from attnres_pp.comm.shm_transport import Message, SharedMemoryTransport, connect_transport
from attnres_pp.comm.transport import ByteLedger, DistTransport

TRANSPORTS = ("shm", "gloo")


class PairLedger(ByteLedger):
    """A ByteLedger that also keeps, per record, the way the message went ("shm" or "gloo")."""

    def __init__(self) -> None:
        super().__init__()
        self.ways: list[str] = []
        self.next_way = "gloo"

    def record(self, direction: str, hop_index: int, microbatch_index: int, tensors: list[torch.Tensor]) -> None:
        super().record(direction, hop_index, microbatch_index, tensors)
        self.ways.append(self.next_way)

    def clear(self) -> None:
        super().clear()
        self.ways.clear()

    def bytes_by_transport(self) -> dict[str, int]:
        totals = dict.fromkeys(TRANSPORTS, 0)
        for way, record in zip(self.ways, self.records, strict=True):
            totals[way] += record[4]
        return totals


class PairTransport:
    """Sends to and receives from each pipeline peer through `inner` (a SharedMemoryTransport whose
    slots cover exactly the same-node peers, or a DistTransport), labelling every message's bytes
    "shm" when it went through a slot and "gloo" otherwise. `shm_peers`: the pipeline peers with a
    slot in either direction."""

    def __init__(self, inner: DistTransport) -> None:
        self.inner = inner
        self.pp_rank = inner.pp_rank
        self.shm_peers = frozenset(inner.peers_with_slots() if isinstance(inner, SharedMemoryTransport) else ())
        self.ledger = PairLedger()
        inner.ledger = self.ledger  # one ledger: the runtime reads and clears it through this transport
        self.can_prepost = inner.can_prepost
        self.p2p_semantics = inner.p2p_semantics

    def way_to(self, peer: int, tag: int) -> str:
        return "shm" if isinstance(self.inner, SharedMemoryTransport) and self.inner.has_slot(peer, tag) else "gloo"

    def message_slots(self) -> list:
        """The inner transport's message slots (`SharedMemoryTransport.message_slots`; none over gloo)."""
        return self.inner.message_slots()

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int, label: tuple[str, int, int]) -> None:
        self.ledger.next_way = self.way_to(dst, tag)
        self.inner.send(tensors, dst, tag, label)

    def ready(self, src: int, tag: int) -> bool:
        return self.inner.ready(src, tag)

    def prepost_recv(self, shapes: list[torch.Size], dtype: torch.dtype, src: int, tag: int) -> None:
        self.inner.prepost_recv(shapes, dtype, src, tag)

    def begin_group(self) -> None:
        self.inner.begin_group()

    def end_group(self) -> None:
        self.inner.end_group()

    def recv(self, shapes: list[torch.Size], dtype: torch.dtype, src: int, tag: int) -> list[torch.Tensor]:
        return self.inner.recv(shapes, dtype, src, tag)

    def flush(self) -> None:
        self.inner.flush()

    def close(self) -> None:
        self.inner.close()


def connect_pair_transport(pp_rank: int, n_stages: int, device: torch.device, timeout_s: float,
                           messages: list[Message], dtype: torch.dtype, *, node: str,
                           peer_ranks: list[int] | None = None, link: LinkModel | None = None) -> PairTransport:
    """The transport of a rank in an initialised process group, choosing per peer (module docstring).
    `node`: this rank's node identity. Collective over the default group: every rank calls it,
    with the same `messages` and `link`, whether or not it has a peer on its node. With `link` (an
    emulated slow link) everything goes over gloo, which applies its delay."""
    inner = connect_transport(pp_rank, n_stages, device, timeout_s, messages, dtype, peer_ranks=peer_ranks,
                              link=link, node=node)
    return PairTransport(inner)
