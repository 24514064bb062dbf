"""The choice of shared memory or gloo per pair of ranks, from the node map alone (`comm.node_map`):
mixed placements, D = 2 with one replica spread over two nodes and one on one node, ranks that
cannot map shared memory, and a node without room, each deciding only its own pairs."""

from __future__ import annotations

import pytest

from attnres_pp.comm.node_map import RankFacts, shm_pairs

GIB = 1 << 30


def facts(nodes: list[str], replicas: list[list[int]], *, n_bytes: int = 1000, free: int = GIB,
          unable: tuple[int, ...] = ()) -> list[RankFacts]:
    """Each rank receives `n_bytes` from each neighbour in its replica's pipeline (ranks in order)."""
    incoming: dict[int, dict[int, int]] = {rank: {} for rank in range(len(nodes))}
    for ranks in replicas:
        for a, b in zip(ranks, ranks[1:], strict=False):
            incoming[b][a] = n_bytes
            incoming[a][b] = n_bytes
    return [RankFacts(node=node, able=rank not in unable, free=free, incoming=incoming[rank])
            for rank, node in enumerate(nodes)]


def test_a_mixed_placement_keeps_the_same_node_pair_in_shared_memory():
    assert shm_pairs(facts(["a", "a", "b"], [[0, 1, 2]])) == {(0, 1), (1, 0)}


def test_two_replicas_one_spread_over_two_nodes_one_on_one_node():
    """D = 2, P = 2: replica 0 (ranks 0, 1) spans nodes a and b, replica 1 (ranks 2, 3) sits on a.
    Replica 1 keeps its hop in shared memory; replica 0, with no pair on one node, goes over gloo."""
    assert shm_pairs(facts(["a", "b", "a", "a"], [[0, 1], [2, 3]])) == {(2, 3), (3, 2)}
    assert shm_pairs(facts(["a", "a", "b", "b"], [[0, 1], [2, 3]])) == {(0, 1), (1, 0), (2, 3), (3, 2)}
    # Ranks of two replicas on one node never pair across replicas: only pipeline peers exchange hops.
    assert shm_pairs(facts(["a", "b", "b", "a"], [[0, 1], [2, 3]])) == frozenset()


def test_only_the_node_identity_decides_not_a_shared_host_name():
    """Network namespaces (and hosts cloned from one image) share a host name; distinct Ray node ids
    keep every pair on the network even though /dev/shm would be mappable by all of them."""
    assert shm_pairs(facts(["node-1", "node-2", "node-3"], [[0, 1, 2]])) == frozenset()


def test_a_rank_that_cannot_map_shared_memory_sends_its_pairs_over_gloo_alone():
    # Rank 1 (ATTNRES_PP_SHM=0, or not x86) takes both of its pairs to gloo; replica 1 is untouched.
    got = shm_pairs(facts(["a", "a", "a", "a"], [[0, 1], [2, 3]], unable=(1,)))
    assert got == {(2, 3), (3, 2)}


def test_a_node_without_room_sends_its_pairs_over_gloo_the_other_node_keeps_shared_memory():
    # Node a holds two replicas (4 messages of 1000 bytes), node b one (2 messages).
    nodes = ["a", "a", "a", "a", "b", "b"]
    replicas = [[0, 1], [2, 3], [4, 5]]
    assert shm_pairs(facts(nodes, replicas, free=8000)) == {(0, 1), (1, 0), (2, 3), (3, 2), (4, 5), (5, 4)}
    # Twice the slots must fit: node a needs 2 x 4000 bytes, node b 2 x 2000.
    fewer = facts(nodes, replicas, free=8000)
    fewer = [RankFacts(node=f.node, able=f.able, free=7999 if f.node == "a" else f.free, incoming=f.incoming)
             for f in fewer]
    assert shm_pairs(fewer) == {(4, 5), (5, 4)}


def test_bad_facts_are_refused_saying_what_to_give():
    with pytest.raises(ValueError, match="give the rank's node id or host name"):
        RankFacts(node="", able=True, free=0, incoming={})
    with pytest.raises(ValueError, match="bytes free must be 0 or more"):
        RankFacts(node="a", able=True, free=-1, incoming={})
