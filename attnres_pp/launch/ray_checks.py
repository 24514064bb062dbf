"""What the ray launcher checks before it starts or joins Ray, so that a missing package, an address
nobody answers at or a placement no node can hold is one `error:` line (ValueError) instead of a
traceback or a wait that only a timeout ends, which GPUs each rank of a GPU cluster sees, the order
of the ranks over the nodes, and how a rank is named in a message. Pure functions: they import no
ray and take the cluster's node resources as plain dicts, so they are tested without a cluster."""

from __future__ import annotations

import importlib.util
import socket
from collections.abc import Callable
from urllib.parse import urlsplit

# Ray's own special addresses: "local" starts a private instance, "auto" finds the `ray start` cluster.
_SPECIAL_ADDRESSES = ("auto", "local")
# A cluster answers a TCP connect in milliseconds; an unreachable host would otherwise keep ray.init
# retrying for a minute or more.
CONNECT_TIMEOUT_S = 3.0


def require_ray() -> None:
    """ValueError with the install command when the `ray` package cannot be imported."""
    try:
        found = importlib.util.find_spec("ray") is not None
    except ValueError:  # sys.modules["ray"] is None: imports of ray are blocked
        found = False
    if not found:
        raise ValueError("--launcher ray needs the Python package 'ray', which is missing: "
                         "pip install 'ray[default]', or use --launcher local")


def address_host_port(address: str, source: str = "--address") -> tuple[str, int] | None:
    """(host, port) to probe for a cluster address; None for Ray's special values and for a ray:// address
    without a port (Ray's client picks its default). ValueError for an address Ray cannot use."""
    if address in _SPECIAL_ADDRESSES:
        return None
    if address.startswith(("http://", "https://")):
        raise ValueError(f"{source} {address} is a dashboard (HTTP) address, which `ray job submit` uses: give the "
                         "cluster's GCS address HOST:PORT (port 6379 by default) or ray://HOST:10001")
    scheme, _, _ = address.partition("://")
    parts = urlsplit(address if "://" in address else f"//{address}")
    try:
        port = parts.port
    except ValueError:
        port = -1
    if not parts.hostname or port == -1 or (port is None and scheme != "ray"):
        raise ValueError(f"{source} {address!r} is invalid: give HOST:PORT of the head node (port 6379 by "
                         "default), ray://HOST:PORT, 'auto' for this machine's `ray start` cluster, or leave it "
                         "unset for a private local instance")
    return (parts.hostname, port) if port is not None else None


def check_reachable(address: str, source: str = "--address", timeout_s: float = CONNECT_TIMEOUT_S,
                    connect: Callable = socket.create_connection) -> None:
    """ValueError saying what to change unless a TCP connection to `address`'s host and port opens
    within `timeout_s` (only a port that listens; whether a Ray head answers there is Ray's to say)."""
    host_port = address_host_port(address, source)
    if host_port is None:
        return
    try:
        connect(host_port, timeout=timeout_s).close()
    except OSError as error:
        reason = f"no answer within {timeout_s:g} s" if isinstance(error, TimeoutError) else error.strerror or error
        raise ValueError(
            f"{source} {address} cannot be reached ({reason}): start the cluster there with "
            "`ray start --head`, correct the address, or unset it (--address and RAY_ADDRESS) to run on a private "
            "local Ray instance"
        ) from None


