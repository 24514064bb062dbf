"""The planner's prices, computed once per layout and shared by the candidates that have it
(`PlanCosts`): seconds per chunk (the `simulate project` chunk model, backward 2x forward, + one
forward under full AC, + the memory-bound part under selective AC; the tp collectives), the hops of
one microbatch on the links between ranks, the data-parallel collectives, and the bytes each rank
holds (the fp32 state, what each chunk saves per microbatch)."""

from __future__ import annotations

import dataclasses
import math

from attnres_pp.comm.partition import Partition, make_partition, tied_copy_ranks
from attnres_pp.comm.plan import plan_for_model, shard_tokens
from attnres_pp.model.config import ModelConfig
from attnres_pp.schedule.schedules import schedule_placement
from attnres_pp.simulator.costs import ring_all_gather_s, ring_all_reduce_s, ring_reduce_scatter_s
from attnres_pp.simulator.embedding_group import crosses_nodes, embedding_group_s
from attnres_pp.simulator.layer_recipe import layer_matmul_elements
from attnres_pp.simulator.memory import (
    DTYPE_BYTES,
    activation_bytes,
    rank_moe_shapes,
    rank_parameter_shapes,
    rank_state_bytes,
    shard_numel,
)
from attnres_pp.simulator.moe import chunk_all_to_all_s
from attnres_pp.simulator.plan_request import Candidate, PlanRequest
from attnres_pp.simulator.project import Cluster, chunk_seconds
from attnres_pp.simulator.tensor_parallel import chunk_tp_seconds


