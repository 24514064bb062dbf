"""The per-pair transport between three spawned ranks of one machine that state their nodes: a rank
with one peer on its node and one elsewhere sends to the first through shared memory and to the
second over gloo, in the same step; payloads arrive intact; the bytes are counted by way. Ranks that
state three different nodes use gloo for every pair, though /dev/shm is mappable by all of them. Under
D = 2, a replica with no pair on one node leaves the other replica's shared memory alone."""

from __future__ import annotations

import traceback

import pytest
import torch

from tests.spawn_helpers import spawn_ranks

pytestmark = pytest.mark.distributed

SHAPE = torch.Size((2, 3, 4))
# Pipeline ranks 0 -> 1 -> 2 and back, one message per direction of each hop.
MESSAGES = [(0, 1, 1, (SHAPE,)), (1, 2, 2, (SHAPE,)), (2, 1, 3, (SHAPE,)), (1, 0, 4, (SHAPE,))]


def _rank(pp_rank: int, init_method: str, nodes: list[str], results) -> None:
    import torch.distributed as dist

    from attnres_pp.comm.pair_transport import connect_pair_transport
    from attnres_pp.comm.shm_transport import SharedMemoryTransport

    try:
        dist.init_process_group("gloo", init_method=init_method, rank=pp_rank, world_size=3)
        transport = connect_pair_transport(pp_rank, 3, torch.device("cpu"), 30.0, MESSAGES, torch.float32,
                                           node=nodes[pp_rank])
        out = {"shm_peers": sorted(transport.shm_peers),
               "inner_shm": isinstance(transport.inner, SharedMemoryTransport)}
        for step in range(2):
            transport.ledger.clear()
            value = torch.full(SHAPE, 10.0 * step + pp_rank)
            if pp_rank == 0:
                transport.send([value], 1, 1, ("fwd", 0, 0))
                out[f"got {step}"] = transport.recv([SHAPE], torch.float32, 1, 4)[0].clone().numpy()
            elif pp_rank == 1:
                transport.prepost_recv([SHAPE], torch.float32, 2, 3)
                got = transport.recv([SHAPE], torch.float32, 0, 1)[0].clone()
                transport.send([got + 100], 2, 2, ("fwd", 1, 0))
                back = transport.recv([SHAPE], torch.float32, 2, 3)[0].clone()
                transport.send([back + 100], 0, 4, ("bwd", 0, 0))
            else:
                got = transport.recv([SHAPE], torch.float32, 1, 2)[0].clone()
                transport.send([got + 100], 1, 3, ("bwd", 1, 0))
            transport.flush()
            out[f"bytes {step}"] = transport.ledger.bytes_by_transport()
            dist.barrier()  # the step boundary: a slot is written again only in the next step
        transport.close()
        dist.destroy_process_group()
        results.put((pp_rank, out))
    except Exception:
        results.put((pp_rank, traceback.format_exc()))


def _run(tmp_path, nodes: list[str], target=_rank, world: int = 3) -> dict:
    return dict(spawn_ranks(target, world, tmp_path, nodes))


def test_a_mixed_placement_uses_shared_memory_and_gloo_at_once(tmp_path):
    out = _run(tmp_path, ["node-a", "node-a", "node-b"])
    assert out[0]["shm_peers"] == [1] and out[1]["shm_peers"] == [0] and out[2]["shm_peers"] == []
    assert out[0]["inner_shm"] and out[1]["inner_shm"]
    n_bytes = SHAPE.numel() * 4
    for step in range(2):
        # 0 -> 1 -> 2 -> 1 -> 0, each hop adding 100: rank 0 gets its value back plus 300.
        assert (out[0][f"got {step}"] == 10.0 * step + 300).all()
        assert out[0][f"bytes {step}"] == {"shm": n_bytes, "gloo": 0}
        assert out[1][f"bytes {step}"] == {"shm": n_bytes, "gloo": n_bytes}  # one message each way
        assert out[2][f"bytes {step}"] == {"shm": 0, "gloo": n_bytes}