def placement_bundles(world_size: int, tensor_parallel: int = 1, *, gpu: bool = False) -> list[dict[str, float]]:
    """The placement group's bundles for `world_size` ranks: one per tensor-parallel group of T
    consecutive ranks (one per rank at T = 1), with a CPU (and a GPU when `gpu`) for each of its
    ranks. Ray puts a bundle whole on one node under every strategy, so a tp group, whose layers'
    collectives run every layer, never spans nodes; the strategy decides where the groups go."""
    if tensor_parallel < 1 or world_size % tensor_parallel:
        raise ValueError(f"{world_size} ranks do not form tensor-parallel groups of {tensor_parallel}")
    bundle = {"CPU": tensor_parallel, **({"GPU": tensor_parallel} if gpu else {})}
    return [dict(bundle) for _ in range(world_size // tensor_parallel)]


def check_placement(bundles: list[dict[str, float]], strategy: str, nodes: list[dict[str, float]],
                    ranks_per_bundle: int = 1) -> None:
    """ValueError naming what was asked and what the cluster has unless `nodes` (each node's total
    resources, as `ray.nodes()[i]["Resources"]`) can hold `bundles` under `strategy`: STRICT_PACK needs
    one node with room for all of them; PACK and SPREAD may use several nodes. With `ranks_per_bundle`
    T > 1 each bundle is a tensor-parallel group (`placement_bundles`), which must fit on one node:
    when no node has room for one, that rule is the error."""
    asked = _describe_bundles(bundles)
    have = "; ".join(f"node {i}: {_describe(node, bundles)}" for i, node in enumerate(nodes)) or "no alive nodes"
    if ranks_per_bundle > 1:
        asked += f" (one per tensor-parallel group of {ranks_per_bundle} ranks)"
        biggest = max(bundles, key=lambda b: sum(b.values()), default=None)
        if nodes and biggest is not None and not any(_fits(biggest, node) for node in nodes):
            raise ValueError(f"--tensor-parallel {ranks_per_bundle} keeps each tensor-parallel group on one node, "
                             f"which needs a node with {_describe(biggest)}, but the cluster has {have}: use a "
                             f"smaller --tensor-parallel, or nodes with {_describe(biggest)}")
    if strategy == "STRICT_PACK":
        total = _sum(bundles)
        if not any(_fits(total, node) for node in nodes):
            raise ValueError(f"--placement STRICT_PACK needs one node with {_describe(total)} for {asked}, but the "
                             f"cluster has {have}: use fewer --stages, or --placement PACK or SPREAD to span nodes")
        return
    free = [dict(node) for node in nodes]
    placed = 0
    for bundle in sorted(bundles, key=lambda b: -sum(b.values())):
        node = next((n for n in free if _fits(bundle, n)), None)
        if node is None:
            break
        for key, amount in bundle.items():
            node[key] = node.get(key, 0.0) - amount
        placed += 1
    if placed < len(bundles):
        if not placed:
            fix = "add nodes with these resources"
        elif ranks_per_bundle > 1:
            fix = f"use fewer --stages or --data-parallel ({placed} groups fit), or add nodes"
        else:
            fix = f"use --stages {placed} or fewer, or add nodes"
        raise ValueError(f"--placement {strategy} cannot place {asked}: the cluster's nodes hold only {placed} of "
                         f"them ({have}); {fix}")


def node_gpu_views(rank_nodes: list[str], rank_gpus: list[list[str]]) -> list[tuple[str, int]]:
    """What each global rank's process should see on a GPU cluster where Ray gave every rank one GPU
    (`rank_gpus[r]`: the ids Ray assigned to rank r, `rank_nodes[r]`: its node): (the
    CUDA_VISIBLE_DEVICES of every GPU assigned to a rank of its node, in id order; the index of its
    own GPU among them, its LOCAL_RANK device). Ray alone shows each actor only its own GPU, which
    hides the other GPUs of the node from NCCL and so rules out peer-to-peer copies between them.
    ValueError when a rank has other than one GPU or two ranks of a node were given the same one."""
    if len(rank_nodes) != len(rank_gpus):
        raise ValueError(f"{len(rank_nodes)} nodes but {len(rank_gpus)} GPU lists: one of each per rank")
    by_node: dict[str, list[str]] = {}
    for rank, (node, gpus) in enumerate(zip(rank_nodes, rank_gpus, strict=True)):
        if len(gpus) != 1:
            raise ValueError(f"rank {rank} holds {len(gpus)} GPUs ({gpus}); each rank takes exactly one")
        mine = by_node.setdefault(node, [])
        if str(gpus[0]) in mine:
            raise ValueError(f"rank {rank} was given GPU {gpus[0]} of node {node}, which another rank there holds")
        mine.append(str(gpus[0]))
    ordered = {node: sorted(ids, key=lambda i: (len(i), i)) for node, ids in by_node.items()}  # "10" after "9"
    return [(",".join(ordered[node]), ordered[node].index(str(gpus[0])))
            for node, gpus in zip(rank_nodes, rank_gpus, strict=True)]


def _fits(need: dict[str, float], node: dict[str, float]) -> bool:
    return all(node.get(key, 0.0) >= amount for key, amount in need.items() if amount > 0)


def _sum(bundles: list[dict[str, float]]) -> dict[str, float]:
    total: dict[str, float] = {}
    for bundle in bundles:
        for key, amount in bundle.items():
            total[key] = total.get(key, 0.0) + amount
    return total


def _describe(resources: dict[str, float], bundles: list[dict[str, float]] | None = None) -> str:
    """'4 CPU, 1 GPU': only the kinds a bundle asks for (a node lists memory, node ids and more)."""
    keys = sorted({k for b in bundles for k in b}) if bundles is not None else sorted(resources)
    return ", ".join(f"{resources.get(key, 0.0):g} {key}" for key in keys)


def _describe_bundles(bundles: list[dict[str, float]]) -> str:
    if bundles and all(b == bundles[0] for b in bundles):
        return f"{len(bundles)} bundles of {{{_describe(bundles[0])}}}"
    return ", ".join(f"{{{_describe(b)}}}" for b in bundles)


class RendezvousError(ValueError):
    """The ranks' process group did not connect: one line naming the ranks and their addresses (a
    ValueError, so the CLI prints it as `error:` and exits 2)."""


def ranks_by_node(bundle_nodes: dict, n_bundles: int, ranks_per_bundle: int = 1) -> list[int]:
    """Bundle index of each global rank such that ranks on one node are consecutive, nodes in the
    order their first bundle comes (as Ray Train orders its workers): a replica's pipeline ranks
    then share a node where the placement allows, and their hops stay in shared memory. With
    `ranks_per_bundle` T > 1 a bundle is a tensor-parallel group: global ranks g T .. g T + T - 1
    (the mesh's tp innermost) all take the g-th bundle of that order."""
    order: dict = {}
    for index in range(n_bundles):
        order.setdefault(bundle_nodes.get(index, bundle_nodes.get(str(index))), []).append(index)
    return [index for indices in order.values() for index in indices for _ in range(ranks_per_bundle)]


def actor_label(name: str, worker) -> str:
    """`name rank=R (dp d, pp p[, tp t])`: the worker's global rank and, where it has them
    (`coords`, a `pipeline.mesh.RankCoords`), its mesh coordinates, tp only when T > 1."""
    coords = getattr(worker, "coords", None)
    if coords is None:
        return f"{name} rank={getattr(worker, 'rank', getattr(worker, 'pp_rank', '?'))}"
    tp = f", tp {coords.tp_rank}" if coords.tensor_parallel > 1 else ""
    axes = f"dp {coords.dp_rank}, pp {coords.pp_rank}{tp}"
    return f"{name} rank={coords.rank} ({axes})"


def where_rank(rank_nodes: list[tuple[str, str]], rank: int) -> str:
    """`rank R on node IP (id prefix)`, as far as the group knows the rank's node."""
    if not rank_nodes or rank < 0 or rank >= len(rank_nodes):
        return f"rank {rank}"
    node_id, ip = rank_nodes[rank]
    return f"rank {rank} on node {ip} ({node_id[:8]})"
