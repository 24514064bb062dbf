"""`attnres-pp simulate project`: what one training step of a model costs on a cluster, for the
standard residual, Full AttnRes without a cache, Block AttnRes without and with the cache: the
table to read before booking the cluster.

The model of a step (all of it stated in docs/simulator.md's worked example):
    compute   per chunk and microbatch: matmul FLOPs / achieved FLOP/s, plus memory traffic /
              HBM bandwidth for what is bound by it: each depth read (phase 1 reads its n sources
              and writes its k outputs; a merge reads two tensors and writes one; the standard
              residual add the same), the backward twice the forward
    pipeline  the schedule simulated by the event engine; a message takes latency + bytes /
              bandwidth, and the messages from one rank to the next share that link (one after
              the other); bytes from the payload planner
    data par. D replicas: after the pipeline, each rank all-reduces its gradients with its D - 1
              peers by ring all-reduce, 2 (D - 1) / D x gradient bytes / bandwidth + 2 (D - 1) x
              latency, not overlapped with the pipeline (an upper bound on its cost)
    the optimizer step is not counted.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

from attnres_pp.comm.partition import Partition, make_partition
from attnres_pp.comm.plan import PayloadPlan, plan_for_model
from attnres_pp.model.config import ModelConfig
from attnres_pp.schedule.schedules import build_schedule, schedule_placement
from attnres_pp.simulator.comm import COMM_MODES
from attnres_pp.simulator.costs import CostModel, sublayer_forward_flops
from attnres_pp.simulator.embedding_group import embedding_group_s
from attnres_pp.simulator.engine import simulate
from attnres_pp.simulator.layer_recipe import (
    embedding_shapes,
    head_shapes,
)
from attnres_pp.simulator.memory_state import chunk_layer_shapes
from attnres_pp.simulator.metrics import peak_cache_tensors
from attnres_pp.simulator.units import chunk_work

MODE_LABELS = {"standard": "standard", "full_naive": "Full AttnRes naive", "naive": "Block naive",
               "cached": "Block cached"}


def _positive(name: str, value: float, *, zero_ok: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or (
            value < 0 if zero_ok else value <= 0):
        raise ValueError(f"{name}={value!r} is invalid: give a finite number {'>= 0' if zero_ok else '> 0'}")


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """P x V pipeline, m microbatches, D data-parallel replicas; achieved compute and memory rates,
    the pipeline link (GB/s = 1e9 bytes/s) and the data-parallel link."""

    schedule: str = "interleaved_1f1b"
    n_stages: int
    n_virtual: int = 1
    n_microbatches: int
    data_parallel: int = 1
    tflops: float = 400.0
    hbm_tbs: float = 3.0
    link_gbs: float = 50.0
    link_latency_us: float = 10.0
    dp_link_gbs: float | None = None  # default: link_gbs
    dp_latency_us: float | None = None  # default: link_latency_us

    def __post_init__(self) -> None:
        for name in ("n_stages", "n_virtual", "n_microbatches", "data_parallel"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} is invalid: must be an integer >= 1")
        for name in ("tflops", "hbm_tbs", "link_gbs"):
            _positive(name, getattr(self, name))
        _positive("link_latency_us", self.link_latency_us, zero_ok=True)
        if self.dp_link_gbs is not None:
            _positive("dp_link_gbs", self.dp_link_gbs)
        if self.dp_latency_us is not None:
            _positive("dp_latency_us", self.dp_latency_us, zero_ok=True)

    @property
    def dp_bytes_per_s(self) -> float:
        return 1e9 * (self.dp_link_gbs if self.dp_link_gbs is not None else self.link_gbs)

    @property
    def dp_latency_s(self) -> float:
        return 1e-6 * (self.dp_latency_us if self.dp_latency_us is not None else self.link_latency_us)


def mode_model(cfg: ModelConfig, mode: str) -> tuple[ModelConfig, bool]:
    """(model, cache flag) that sends `mode`'s payloads: Full AttnRes is block size 1."""
    if mode == "standard":
        return dataclasses.replace(cfg, residual="standard", block_size=1), False
    if mode == "full_naive":
        return dataclasses.replace(cfg, residual="attnres" if cfg.residual == "standard" else cfg.residual,
                                   block_size=1), False
    attnres = dataclasses.replace(cfg, residual="attnres" if cfg.residual == "standard" else cfg.residual)
    return attnres, mode == "cached"


