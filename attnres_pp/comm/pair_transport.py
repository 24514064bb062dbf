"""The transport of a rank whose pipeline peers may sit on other nodes: each peer by the cheapest
way that reaches it, shared memory for a peer on the same node, gloo p2p over the network otherwise,
both at once in a mixed placement; and the bytes each way carried.

"Same node" comes from the node identity each rank states (its Ray node id, or its host name for
processes of one machine), gathered from every rank: never from a file being mappable, since
network namespaces (several "hosts" of one machine, `scripts/netns_cluster.py`) share /dev/shm.

Only messages between two ranks of one node get shared-memory slots (`shm_transport`); a message
without a slot goes over gloo whole, so the shared-memory transport, given the node-local messages
alone, already routes per pair. What this module adds: the choice of those messages from the node
map, and `PairTransport`, which counts each message's bytes by the way it went (`bytes_by_transport`,
reset with the ledger each step).

`connect_transport` still applies its own conditions to the shared-memory part (x86, room in
/dev/shm, one host name across the group, and a non-empty message list on every rank); where one
fails every pair goes over gloo, which the byte counts then show.
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
    "shm" when it went through a slot and "gloo" otherwise."""

    def __init__(self, inner: DistTransport, shm_peers: set[int]) -> None:
        self.inner = inner
        self.pp_rank = inner.pp_rank
        self.shm_peers = frozenset(shm_peers if isinstance(inner, SharedMemoryTransport) else ())
        self.ledger = PairLedger()
        inner.ledger = self.ledger  # one ledger: the runtime reads and clears it through this transport
        self.can_prepost = inner.can_prepost

    def way_to(self, peer: int) -> str:
        return "shm" if peer in self.shm_peers else "gloo"

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int, label: tuple[str, int, int]) -> None:
        self.ledger.next_way = self.way_to(dst)
        self.inner.send(tensors, dst, tag, label)

    def ready(self, src: int, tag: int) -> bool:
        return self.inner.ready(src, tag)

    def prepost_recv(self, shapes: list[torch.Size], dtype: torch.dtype, src: int, tag: int) -> None:
        self.inner.prepost_recv(shapes, dtype, src, tag)

    def recv(self, shapes: list[torch.Size], dtype: torch.dtype, src: int, tag: int) -> list[torch.Tensor]:
        return self.inner.recv(shapes, dtype, src, tag)

    def flush(self) -> None:
        self.inner.flush()

    def close(self) -> None:
        close = getattr(self.inner, "close", None)
        if close is not None:
            close()


def same_node_messages(messages: list[Message], nodes: list[str], peer_ranks: list[int]) -> list[Message]:
    """The messages (in pipeline ranks) whose two ranks, `peer_ranks[src]` and `peer_ranks[dst]` in
    global ranks, are on one node of `nodes` (the node of each global rank)."""
    return [m for m in messages if nodes[peer_ranks[m[0]]] == nodes[peer_ranks[m[1]]]]


def connect_pair_transport(pp_rank: int, n_stages: int, device: torch.device, timeout_s: float,
                           messages: list[Message], dtype: torch.dtype, *, node: str,
                           peer_ranks: list[int] | None = None, link: LinkModel | None = None) -> PairTransport:
    """The transport of a rank in an initialised process group, choosing per peer (module docstring).
    `node`: this rank's node identity. Collective over the default group: every rank calls it,
    with the same `messages` and `link`. With `link` (an emulated slow link) everything goes over
    gloo, which applies its delay."""
    import torch.distributed as dist

    peers = list(range(n_stages)) if peer_ranks is None else list(peer_ranks)
    nodes: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(nodes, node)
    local = same_node_messages(messages, nodes, peers)
    inner = connect_transport(pp_rank, n_stages, device, timeout_s, local, dtype, peer_ranks=peers, link=link)
    shm_peers = {p for p in range(n_stages) if p != pp_rank and nodes[peers[p]] == node}
    return PairTransport(inner, shm_peers)
