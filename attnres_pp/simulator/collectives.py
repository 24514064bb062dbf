"""Ring collectives' prices (no contention, no overlap with compute): the data-parallel all-reduce,
FSDP's all-gather and reduce-scatter, the tensor-parallel layers' collectives, and expert
parallelism's all-to-all (`all_to_all_s`).
"""

from __future__ import annotations

# Ring algorithms, no contention, no overlap with compute.
# `n_bytes` is the whole buffer: what an all-gather leaves on every member, what a reduce-scatter
# starts from; each of the `group` members sends and receives (group - 1) / group of it in group - 1 steps.

def ring_all_gather_s(n_bytes: float, group: int, bytes_per_s: float, latency_s: float) -> float:
    """Ring all-gather of an `n_bytes` buffer over `group` members (0 for a group of one)."""
    if group <= 1:
        return 0.0
    return (group - 1) / group * n_bytes / bytes_per_s + (group - 1) * latency_s


def ring_reduce_scatter_s(n_bytes: float, group: int, bytes_per_s: float, latency_s: float) -> float:
    """Ring reduce-scatter of an `n_bytes` buffer over `group` members: the all-gather's traffic reversed."""
    return ring_all_gather_s(n_bytes, group, bytes_per_s, latency_s)


def ring_all_reduce_s(n_bytes: float, group: int, bytes_per_s: float, latency_s: float) -> float:
    """Ring all-reduce = reduce-scatter + all-gather of the same buffer: 2 (g - 1) / g x bytes / bandwidth."""
    return (ring_reduce_scatter_s(n_bytes, group, bytes_per_s, latency_s)
            + ring_all_gather_s(n_bytes, group, bytes_per_s, latency_s))


def all_to_all_s(n_bytes: float, group: int, *, peers_in_node: int, intra_bytes_per_s: float,
                 inter_bytes_per_s: float, latency_s: float) -> float:
    """Seconds of one all-to-all in which each of `group` ranks holds `n_bytes` and sends n_bytes / group
    to each other rank: the peers on its node (`peers_in_node` of the group, itself included) over the
    intra-node link, the others over its network link, both at once, plus one latency (the counts'
    exchange goes before it: one more latency). 0 for a group of one."""
    if group == 1:
        return 0.0
    piece = n_bytes / group
    inside = (peers_in_node - 1) * piece / intra_bytes_per_s
    across = (group - peers_in_node) * piece / inter_bytes_per_s
    return max(inside, across) + 2 * latency_s