@functools.lru_cache(maxsize=256)  # the planner prices tens of thousands of chunks of a few models
def _with_residual(cfg: ModelConfig, residual: str, **changes) -> ModelConfig:
    return dataclasses.replace(cfg, residual=residual, **changes)


def chunk_seconds(cfg: ModelConfig, partition: Partition, chunk_index: int, *, tokens: int, dtype_bytes: int,
                  cluster: Cluster, tensor_parallel: int = 1, sequence_parallel: bool = False) -> float:
    """Forward seconds of one microbatch through a chunk (matmuls + memory-bound reads and adds).

    On one of T tp ranks (docs/spec.md section 10, derived): the layers' matmuls and attention 1/T
    (split heads and hidden units); the depth reads, residual adds and the (replicated) head run on the
    rank's tokens: 1/T of them under sequence parallelism, all of them without it. The tp collectives
    are `tensor_parallel.chunk_tp_seconds`, priced apart."""
    shard = tensor_parallel if sequence_parallel else 1
    plain = _with_residual(cfg, "standard", block_size=1)
    flops = sum(sublayer_forward_flops(plain, s, tokens) for s in partition.sublayer_range(chunk_index))
    flops /= tensor_parallel
    work = chunk_work(_with_residual(cfg, "attnres") if cfg.uses_depth_attention else cfg, partition, chunk_index)
    if work.has_head:
        flops += 2.0 * tokens * cfg.d_model * cfg.vocab_size / shard
    tensor = tokens * cfg.source_width * dtype_bytes / shard
    traffic = sum((n + k) * tensor for n, k in work.segments) + 3 * tensor * (work.n_merges + work.n_adds)
    return flops / (cluster.tflops * 1e12) + traffic / (cluster.hbm_tbs * 1e12)


def project_costs(cfg: ModelConfig, partition: Partition, plan: PayloadPlan, *, tokens: int, dtype_bytes: int,
                  cluster: Cluster) -> CostModel:
    forward = tuple(chunk_seconds(cfg, partition, c, tokens=tokens, dtype_bytes=dtype_bytes, cluster=cluster)
                    for c in range(partition.n_chunks))
    width = cfg.d_model if plan.mode == "standard" else cfg.source_width
    wire = tuple(n * tokens * width * dtype_bytes / (cluster.link_gbs * 1e9) for n in plan.fwd_hop_tensors)
    hops = tuple(0.0 if partition.is_self_hop(c) else w + cluster.link_latency_us * 1e-6 for c, w in enumerate(wire))
    return CostModel(forward_s=forward, backward_s=tuple(2 * f for f in forward), hop_fwd_s=hops, hop_bwd_s=hops,
                     wire_fwd_s=wire, wire_bwd_s=wire, label=f"{cluster.tflops:g} TFLOP/s, {cluster.link_gbs:g} GB/s")


def rank_parameters(cfg: ModelConfig, partition: Partition) -> list[int]:
    """Parameters each pipeline rank holds (its layers, the embedding on chunk 0's, the head on the
    last's; under tied embeddings the LM head's matrix is the embedding's, counted once where one rank
    holds both, a copy on the last rank where the first holds the embedding)."""
    read = [(cfg.query_dim,)] * cfg.uses_depth_attention
    counts = [0] * partition.n_stages
    for c in range(partition.n_chunks):
        rank = partition.rank_of(c)
        counts[rank] += sum(math.prod(s) for s in chunk_layer_shapes(cfg, partition, c, read))
        if c == 0:
            counts[rank] += sum(math.prod(s) for s in embedding_shapes(cfg))
        if c == partition.n_chunks - 1:
            holds_embedding = partition.rank_of(0) == rank
            counts[rank] += sum(math.prod(s) for s in head_shapes(cfg, [], holds_embedding=holds_embedding))
    return counts


