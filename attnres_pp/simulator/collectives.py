"""Ring collectives' prices (no contention, no overlap with compute): the data-parallel all-reduce,
FSDP's all-gather and reduce-scatter, and the tensor-parallel layers' collectives.
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