def test_ranks_on_different_nodes_never_use_shared_memory(tmp_path):
    out = _run(tmp_path, ["node-a", "node-b", "node-c"])
    for rank in range(3):
        assert out[rank]["shm_peers"] == []
        assert out[rank]["bytes 1"]["shm"] == 0
    assert (out[0]["got 1"] == 310).all()


def test_ranks_are_numbered_node_by_node_so_a_replica_shares_a_node():
    """SPREAD hands bundles out round-robin over nodes; numbering ranks node by node (as Ray Train
    orders workers) keeps each replica's pipeline ranks on one node where the placement allows."""
    from attnres_pp.comm.node_map import RankFacts, shm_pairs
    from attnres_pp.launch.ray_checks import ranks_by_node

    bundles = ranks_by_node({0: "a", 1: "b", 2: "a", 3: "b"}, 4)
    assert bundles == [0, 2, 1, 3]  # ranks 0, 1 on node a; ranks 2, 3 on node b
    nodes = [{0: "a", 1: "b", 2: "a", 3: "b"}[b] for b in bundles]
    peer = {0: 1, 1: 0, 2: 3, 3: 2}  # D = 2 x P = 2: each rank's pipeline peer
    facts = [RankFacts(node=node, able=True, free=1 << 30, incoming={peer[rank]: 96})
             for rank, node in enumerate(nodes)]
    assert shm_pairs(facts) == {(0, 1), (1, 0), (2, 3), (3, 2)}  # both replicas in shared memory


def _replica_rank(rank: int, init_method: str, nodes: list[str], results) -> None:
    """D = 2 x P = 2: ranks 0, 1 are replica 0, ranks 2, 3 replica 1; one hop each way per step."""
    import torch.distributed as dist

    from attnres_pp.comm.pair_transport import connect_pair_transport

    try:
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=4)
        pp_rank, peers = rank % 2, [rank - rank % 2, rank - rank % 2 + 1]
        messages = [(0, 1, 1, (SHAPE,)), (1, 0, 4, (SHAPE,))]
        transport = connect_pair_transport(pp_rank, 2, torch.device("cpu"), 30.0, messages, torch.float32,
                                           node=nodes[rank], peer_ranks=peers)
        out = {"shm_peers": sorted(transport.shm_peers)}
        for step in range(2):
            transport.ledger.clear()
            if pp_rank == 0:
                transport.send([torch.full(SHAPE, 10.0 * step + rank)], 1, 1, ("fwd", 0, 0))
                out[f"got {step}"] = transport.recv([SHAPE], torch.float32, 1, 4)[0].clone().numpy()
            else:
                got = transport.recv([SHAPE], torch.float32, 0, 1)[0].clone()
                transport.send([got + 100], 0, 4, ("bwd", 0, 0))
            transport.flush()
            out[f"bytes {step}"] = transport.ledger.bytes_by_transport()
            dist.barrier()
        transport.close()
        dist.destroy_process_group()
        results.put((rank, out))
    except Exception:
        results.put((rank, traceback.format_exc()))


def test_a_replica_spread_over_two_nodes_uses_gloo_while_the_other_keeps_shared_memory(tmp_path):
    """Replica 0 spans nodes a and b, replica 1 sits on node a: replica 1's hop goes through shared
    memory although replica 0 has no same-node pair at all, and replica 0's over gloo."""
    out = _run(tmp_path, ["node-a", "node-b", "node-a", "node-a"], target=_replica_rank, world=4)
    n_bytes = SHAPE.numel() * 4
    assert [out[r]["shm_peers"] for r in range(4)] == [[], [], [1], [0]]
    for step in range(2):
        assert (out[0][f"got {step}"] == 10.0 * step + 100).all()
        assert (out[2][f"got {step}"] == 10.0 * step + 102).all()
        for rank in (0, 1):
            assert out[rank][f"bytes {step}"] == {"shm": 0, "gloo": n_bytes}
        for rank in (2, 3):
            assert out[rank][f"bytes {step}"] == {"shm": n_bytes, "gloo": 0}
