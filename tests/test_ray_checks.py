"""The ray launcher's checks before it starts Ray: pure functions, tested without a cluster (nodes are
plain resource dicts, as `ray.nodes()[i]["Resources"]` holds them)."""

from __future__ import annotations

import socket

import pytest

from attnres_pp.pipeline.ray_checks import address_host_port, check_placement, check_reachable

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
