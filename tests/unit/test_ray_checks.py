"""The ray launcher's checks before it starts Ray: pure functions, tested without a cluster (nodes are
plain resource dicts, as `ray.nodes()[i]["Resources"]` holds them)."""

from __future__ import annotations

import socket

import pytest

from attnres_pp.launch.ray_checks import address_host_port, check_placement, check_reachable, placement_bundles
from attnres_pp.launch.ray_rank_group import ranks_by_node
from attnres_pp.pipeline.mesh import RankCoords

CPU = {"CPU": 1.0}
GPU = {"CPU": 1.0, "GPU": 1.0}
# What Ray lists for a node besides the kinds a bundle asks for.
EXTRAS = {"memory": 8e9, "object_store_memory": 2e9, "node:10.0.0.1": 1.0}


def node(**resources: float) -> dict[str, float]:
    return {**EXTRAS, **resources}


@pytest.mark.parametrize(("address", "expected"), [
    ("auto", None), ("local", None), ("10.0.0.1:6379", ("10.0.0.1", 6379)), ("head:6379", ("head", 6379)),
    ("ray://head:10001", ("head", 10001)), ("ray://head", None), ("[::1]:6379", ("::1", 6379)),
])
def test_addresses_ray_accepts(address, expected):
    assert address_host_port(address) == expected


@pytest.mark.parametrize(("address", "needle"), [
    ("10.0.0.1", "give HOST:PORT"), ("head:99999", "give HOST:PORT"), ("head:port", "give HOST:PORT"),
    (":6379", "give HOST:PORT"), ("http://head:8265", "dashboard"), ("https://head:8265", "dashboard"),
])
def test_addresses_ray_cannot_use(address, needle):
    with pytest.raises(ValueError, match=needle):
        address_host_port(address, "RAY_ADDRESS")


def test_an_unreachable_address_says_what_to_do():
    with pytest.raises(ValueError, match=r"RAY_ADDRESS 127\.0\.0\.1:1 cannot be reached .*ray start --head"):
        check_reachable("127.0.0.1:1", "RAY_ADDRESS")


def test_a_silent_host_is_given_up_after_the_timeout():
    def silent(host_port, timeout):
        assert timeout == 0.5 and host_port == ("10.255.255.1", 6379)
        raise TimeoutError

    with pytest.raises(ValueError, match="no answer within 0.5 s"):
        check_reachable("10.255.255.1:6379", timeout_s=0.5, connect=silent)


def test_a_listening_port_passes():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        check_reachable(f"127.0.0.1:{server.getsockname()[1]}")
    check_reachable("auto", connect=None)  # special values are Ray's to resolve: nothing is probed


@pytest.mark.parametrize(("bundles", "strategy", "nodes"), [
    ([CPU] * 4, "STRICT_PACK", [node(CPU=4)]),
    ([CPU] * 4, "STRICT_PACK", [node(CPU=2), node(CPU=8)]),
    ([CPU] * 4, "PACK", [node(CPU=2), node(CPU=2)]),
    ([CPU] * 4, "SPREAD", [node(CPU=1)] * 4),
    ([GPU] * 8, "PACK", [node(CPU=16, GPU=4), node(CPU=16, GPU=4)]),
    ([CPU] * 2, "STRICT_PACK", [node(CPU=0.5), node(CPU=2)]),
])
def test_placements_the_cluster_can_hold(bundles, strategy, nodes):
    check_placement(bundles, strategy, nodes)


def test_strict_pack_needs_one_node_with_every_bundle():
    with pytest.raises(ValueError) as refused:
        check_placement([GPU] * 8, "STRICT_PACK", [node(CPU=16, GPU=4), node(CPU=16, GPU=4)])
    message = str(refused.value)
    assert "STRICT_PACK needs one node with 8 CPU, 8 GPU for 8 bundles of {1 CPU, 1 GPU}" in message
    assert "node 0: 16 CPU, 4 GPU; node 1: 16 CPU, 4 GPU" in message and "--placement PACK or SPREAD" in message
    assert "memory" not in message  # only the kinds the bundles ask for


@pytest.mark.parametrize("strategy", ["PACK", "SPREAD"])
def test_pack_and_spread_count_the_bundles_the_nodes_hold(strategy):
    with pytest.raises(ValueError, match=rf"--placement {strategy} cannot place 5 bundles of \{{1 CPU\}}: the "
                                         r"cluster's nodes hold only 3 of them .*use --stages 3 or fewer"):
        check_placement([CPU] * 5, strategy, [node(CPU=2), node(CPU=1.5)])