def allreduce_s(n_bytes: float, cluster: Cluster) -> float:
    """Ring all-reduce of `n_bytes` over the D replicas (0 when D = 1)."""
    replicas = cluster.data_parallel
    if replicas == 1:
        return 0.0
    return 2 * (replicas - 1) / replicas * n_bytes / cluster.dp_bytes_per_s + 2 * (replicas - 1) * cluster.dp_latency_s


def busiest_link_bytes(plan: PayloadPlan, partition: Partition, tensor_bytes: int, n_microbatches: int) -> int:
    """Bytes per step on the busiest directed link between two ranks (forward and backward hops)."""
    per_link: dict[tuple[int, int], int] = {}
    for c, n_tensors in enumerate(plan.fwd_hop_tensors):
        src, dst = partition.rank_of(c), partition.rank_of(c + 1)
        if src == dst:
            continue
        for link in ((src, dst), (dst, src)):  # the activations one way, their gradients back
            per_link[link] = per_link.get(link, 0) + n_tensors * tensor_bytes * n_microbatches
    return max(per_link.values(), default=0)


def project(cfg: ModelConfig, *, tokens: int, dtype_bytes: int, cluster: Cluster) -> list[dict]:
    """One row per mode of COMM_MODES: step time, bubble, bytes, cache memory, overhead."""
    rows = []
    for mode in COMM_MODES:
        model, cache = mode_model(cfg, mode)
        partition = make_partition(model.n_layers, cluster.n_stages, cluster.n_virtual,
                                   placement=schedule_placement(cluster.schedule))
        plan = plan_for_model(model, partition, cache)
        costs = project_costs(model, partition, plan, tokens=tokens, dtype_bytes=dtype_bytes, cluster=cluster)
        schedule = build_schedule(cluster.schedule, cluster.n_stages, cluster.n_virtual, cluster.n_microbatches)
        result = simulate(schedule, costs)
        pipeline_s = result.makespan
        grads_s = max(allreduce_s(n * dtype_bytes, cluster) for n in rank_parameters(model, partition))
        # Tied embeddings on two ranks: their copies' sum after it, on the pipeline link (0 otherwise).
        embed_s = embedding_group_s(model, partition, data_parallel=cluster.data_parallel,
                                    bytes_per_s=cluster.link_gbs * 1e9, latency_s=cluster.link_latency_us * 1e-6)
        width = model.d_model if plan.mode == "standard" else model.source_width
        tensor_bytes = tokens * width * dtype_bytes
        cache_bytes = max(peak_cache_tensors(result.schedule, plan)) * tensor_bytes if cache else 0
        rows.append({
            "mode": mode, "label": MODE_LABELS[mode],
            "step_s": pipeline_s + grads_s + embed_s, "pipeline_s": pipeline_s, "allreduce_s": grads_s,
            "embed_all_reduce_s": embed_s,
            "bubble_fraction": 1 - sum(result.compute_s) / (cluster.n_stages * pipeline_s),
            "bytes_per_step_busiest_link": busiest_link_bytes(plan, partition, tensor_bytes, cluster.n_microbatches),
            "bytes_per_step_all_links": 2 * sum(plan.fwd_hop_tensors) * tensor_bytes * cluster.n_microbatches,
            "peak_cache_bytes_per_rank": cache_bytes,
        })
    standard = rows[0]["step_s"]
    for row in rows:
        row["overhead_vs_standard"] = row["step_s"] / standard - 1.0
    return rows