class PlanCosts:
    """The prices of a request's candidates, each computed once for all the candidates that share it
    (chunk times, hops, collectives, state bytes, activations); `plan_rows.Planner` adds the estimate
    and the row of a candidate."""

    def __init__(self, request: PlanRequest) -> None:
        self.request = request
        self.element = DTYPE_BYTES[request.dtype]
        self.cluster = Cluster(n_stages=1, n_microbatches=1, tflops=request.tflops, hbm_tbs=request.hbm_tbs)
        self._chunks: dict = {}
        self._state: dict = {}
        self._saved: dict = {}
        self._plans: dict = {}
        self._numels: dict = {}
        self._tp: dict = {}
        self._layout: dict = {}
        self._models: dict = {}
        self._schedules: dict = {}
        self._partitions: dict = {}

    def layout(self, partition) -> tuple[list[int], list[list[int]]]:
        """(rank of each chunk, chunks of each rank) of a cached partition, computed once."""
        key = id(partition)
        if key not in self._layout:
            self._layout[key] = ([partition.rank_of(c) for c in range(partition.n_chunks)],
                                 [partition.chunks_of(r) for r in range(partition.n_stages)], partition)
        return self._layout[key][:2]

    def model_for(self, candidate: Candidate) -> ModelConfig:
        """The request's model with the candidate's block size (one frozen config per block size)."""
        if candidate.block_size not in self._models:
            self._models[candidate.block_size] = dataclasses.replace(self.request.model,
                                                                     block_size=candidate.block_size)
        return self._models[candidate.block_size]

    def tokens(self, candidate: Candidate) -> int:
        per_microbatch = self.request.global_batch // (candidate.data_parallel * candidate.n_microbatches)
        return per_microbatch * self.request.model.seq_len

    def partition(self, candidate: Candidate) -> Partition:
        """The candidate's split of the layers into P x V chunks on its schedule's placement (one object
        per split: `layout` keeps its ranks by identity)."""
        key = (candidate.n_stages, candidate.n_virtual, schedule_placement(candidate.schedule))
        if key not in self._partitions:
            self._partitions[key] = make_partition(self.request.model.n_layers, key[0], key[1], placement=key[2])
        return self._partitions[key]

    def chunk_forward(self, candidate: Candidate, partition: Partition, chunk: int) -> tuple[float, float]:
        """(forward seconds, the memory-bound part of them) of one chunk and microbatch, tp collectives apart:
        the chunk model (`project.chunk_seconds`), less the same chunk as the standard residual."""
        cfg = self.model_for(candidate)
        if (candidate.block_size, "standard") not in self._models:
            self._models[candidate.block_size, "standard"] = dataclasses.replace(cfg, residual="standard")
        plain = self._models[candidate.block_size, "standard"]
        shared = {"tokens": self.tokens(candidate), "dtype_bytes": self.element, "cluster": self.cluster,
                  "tensor_parallel": candidate.tensor_parallel, "sequence_parallel": candidate.sp}
        forward = chunk_seconds(cfg, partition, chunk, **shared)
        return forward, max(0.0, forward - chunk_seconds(plain, partition, chunk, **shared))

    def chunk_tp(self, candidate: Candidate, partition: Partition, chunk: int) -> float:
        """Seconds of one chunk's collectives inside a layer per microbatch in one direction, not
        overlapped with compute: the tp collectives (and MSAR halos) on the intra-node link
        (`tensor_parallel.chunk_tp_seconds`; 0 at T = 1) and expert parallelism's dispatch and combine
        all-to-alls (`moe.chunk_all_to_all_s`; 0 at EP = 1)."""
        return self._chunk_tp(candidate, partition, chunk) + self.chunk_all_to_all(candidate, partition, chunk)

    def chunk_all_to_all(self, candidate: Candidate, partition: Partition, chunk: int) -> float:
        """Seconds of one chunk's MoE all-to-alls per microbatch and direction (EP ranks: replicas of a
        stage, P x T global ranks apart, on one node as far as it holds them, else the network)."""
        if candidate.expert_parallel == 1:
            return 0.0
        request = self.request
        return chunk_all_to_all_s(self.model_for(candidate), partition, chunk, tokens=self.tokens(candidate),
                                  dtype=request.dtype, expert_parallel=candidate.expert_parallel,
                                  stride=candidate.n_stages * candidate.tensor_parallel,
                                  gpus_per_node=request.gpus_per_node,
                                  intra_bytes_per_s=request.intra_node_gbps * 1e9 / 8,
                                  inter_bytes_per_s=request.inter_node_gbps * 1e9 / 8,
                                  latency_s=request.latency_us * 1e-6)

    def _chunk_tp(self, candidate: Candidate, partition: Partition, chunk: int) -> float:
        if candidate.tensor_parallel == 1:
            return 0.0
        request = self.request
        return chunk_tp_seconds(self.model_for(candidate), partition.sublayer_range(chunk),
                                tokens=self.tokens(candidate), element_bytes=self.element, tp=candidate.tp,
                                bytes_per_s=request.intra_node_gbps * 1e9 / 8,
                                latency_s=request.intra_node_latency_us * 1e-6)

    def chunk_costs(self, candidate: Candidate):
        """(partition, forward seconds per chunk, the memory-bound part of each) for the candidate's split."""
        key = (candidate.n_stages, candidate.n_virtual, candidate.block_size, self.tokens(candidate),
               candidate.tensor_parallel, candidate.sp, schedule_placement(candidate.schedule))
        if key not in self._chunks:
            partition = self.partition(candidate)
            forward, bound = zip(*(self.chunk_forward(candidate, partition, c) for c in range(partition.n_chunks)),
                                 strict=True)
            self._chunks[key] = (partition, list(forward), list(bound))
        return self._chunks[key]

    def tp_seconds(self, candidate: Candidate, partition) -> list[float]:
        """`chunk_tp` of every chunk: the backward has the same again, and full AC's recomputation repeats
        the forward's."""
        if candidate.tensor_parallel == 1 and candidate.expert_parallel == 1:
            return [0.0] * partition.n_chunks
        key = ("seconds", candidate.n_stages, candidate.n_virtual, candidate.block_size, self.tokens(candidate),
               candidate.tensor_parallel, candidate.sp, partition.placement, candidate.expert_parallel)
        if key not in self._tp:
            self._tp[key] = [self.chunk_tp(candidate, partition, c) for c in range(partition.n_chunks)]
        return self._tp[key]

    def chunk_times(self, candidate: Candidate) -> tuple[list[float], list[float]]:
        """(forward, backward) seconds per chunk and microbatch, tp collectives included."""
        key = ("times", candidate.n_stages, candidate.n_virtual, candidate.block_size, self.tokens(candidate),
               candidate.tensor_parallel, candidate.sp, schedule_placement(candidate.schedule),
               candidate.activation_checkpoint, candidate.expert_parallel)
        if key not in self._tp:
            partition, forward, bound = self.chunk_costs(candidate)
            times = [self.directions(candidate, f, b, x)
                     for f, b, x in zip(forward, bound, self.tp_seconds(candidate, partition), strict=True)]
            self._tp[key] = ([f for f, _b in times], [b for _f, b in times])
        return self._tp[key]

    def directions(self, candidate: Candidate, forward: float, bound: float, tp: float) -> tuple[float, float]:
        """(forward, backward) seconds of a chunk from its `chunk_forward` and `chunk_tp`."""
        recompute = 2 if candidate.activation_checkpoint == "full" else 1
        return forward + tp, self.backward_factor(candidate, forward, bound) + recompute * tp

    def backward_factor(self, candidate: Candidate, forward: float, bound: float) -> float:
        """Backward seconds of a chunk: 2 F, + F recomputed (full AC), + its memory-bound part (selective)."""
        extra = {"none": 0.0, "full": forward, "selective": bound}[candidate.activation_checkpoint]
        return 2 * forward + extra

    def fixed_bytes(self, candidate: Candidate, partition) -> list[int]:
        key = (candidate.n_stages, candidate.n_virtual, candidate.block_size, candidate.data_parallel,
               candidate.dp_shard, partition.placement, candidate.tensor_parallel, candidate.expert_parallel)
        if key not in self._state:
            cfg, result, ep = self.model_for(candidate), [], candidate.expert_parallel
            for pp_rank in range(candidate.n_stages):
                shapes = rank_parameter_shapes(cfg, partition, pp_rank, candidate.tensor_parallel, ep)
                terms = rank_state_bytes(cfg, partition, pp_rank, data_parallel=candidate.data_parallel,
                                         dp_shard=candidate.dp_shard, tensor_parallel=candidate.tensor_parallel,
                                         expert_parallel=ep)
                total = sum(terms.values())
                if candidate.dp_shard == "fsdp" and candidate.data_parallel > 1:
                    total += sum(math.prod(s) for s in shapes) * self.element
                result.append(total)
            self._state[key] = result
        return self._state[key]

    def saved(self, candidate: Candidate, partition) -> list:
        copies = not (candidate.dp_shard == "fsdp" and candidate.data_parallel > 1)
        key = (candidate.n_stages, candidate.n_virtual, candidate.block_size, self.tokens(candidate),
               partition.placement, candidate.activation_checkpoint, copies, self.request.attention_kernel,
               candidate.tensor_parallel, candidate.sp, candidate.expert_parallel)
        if key not in self._saved:
            cfg, tokens = self.model_for(candidate), self.tokens(candidate)
            self._saved[key] = [activation_bytes(cfg, partition, c, tokens=tokens, dtype=self.request.dtype,
                                                 activation_checkpoint=candidate.activation_checkpoint,
                                                 weight_copies=copies,
                                                 attention_kernel=self.request.attention_kernel,
                                                 tensor_parallel=candidate.tensor_parallel,
                                                 sequence_parallel=candidate.sp,
                                                 expert_parallel=candidate.expert_parallel)
                                for c in range(partition.n_chunks)]
        return self._saved[key]

    def payloads(self, candidate: Candidate, partition):
        """The payload plan the runtime uses for the candidate's split and cache mode."""
        key = (candidate.n_stages, candidate.n_virtual, candidate.block_size, partition.placement, candidate.cache)
        if key not in self._plans:
            self._plans[key] = plan_for_model(self.model_for(candidate), partition, candidate.cache)
        return self._plans[key]

    def hop_seconds(self, candidate: Candidate, partition, plan) -> tuple[list[float], list[float], int]:
        """(wire seconds, hop seconds with latency, bytes of one tensor) per forward hop of one tp rank's
        pair (d, p, t) -> (d, p + 1, t) (`comm.plan.shard_tokens`: 1/T of the bytes under SP); a self-hop
        is free. Global rank (dp x P + pp) x T + t: tp innermost, G per node."""
        key = ("hops", candidate.n_stages, candidate.n_virtual, candidate.block_size, self.tokens(candidate),
               candidate.tensor_parallel, candidate.sp, partition.placement, plan.mode)
        if key not in self._tp:
            self._tp[key] = self._hop_seconds(candidate, partition, plan)
        return self._tp[key]

    def _hop_seconds(self, candidate: Candidate, partition, plan) -> tuple[list[float], list[float], int]:
        request, cfg = self.request, self.model_for(candidate)
        width = cfg.d_model if plan.mode == "standard" else cfg.source_width
        t = candidate.tensor_parallel
        tensor_bytes = shard_tokens(self.tokens(candidate), t, candidate.sp) * width * self.element
        wire, hops = [], []
        for c, n_tensors in enumerate(plan.fwd_hop_tensors):
            src, dst = partition.rank_of(c) * t, partition.rank_of(c + 1) * t
            same_node = src // request.gpus_per_node == dst // request.gpus_per_node
            bandwidth = (request.intra_node_gbps if same_node else request.inter_node_gbps) * 1e9 / 8
            seconds = n_tensors * tensor_bytes / bandwidth
            wire.append(seconds)
            hops.append(0.0 if partition.is_self_hop(c) else seconds + request.latency_us * 1e-6)
        return wire, hops, tensor_bytes

    def chunk_numels(self, candidate: Candidate, partition) -> list[tuple[int, int, int, int]]:
        """Per chunk (elements, FSDP2's padded elements over D, routed experts' elements, their padded
        elements over the D / EP replicas that hold them): what its units all-gather and reduce-scatter
        (the routed experts apart: docs/spec.md section 12 reduces them over D / EP). MSAR's tied stream
        convolutions are left out: they stay whole on every rank (`train.fsdp`)."""
        key = (candidate.n_stages, candidate.n_virtual, candidate.block_size, partition.placement,
               candidate.data_parallel, candidate.tensor_parallel, candidate.expert_parallel)
        if key not in self._numels:
            cfg, result, ep = self.model_for(candidate), [], candidate.expert_parallel
            tied = (cfg.n_blocks + 1) * len(cfg.stream_kernels) if cfg.residual == "msar" else 0
            for c in range(partition.n_chunks):
                one = _OneChunk(partition, c)
                shapes = rank_parameter_shapes(cfg, one, 0, candidate.tensor_parallel, ep)
                shapes = shapes[:len(shapes) - tied]
                routed, _frozen = rank_moe_shapes(cfg, one, 0, ep)
                for shape in routed:
                    shapes.remove(shape)
                expert_dp = candidate.data_parallel // ep
                result.append((sum(math.prod(s) for s in shapes),
                               sum(shard_numel(s, candidate.data_parallel, "fsdp") for s in shapes)
                               * candidate.data_parallel,
                               sum(math.prod(s) for s in routed),
                               sum(shard_numel(s, expert_dp, "fsdp") for s in routed) * expert_dp))
            self._numels[key] = result
        return self._numels[key]

    def dp_collectives(self, candidate: Candidate, partition, gathers: list[int] | None = None) -> dict:
        """Seconds of the data-parallel collectives of the rank whose total is largest, by kind.

        replicate: one ring all-reduce of the rank's fp32 gradients (`train.grad_sync`). fsdp: per
        chunk, an all-gather of its parameters in the compute dtype (padded to D shards) each time an
        action finds them resharded (`gathers[c]`: once a step under reshard never; under always
        after every F, so about once per forward and once per backward; without `gathers` m + 1),
        and one reduce-scatter of its fp32 gradients. Under expert parallelism the routed experts'
        share goes over the D / EP replicas that hold the same experts (docs/spec.md section 12),
        after the rest. Tied embeddings on two ranks: those two then sum their copies' gradients
        (`embedding_group`, `embed_all_reduce_s` on the first and the last rank). Not overlapped with compute."""
        zero = {"all_reduce_s": 0.0, "all_gather_s": 0.0, "reduce_scatter_s": 0.0, "all_gathers": 0,
                "embed_all_reduce_s": 0.0}
        replicas = candidate.data_parallel
        tp_terms = self.tp_grad_all_reduce(candidate, partition)
        embed_s = self.embed_all_reduce(candidate, partition)
        copies = tied_copy_ranks(self.model_for(candidate).tie_embeddings, partition)
        if replicas == 1:
            return zero | tp_terms | {"embed_all_reduce_s": embed_s, "total_s": embed_s + tp_terms["tp_all_reduce_s"]}
        request = self.request
        same_node = candidate.n_stages * replicas * candidate.tensor_parallel <= request.gpus_per_node
        bandwidth = (request.intra_node_gbps if same_node else request.inter_node_gbps) * 1e9 / 8
        latency = request.latency_us * 1e-6
        numels = self.chunk_numels(candidate, partition)
        if gathers is None:
            gathers = [1 if candidate.reshard_after_forward == "never" else candidate.n_microbatches + 1] * len(numels)
        cfg = self.model_for(candidate)
        tied = (cfg.n_blocks + 1) * sum(cfg.stream_kernels) * cfg.d_model if cfg.residual == "msar" else 0
        # The replicas that hold the same experts; none for a dense model (no collective, no latency).
        experts = replicas // candidate.expert_parallel if cfg.moe else 1
        per_rank = []
        for rank in range(candidate.n_stages):
            chunks = partition.chunks_of(rank)
            if candidate.dp_shard == "replicate":
                grads = sum(numels[c][0] for c in chunks) + tied
                routed = sum(numels[c][2] for c in chunks)
                terms = zero | {"all_reduce_s": ring_all_reduce_s(4 * grads, replicas, bandwidth, latency)
                                + ring_all_reduce_s(4 * routed, experts, bandwidth, latency)}
            else:
                # FSDP2 shards the routed experts over the D / EP replicas that hold them (`train.fsdp`:
                # "edp", nothing to gather or reduce at D = EP); at EP = 1 that is all D replicas.
                terms = zero | {
                    "all_gather_s": sum(gathers[c] * (
                        ring_all_gather_s(numels[c][1] * self.element, replicas, bandwidth, latency)
                        + ring_all_gather_s(numels[c][3] * self.element, experts, bandwidth, latency))
                        for c in chunks),
                    "reduce_scatter_s": sum(ring_reduce_scatter_s(4 * numels[c][1], replicas, bandwidth, latency)
                                            + ring_reduce_scatter_s(4 * numels[c][3], experts, bandwidth, latency)
                                            for c in chunks),
                    "all_gathers": sum(gathers[c] for c in chunks)}
                if tied:  # MSAR's tied convolutions: all-reduced whole, as under replicate
                    terms["all_reduce_s"] = ring_all_reduce_s(4 * tied, replicas, bandwidth, latency)
            terms["embed_all_reduce_s"] = embed_s if rank in copies else 0.0
            terms["total_s"] = (terms["all_reduce_s"] + terms["all_gather_s"] + terms["reduce_scatter_s"]
                                + terms["embed_all_reduce_s"])
            per_rank.append(terms)
        worst = max(per_rank, key=lambda t: t["total_s"])
        return worst | tp_terms | {"total_s": worst["total_s"] + tp_terms["tp_all_reduce_s"]}

    def embed_all_reduce(self, candidate: Candidate, partition) -> float:
        """Seconds of the embedding group's all-reduce a step (`simulator.embedding_group`): on the
        network where some pair of first and last rank spans two nodes, else on the intra-node link."""
        request, cfg = self.request, self.model_for(candidate)
        if not tied_copy_ranks(cfg.tie_embeddings, partition):
            return 0.0
        across = crosses_nodes(partition, data_parallel=candidate.data_parallel,
                               tensor_parallel=candidate.tensor_parallel, gpus_per_node=request.gpus_per_node)
        gbps = request.inter_node_gbps if across else request.intra_node_gbps
        return embedding_group_s(cfg, partition, data_parallel=candidate.data_parallel,
                                 dp_shard=candidate.dp_shard, bytes_per_s=gbps * 1e9 / 8,
                                 latency_s=request.latency_us * 1e-6)

    def tp_grad_all_reduce(self, candidate: Candidate, partition) -> dict:
        """Under SP, the once-a-step sum over the T tp ranks of the gradients of the parameters replicated
        over tp (each rank computed them on its own sequence shard): a ring all-reduce of their fp32
        gradients on the intra-node link, for the rank that holds the most of them (the embedding's or
        the head's). Without SP every tp rank computed them on the same tokens: nothing to sum."""
        t = candidate.tensor_parallel
        if t == 1 or not candidate.sp:
            return {"tp_all_reduce_s": 0.0, "tp_replicated_params": 0}
        key = ("grads", candidate.n_stages, candidate.n_virtual, candidate.block_size, t, partition.placement)
        if key not in self._tp:
            self._tp[key] = self._tp_grad_all_reduce(candidate, partition)
        return self._tp[key]

    def _tp_grad_all_reduce(self, candidate: Candidate, partition) -> dict:
        t, cfg = candidate.tensor_parallel, self.model_for(candidate)
        split = layer_matmul_elements(cfg, t)
        replicated = max(sum(math.prod(s) for s in rank_parameter_shapes(cfg, partition, r, t))
                         - split * sum(partition.layers_per_chunk[c] for c in partition.chunks_of(r))
                         for r in range(candidate.n_stages))
        seconds = ring_all_reduce_s(4 * replicated, t, self.request.intra_node_gbps * 1e9 / 8,
                                    self.request.intra_node_latency_us * 1e-6)
        return {"tp_all_reduce_s": seconds, "tp_replicated_params": replicated}



class _OneChunk:
    """A partition's view of one chunk as if it were rank 0's only one (`rank_parameter_shapes` per chunk)."""

    def __init__(self, partition, chunk_index: int) -> None:
        self.n_chunks, self.layers_per_chunk, self._chunk = partition.n_chunks, partition.layers_per_chunk, chunk_index
        self.layer_range = partition.layer_range

    def chunks_of(self, _pp_rank: int) -> list[int]:
        return [self._chunk]


def fsdp_gathers(schedule, candidate: Candidate) -> list[int] | None:
    """All-gathers per chunk in one step under fsdp (`train.fsdp`): every compute action unshards its
    chunk if it is sharded; the step starts sharded; reshard always reshards after each F."""
    if candidate.dp_shard != "fsdp" or candidate.data_parallel == 1:
        return None
    counts = [0] * (schedule.n_stages * schedule.n_virtual)
    for actions in schedule.rank_actions:
        gathered: set[int] = set()
        for action in actions:
            c = action.chunk_index
            if c not in gathered:
                counts[c] += 1
                gathered.add(c)
            if candidate.reshard_after_forward == "always" and action.kind.value == "F":
                gathered.discard(c)
    return counts

