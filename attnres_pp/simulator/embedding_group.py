"""The price of the embedding group (docs/spec.md section 11): where a tied embedding's matrix sits on
two pipeline ranks (the embedding on the first, the LM head on the last: `comm.partition.tied_copy_ranks`)
each holds a copy, and once a step, after the data-parallel reduction, the two sum their gradients
(`train.grad_sync.TiedEmbedding`): a ring all-reduce over a group of two of the fp32 gradient of the
V x d matrix (FSDP2's dim-0 shard of it under fsdp at D > 1, whose rows the two ranks share), that is
2 x bytes x (2 - 1) / 2 on the wire, and two latencies. Each replica and tp lane has its own pair, all
at once; the slowest pair sets the step. Nothing to pay where one rank holds the one matrix (P = 1,
the V-shaped placement of zbv, dualpipev, v_half and v_min, which puts chunk 0 and the last chunk on
rank 0) or the embeddings are untied."""

from __future__ import annotations

from attnres_pp.comm.partition import Partition, tied_copy_ranks
from attnres_pp.model.config import ModelConfig
from attnres_pp.simulator.collectives import ring_all_reduce_s
from attnres_pp.simulator.memory_state import shard_numel

GRAD_BYTES = 4  # gradients are fp32 (fp32 master weights under bf16 autocast), as the dp all-reduce prices them


def embedding_group_bytes(cfg: ModelConfig, partition: Partition, *, data_parallel: int = 1,
                          dp_shard: str = "replicate") -> int:
    """Bytes of the buffer each rank of the group all-reduces once a step (0 without two copies)."""
    if not tied_copy_ranks(cfg.tie_embeddings, partition):
        return 0
    return GRAD_BYTES * shard_numel((cfg.vocab_size, cfg.d_model), data_parallel, dp_shard)


def crosses_nodes(partition: Partition, *, data_parallel: int, tensor_parallel: int, gpus_per_node: int) -> bool:
    """Whether some replica's and tp lane's first and last pipeline rank sit on two nodes (global rank
    (dp x P + pp) x T + tp, `gpus_per_node` consecutive ranks a node: `pipeline.mesh`)."""
    stages, span = partition.n_stages, (partition.n_stages - 1) * tensor_parallel
    # A replica's first rank modulo the node repeats after at most gpus_per_node replicas.
    return any((d * stages * tensor_parallel + t) // gpus_per_node
               != (d * stages * tensor_parallel + t + span) // gpus_per_node
               for d in range(min(data_parallel, gpus_per_node)) for t in range(tensor_parallel))


def embedding_group_s(cfg: ModelConfig, partition: Partition, *, data_parallel: int = 1, dp_shard: str = "replicate",
                      bytes_per_s: float, latency_s: float) -> float:
    """Seconds of the group's all-reduce a step on a link of `bytes_per_s` (0 without two copies)."""
    n_bytes = embedding_group_bytes(cfg, partition, data_parallel=data_parallel, dp_shard=dp_shard)
    return ring_all_reduce_s(n_bytes, 2, bytes_per_s, latency_s) if n_bytes else 0.0
