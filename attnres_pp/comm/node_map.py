"""Which pairs of ranks hand their messages over in shared memory: decided from the node map (the
node of each global rank), pair by pair, the same on every rank.

A pair (src -> dst, global ranks) uses shared memory when both ranks state the same node, both can
(`RankFacts.able`: a CPU run on x86 with the shared-memory directory present and not switched off),
and their node's directory has room for the slots of every such pair on that node. Every other pair
goes over gloo. Nothing here compares host names (hosts of a cluster may share one, network
namespaces of one machine always do, hosts of a real cluster need not) and nothing needs a pair on
every rank: a replica spread over two nodes sends over gloo while another, on one node, keeps its
hops in shared memory.

Pure (no torch, no process group): `shm_transport.connect_transport` gathers each rank's facts
and applies `shm_pairs`, and the tests call it with made-up node maps.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, kw_only=True)
class RankFacts:
    """What a rank says about itself at set-up. `node`: its node identity (a Ray node id, or the host
    name for the processes of one machine). `able`: it may map shared memory. `free`: bytes free in
    its shared-memory directory. `incoming`: bytes of the slot files it would make as receiver, by
    sending global rank (every message of its replica addressed to it)."""

    node: str
    able: bool
    free: int
    incoming: dict[int, int]
    token: str = ""  # a random name prefix; rank 0's names the run's files
    pid: int = 0  # the rank's process id: the files it makes as receiver carry it (stale ones are found by it)

    def __post_init__(self) -> None:
        if not isinstance(self.node, str) or not self.node:
            raise ValueError(f"RankFacts.node={self.node!r} is invalid: give the rank's node id or host name")
        if self.free < 0:
            raise ValueError(f"RankFacts.free={self.free!r} is invalid: bytes free must be 0 or more")


def shm_pairs(facts: list[RankFacts]) -> frozenset[tuple[int, int]]:
    """The (src, dst) global-rank pairs whose messages go through shared memory (module docstring):
    same node, both able, and room on that node for twice the slots of all of its such pairs (the
    margin keeps a tmpfs that other processes also use from filling up during the set-up)."""
    candidates = {(src, dst) for dst, fact in enumerate(facts) for src in fact.incoming
                  if 0 <= src < len(facts) and src != dst and fact.able and facts[src].able
                  and facts[src].node == fact.node}
    need: dict[str, int] = {}
    free: dict[str, int] = {}
    for src, dst in candidates:
        node = facts[dst].node
        need[node] = need.get(node, 0) + facts[dst].incoming[src]
    for fact in facts:
        if fact.able:
            free[fact.node] = min(free.get(fact.node, fact.free), fact.free)
    roomy = {node for node, n_bytes in need.items() if 2 * n_bytes <= free[node]}
    return frozenset(pair for pair in candidates if facts[pair[1]].node in roomy)