def test_bundles_no_node_has_the_resource_for():
    with pytest.raises(ValueError, match="hold only 0 of them .*add nodes"):
        check_placement([GPU] * 2, "PACK", [node(CPU=4)])
    with pytest.raises(ValueError, match="no alive nodes"):
        check_placement([CPU], "STRICT_PACK", [])


def test_a_tensor_parallel_group_is_one_bundle():
    assert placement_bundles(4) == [{"CPU": 1}] * 4  # T = 1: one bundle per rank, as before
    assert placement_bundles(8, 2) == [{"CPU": 2}] * 4
    assert placement_bundles(4, 2, gpu=True) == [{"CPU": 2, "GPU": 2}] * 2
    with pytest.raises(ValueError, match="3 ranks do not form tensor-parallel groups of 2"):
        placement_bundles(3, 2)


@pytest.mark.parametrize(("stages", "data_parallel", "bundle_nodes", "want", "want_nodes"), [
    # PACK on two 3-CPU hosts, P = 2, T = 2: a group per host (per-rank bundles would put ranks 0-2 on a)
    (2, 1, {0: "a", 1: "b"}, [0, 0, 1, 1], "aabb"),
    # SPREAD, D = 2 x P = 2, T = 2, groups round-robin: each replica's two groups on one node
    (2, 2, {0: "a", 1: "b", 2: "a", 3: "b"}, [0, 0, 2, 2, 1, 1, 3, 3], "aaaabbbb"),
    # keys as the placement group table gives them, as strings
    (1, 2, {"0": "b", "1": "a"}, [0, 0, 1, 1], "bbaa"),
])
def test_ranks_of_a_tensor_parallel_group_share_its_bundle_and_node(stages, data_parallel, bundle_nodes, want,
                                                                    want_nodes):
    """Global rank g T + t takes tp group g's bundle (the mesh's tp innermost); bundles are ordered node
    by node, so a replica's pipeline ranks share a node where the placement allows."""
    tp = 2
    world = data_parallel * stages * tp
    bundles = ranks_by_node(bundle_nodes, world // tp, tp)
    assert bundles == want
    nodes = [bundle_nodes.get(b, bundle_nodes.get(str(b))) for b in bundles]
    assert "".join(nodes) == want_nodes
    for rank in range(world):
        members = RankCoords(rank, data_parallel, stages, tp).axis_members("tp")
        assert {nodes[r] for r in members} == {nodes[rank]}  # a tp group on one node


def test_tensor_parallel_placements_the_cluster_can_hold():
    # two 3-CPU hosts: two groups of 2 fit (one per host) where 4 one-rank bundles would split a group
    check_placement(placement_bundles(4, 2), "PACK", [node(CPU=3), node(CPU=3)], ranks_per_bundle=2)
    check_placement(placement_bundles(4, 2), "SPREAD", [node(CPU=2), node(CPU=2)], ranks_per_bundle=2)
    check_placement(placement_bundles(4, 2), "STRICT_PACK", [node(CPU=4)], ranks_per_bundle=2)


def test_a_node_smaller_than_a_tensor_parallel_group_is_refused_naming_the_rule():
    with pytest.raises(ValueError) as refused:
        check_placement(placement_bundles(8, 4), "SPREAD", [node(CPU=3), node(CPU=3), node(CPU=3)],
                        ranks_per_bundle=4)
    assert str(refused.value) == (
        "--tensor-parallel 4 keeps each tensor-parallel group on one node, which needs a node with 4 CPU, but the "
        "cluster has node 0: 3 CPU; node 1: 3 CPU; node 2: 3 CPU: use a smaller --tensor-parallel, or nodes with "
        "4 CPU")


def test_tensor_parallel_groups_the_nodes_cannot_all_hold_are_counted_as_groups():
    # 9 CPUs in all, but three 3-CPU hosts hold one group of 2 each, not the 4 groups asked
    with pytest.raises(ValueError, match=r"--placement PACK cannot place 4 bundles of \{2 CPU\} \(one per "
                                         r"tensor-parallel group of 2 ranks\): the cluster's nodes hold only 3 of "
                                         r"them .*use fewer --stages or --data-parallel \(3 groups fit\)"):
        check_placement(placement_bundles(8, 2), "PACK", [node(CPU=3)] * 3, ranks_per_bundle=2)
