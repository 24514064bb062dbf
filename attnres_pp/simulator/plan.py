"""`attnres-pp simulate plan`: the fastest training configuration that fits, for a model and a cluster.

Searched: P (dividing the GPUs; D = GPUs / P), V, m (whole sequences per microbatch), the schedule
(gpipe, 1f1b and zb_h1 at V = 1, the interleaved ones, zbv and dualpipev; with it the placement: loop,
or V-shape for zbv and dualpipev), the block size (where the variant has one), the cross-stage cache
(on, or off: train's `--cache off`, the naive payloads; searched where the model has depth attention
and more than one chunk), dp_shard (replicate | fsdp, with fsdp's reshard after forward never | always)
and activation checkpointing (none | full | selective). Two stages keep it fast:
  1. every candidate is priced in closed form: the slowest rank's compute per microbatch (the
     `simulate project` chunk model, backward 2x forward, + one forward under full AC, + the
     memory-bound part under selective AC) times m over (1 - docs/spec.md section 5's closed-form bubble),
     plus one microbatch's hops there and back (the payload planner's tensors for the cache mode), plus
     the data-parallel collectives (`dp_collectives`); memory as the exact parameter/gradient/AdamW
     bytes + a closed-form count of in-flight chunk-microbatches;
  2. the fastest candidates that pass stage 1 with slack get the exact memory walk
     (`simulator.memory`) and the event-engine simulation of their schedule with per-hop links
     (NVLink inside a node, the network between nodes: global rank = dp_rank x P + pp_rank, G per
     node); rows are those that fit, ranked by the simulated step time.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass

from attnres_pp.comm.partition import make_partition
from attnres_pp.comm.plan import plan_for_model, shard_tokens
from attnres_pp.model.config import ModelConfig
from attnres_pp.schedule.schedules import build_schedule, schedule_placement
from attnres_pp.simulator.costs import (
    CostModel,
    ring_all_gather_s,
    ring_all_reduce_s,
    ring_reduce_scatter_s,
    sublayer_forward_flops,
)
from attnres_pp.simulator.engine import simulate
from attnres_pp.simulator.memory import (
    ATTENTION_KERNELS,
    DTYPE_BYTES,
    MemorySetup,
    activation_bytes,
    predict_ranks,
    rank_parameter_shapes,
    shard_numel,
    state_bytes,
    tied_parameter_shapes,
)
from attnres_pp.simulator.metrics import closed_form_bubble_fraction
from attnres_pp.simulator.project import Cluster, chunk_seconds
from attnres_pp.simulator.tensor_parallel import (
    INTRA_NODE_LATENCY_US,
    TensorParallel,
    check_tensor_parallel,
    chunk_tp_seconds,
)

GIB = 1024 ** 3
SPLIT = frozenset({"zb_h1", "interleaved_zb", "zbv", "dualpipev"})


@dataclass(frozen=True, kw_only=True)
class PlanRequest:
    """The model, the batch and the cluster to plan for (GB/s = 1e9 bytes/s; Gb/s = 1e9 bits/s)."""

    model: ModelConfig
    global_batch: int
    gpus: int
    gpu_memory_gib: float
    gpus_per_node: int = 8
    intra_node_gbps: float = 3600.0
    inter_node_gbps: float = 400.0
    latency_us: float = 10.0
    tflops: float = 400.0
    peak_tflops: float = 989.0
    hbm_tbs: float = 3.0
    dtype: str = "bf16"
    block_size: int | None = None
    top: int = 5
    attention_kernel: str = "flash"  # GPUs run the flash / efficient kernels (memory.attention_correction)
    # T to search (docs/spec.md section 10; the CLI searches TP_SIZES unless --tensor-parallel fixes one);
    # sizes the model or the node does not allow are skipped, unless the one size is fixed: then refused.
    tensor_parallel_sizes: tuple[int, ...] = (1,)
    sequence_parallel: bool = True  # under T > 1 (train's tp is not built: derived terms)
    intra_node_latency_us: float = INTRA_NODE_LATENCY_US  # per ring step of a tp collective

    def legal_tp_sizes(self) -> list[int]:
        """The T of `tensor_parallel_sizes` this model and cluster allow; ValueError naming the rule when
        one size is fixed and breaks it."""
        legal = []
        for t in self.tensor_parallel_sizes:
            tp = TensorParallel(t, self.sequence_parallel)
            try:
                check_tensor_parallel(self.model, tp, gpus_per_node=self.gpus_per_node)
                if self.gpus % t:
                    raise ValueError(f"--tensor-parallel {t} does not divide --gpus {self.gpus}: T x P x D "
                                     "must equal the GPUs")
            except ValueError:
                if len(self.tensor_parallel_sizes) == 1:
                    raise
                continue
            legal.append(t)
        return legal

    def __post_init__(self) -> None:
        for name in ("global_batch", "gpus", "gpus_per_node", "top"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')} {value!r} is invalid: give an integer >= 1")
        if not self.tensor_parallel_sizes or any(isinstance(t, bool) or not isinstance(t, int) or t < 1
                                                 for t in self.tensor_parallel_sizes):
            raise ValueError(f"--tensor-parallel {self.tensor_parallel_sizes!r} is invalid: give integers >= 1")
        if not math.isfinite(self.intra_node_latency_us) or self.intra_node_latency_us < 0:
            raise ValueError(f"intra_node_latency_us {self.intra_node_latency_us!r} is invalid: give a finite "
                             "number >= 0")
        for name in ("gpu_memory_gib", "intra_node_gbps", "inter_node_gbps", "tflops", "peak_tflops", "hbm_tbs"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"--{name.replace('_', '-')} {value!r} is invalid: give a finite number > 0")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"--dtype {self.dtype!r} is invalid: choose one of {', '.join(DTYPE_BYTES)}")
        if self.attention_kernel not in ATTENTION_KERNELS:
            raise ValueError(f"--attention-kernel {self.attention_kernel!r} is invalid: choose one of "
                             f"{', '.join(ATTENTION_KERNELS)}")


@dataclass(frozen=True)
class Candidate:
    schedule: str
    n_stages: int
    n_virtual: int
    n_microbatches: int
    data_parallel: int
    block_size: int
    dp_shard: str
    activation_checkpoint: str
    cache: bool = True
    reshard_after_forward: str = "never"  # fsdp only: train's --fsdp-reshard-after-forward
    tensor_parallel: int = 1  # T (docs/spec.md section 10); the GPUs are T x P x D
    sequence_parallel: bool = False  # in effect only when T > 1

    @property
    def tp(self) -> TensorParallel:
        return TensorParallel(self.tensor_parallel, self.sequence_parallel)

    @property
    def sp(self) -> bool:
        return self.tp.sp


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def block_sizes(request: PlanRequest) -> list[int]:
    cfg = request.model
    if not cfg.uses_depth_attention:
        return [cfg.block_size]
    if request.block_size is not None or cfg.blocks:  # --blocks N places the blocks alone
        return [request.block_size if request.block_size is not None else cfg.block_size]
    # Block AttnRes with 4, 8 or 16 blocks (the papers' range; more blocks = more to send and cache).
    sizes = {-(-cfg.n_sublayers // n) for n in (4, 8, 16) if n <= cfg.n_sublayers}
    return sorted(sizes)


def schedules_for(n_stages: int, n_virtual: int) -> list[str]:
    if n_stages == 1:
        return ["1f1b"] if n_virtual == 1 else []
    if n_virtual == 1:
        # GPipe only at V = 1: interleaved it has interleaved 1F1B's bubble and holds all m microbatches.
        return ["gpipe", "1f1b", "zb_h1"]
    return ["interleaved_1f1b", "interleaved_zb"] + (["zbv", "dualpipev"] if n_virtual == 2 else [])


def candidates(request: PlanRequest) -> list[Candidate]:
    cfg, found = request.model, []
    layouts = [(t, p) for t in request.legal_tp_sizes() for p in _divisors(request.gpus // t)]
    for t, n_stages in layouts:
        replicas = request.gpus // (t * n_stages)
        sp = request.sequence_parallel and t > 1
        if n_stages > cfg.n_layers or request.global_batch % replicas:
            continue
        per_replica = request.global_batch // replicas
        shards = [("replicate", "never")] + ([("fsdp", "never"), ("fsdp", "always")] if replicas > 1 else [])
        for n_virtual in (1, 2, 3, 4, 6, 8):
            if n_stages * n_virtual > cfg.n_layers:
                continue
            # With one chunk nothing is sent or cached; the standard residual has no cache to turn off.
            caches = (True, False) if cfg.uses_depth_attention and n_stages * n_virtual > 1 else (True,)
            for schedule in schedules_for(n_stages, n_virtual):
                for m in _divisors(per_replica):
                    if n_stages > 1 and m < n_stages or (schedule == "zbv" and m < 2 * n_stages - 1) or (
                            schedule == "dualpipev" and m < 2 * n_stages):
                        continue
                    for size, cache, (shard, reshard), ac in itertools.product(
                            block_sizes(request), caches, shards, ("none", "selective", "full")):
                        found.append(Candidate(schedule, n_stages, n_virtual, m, replicas, size, shard, ac,
                                               cache, reshard, t, sp))
    return found


class Planner:
    """Prices candidates; caches what several candidates share (chunk times, state bytes, activations)."""

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

    def layout(self, partition) -> tuple[list[int], list[list[int]]]:
        """(rank of each chunk, chunks of each rank) of a cached partition, computed once."""
        key = id(partition)
        if key not in self._layout:
            self._layout[key] = ([partition.rank_of(c) for c in range(partition.n_chunks)],
                                 [partition.chunks_of(r) for r in range(partition.n_stages)], partition)
        return self._layout[key][:2]

    def model_for(self, candidate: Candidate) -> ModelConfig:
        return dataclasses.replace(self.request.model, block_size=candidate.block_size)

    def tokens(self, candidate: Candidate) -> int:
        per_microbatch = self.request.global_batch // (candidate.data_parallel * candidate.n_microbatches)
        return per_microbatch * self.request.model.seq_len

    def chunk_costs(self, candidate: Candidate):
        """(partition, forward seconds per chunk, the memory-bound part of each) for the candidate's split."""
        key = (candidate.n_stages, candidate.n_virtual, candidate.block_size, self.tokens(candidate),
               candidate.tensor_parallel, candidate.sp, schedule_placement(candidate.schedule))
        if key not in self._chunks:
            cfg = self.model_for(candidate)
            partition = make_partition(cfg.n_layers, candidate.n_stages, candidate.n_virtual, placement=key[-1])
            tokens = key[3]
            tp = {"tensor_parallel": candidate.tensor_parallel, "sequence_parallel": candidate.sp}
            forward = [chunk_seconds(cfg, partition, c, tokens=tokens, dtype_bytes=self.element, cluster=self.cluster,
                                     **tp) for c in range(partition.n_chunks)]
            plain = dataclasses.replace(cfg, residual="standard")
            matmul = [chunk_seconds(plain, partition, c, tokens=tokens, dtype_bytes=self.element,
                                    cluster=self.cluster, **tp) for c in range(partition.n_chunks)]
            bound = [max(0.0, f - mm) for f, mm in zip(forward, matmul, strict=True)]
            self._chunks[key] = (partition, forward, bound)
        return self._chunks[key]

    def tp_seconds(self, candidate: Candidate, partition) -> list[float]:
        """Seconds of each chunk's tp collectives (and MSAR halos) per microbatch in one direction, on
        the intra-node link (`tensor_parallel.chunk_tp_seconds`); the backward has the same again, and
        full AC's recomputation repeats the forward's."""
        if candidate.tensor_parallel == 1:
            return [0.0] * partition.n_chunks
        key = ("seconds", candidate.n_stages, candidate.n_virtual, candidate.block_size, self.tokens(candidate),
               candidate.tensor_parallel, candidate.sp, partition.placement)
        if key in self._tp:
            return self._tp[key]
        request, cfg = self.request, self.model_for(candidate)
        self._tp[key] = [chunk_tp_seconds(cfg, partition.sublayer_range(c), tokens=self.tokens(candidate),
                                 element_bytes=self.element, tp=candidate.tp,
                                 bytes_per_s=request.intra_node_gbps * 1e9 / 8,
                                 latency_s=request.intra_node_latency_us * 1e-6) for c in range(partition.n_chunks)]
        return self._tp[key]

    def chunk_times(self, candidate: Candidate) -> tuple[list[float], list[float]]:
        """(forward, backward) seconds per chunk and microbatch, tp collectives included."""
        key = ("times", candidate.n_stages, candidate.n_virtual, candidate.block_size, self.tokens(candidate),
               candidate.tensor_parallel, candidate.sp, schedule_placement(candidate.schedule),
               candidate.activation_checkpoint)
        if key not in self._tp:
            partition, forward, bound = self.chunk_costs(candidate)
            tp = self.tp_seconds(candidate, partition)
            recompute = 2 if candidate.activation_checkpoint == "full" else 1
            self._tp[key] = ([f + x for f, x in zip(forward, tp, strict=True)],
                             [self.backward_factor(candidate, f, b) + recompute * x
                              for f, b, x in zip(forward, bound, tp, strict=True)])
        return self._tp[key]

    def backward_factor(self, candidate: Candidate, forward: float, bound: float) -> float:
        """Backward seconds of a chunk: 2 F, + F recomputed (full AC), + its memory-bound part (selective)."""
        extra = {"none": 0.0, "full": forward, "selective": bound}[candidate.activation_checkpoint]
        return 2 * forward + extra

    def fixed_bytes(self, candidate: Candidate, partition) -> list[int]:
        key = (candidate.n_stages, candidate.n_virtual, candidate.block_size, candidate.data_parallel,
               candidate.dp_shard, partition.placement, candidate.tensor_parallel)
        if key not in self._state:
            cfg, result = self.model_for(candidate), []
            for pp_rank in range(candidate.n_stages):
                shapes = rank_parameter_shapes(cfg, partition, pp_rank, candidate.tensor_parallel)
                terms = state_bytes(shapes, data_parallel=candidate.data_parallel, dp_shard=candidate.dp_shard,
                                    whole=tied_parameter_shapes(cfg))
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
               candidate.tensor_parallel, candidate.sp)
        if key not in self._saved:
            cfg, tokens = self.model_for(candidate), self.tokens(candidate)
            self._saved[key] = [activation_bytes(cfg, partition, c, tokens=tokens, dtype=self.request.dtype,
                                                 activation_checkpoint=candidate.activation_checkpoint,
                                                 weight_copies=copies,
                                                 attention_kernel=self.request.attention_kernel,
                                                 tensor_parallel=candidate.tensor_parallel,
                                                 sequence_parallel=candidate.sp)
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

    def chunk_numels(self, candidate: Candidate, partition) -> list[tuple[int, int]]:
        """Per chunk (elements, FSDP2's padded elements over D): what its units all-gather and reduce-scatter.
        MSAR's tied stream convolutions are left out: they stay whole on every rank (`train.fsdp`)."""
        key = (candidate.n_stages, candidate.n_virtual, candidate.block_size, partition.placement,
               candidate.data_parallel, candidate.tensor_parallel)
        if key not in self._numels:
            cfg, result = self.model_for(candidate), []
            tied = (cfg.n_blocks + 1) * len(cfg.stream_kernels) if cfg.residual == "msar" else 0
            for c in range(partition.n_chunks):
                shapes = rank_parameter_shapes(cfg, _OneChunk(partition, c), 0, candidate.tensor_parallel)
                shapes = shapes[:len(shapes) - tied]
                result.append((sum(math.prod(s) for s in shapes),
                               sum(shard_numel(s, candidate.data_parallel, "fsdp") for s in shapes)
                               * candidate.data_parallel))
            self._numels[key] = result
        return self._numels[key]

    def dp_collectives(self, candidate: Candidate, partition, gathers: list[int] | None = None) -> dict:
        """Seconds of the data-parallel collectives of the rank whose total is largest, by kind.

        replicate: one ring all-reduce of the rank's fp32 gradients (`train.grad_sync`). fsdp: per
        chunk, an all-gather of its parameters in the compute dtype (padded to D shards) each time an
        action finds them resharded (`gathers[c]`: once a step under reshard never; under always
        after every F, so about once per forward and once per backward; without `gathers` m + 1),
        and one reduce-scatter of its fp32 gradients. Not overlapped with compute."""
        zero = {"all_reduce_s": 0.0, "all_gather_s": 0.0, "reduce_scatter_s": 0.0, "all_gathers": 0}
        replicas = candidate.data_parallel
        tp_terms = self.tp_grad_all_reduce(candidate, partition)
        if replicas == 1:
            return zero | tp_terms | {"total_s": tp_terms["tp_all_reduce_s"]}
        request = self.request
        same_node = candidate.n_stages * replicas * candidate.tensor_parallel <= request.gpus_per_node
        bandwidth = (request.intra_node_gbps if same_node else request.inter_node_gbps) * 1e9 / 8
        latency = request.latency_us * 1e-6
        numels = self.chunk_numels(candidate, partition)
        if gathers is None:
            gathers = [1 if candidate.reshard_after_forward == "never" else candidate.n_microbatches + 1] * len(numels)
        cfg = self.model_for(candidate)
        tied = (cfg.n_blocks + 1) * sum(cfg.stream_kernels) * cfg.d_model if cfg.residual == "msar" else 0
        per_rank = []
        for rank in range(candidate.n_stages):
            chunks = partition.chunks_of(rank)
            if candidate.dp_shard == "replicate":
                grads = sum(numels[c][0] for c in chunks) + tied
                terms = zero | {"all_reduce_s": ring_all_reduce_s(4 * grads, replicas, bandwidth, latency)}
            else:
                terms = zero | {
                    "all_gather_s": sum(gathers[c] * ring_all_gather_s(numels[c][1] * self.element, replicas,
                                                                       bandwidth, latency) for c in chunks),
                    "reduce_scatter_s": sum(ring_reduce_scatter_s(4 * numels[c][1], replicas, bandwidth, latency)
                                            for c in chunks),
                    "all_gathers": sum(gathers[c] for c in chunks)}
                if tied:  # MSAR's tied convolutions: all-reduced whole, as under replicate
                    terms["all_reduce_s"] = ring_all_reduce_s(4 * tied, replicas, bandwidth, latency)
            terms["total_s"] = terms["all_reduce_s"] + terms["all_gather_s"] + terms["reduce_scatter_s"]
            per_rank.append(terms)
        worst = max(per_rank, key=lambda t: t["total_s"])
        return worst | tp_terms | {"total_s": worst["total_s"] + tp_terms["tp_all_reduce_s"]}

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
        split = (3 * cfg.d_model ** 2 + cfg.source_width * cfg.d_model + cfg.ff_dim * cfg.d_model
                 + cfg.source_width * cfg.ff_dim) // t
        replicated = max(sum(math.prod(s) for s in rank_parameter_shapes(cfg, partition, r, t))
                         - split * sum(partition.layers_per_chunk[c] for c in partition.chunks_of(r))
                         for r in range(candidate.n_stages))
        seconds = ring_all_reduce_s(4 * replicated, t, self.request.intra_node_gbps * 1e9 / 8,
                                    self.request.intra_node_latency_us * 1e-6)
        return {"tp_all_reduce_s": seconds, "tp_replicated_params": replicated}

    def estimate(self, candidate: Candidate) -> tuple[float, float]:
        """(closed-form step seconds, estimated peak bytes of the fullest rank). Under fsdp the whole
        gathered copy is counted whatever the reshard (an upper bound for `always`, which the walk prices)."""
        partition = self.chunk_costs(candidate)[0]
        forward, backward = self.chunk_times(candidate)
        owners, rank_chunks = self.layout(partition)
        per_rank = [0.0] * candidate.n_stages
        for c, (f, b) in enumerate(zip(forward, backward, strict=True)):
            per_rank[owners[c]] += f + b
        bubble = closed_form_bubble_fraction(candidate.n_stages, candidate.n_virtual, candidate.n_microbatches,
                                             candidate.schedule)
        # One microbatch's way through every hop and back is on the critical path (fill and drain).
        _wire, hops, _tensor = self.hop_seconds(candidate, partition, self.payloads(candidate, partition))
        step = (max(per_rank) * candidate.n_microbatches / (1 - bubble) + 2 * sum(hops)
                + self.dp_collectives(candidate, partition)["total_s"])
        cfg = self.model_for(candidate)
        tokens = self.tokens(candidate)
        saved = self.saved(candidate, partition)
        # Rank 0 holds the most microbatches in flight: P (1F1B-like), about (V + 1) P chunk-microbatches
        # interleaved, 2P chunk passes under ZB-V; a split schedule's W can keep up to P more; GPipe all m.
        chunks0 = rank_chunks[0]
        in_flight = min(candidate.n_microbatches * len(chunks0),
                        candidate.n_stages * (len(chunks0) + 1 if len(chunks0) > 1 else 1))
        if candidate.schedule == "gpipe":
            in_flight = candidate.n_microbatches * len(chunks0)
        # One recomputation at a time; under a split schedule the W store that I leaves stays until
        # W, for up to P chunk-microbatches.
        recomputed = max(s.transient + (s.input_transient if candidate.schedule in SPLIT else 0) for s in saved)
        kept_until_w = candidate.n_stages * max(s.stored for s in saved) if candidate.schedule in SPLIT else 0
        tensor = shard_tokens(tokens, candidate.tensor_parallel, candidate.sp) * cfg.source_width * self.element
        cache = 2 * cfg.n_blocks * tensor * min(candidate.n_microbatches, candidate.n_stages) \
            if len(chunks0) > 1 and candidate.cache else 0
        # The last chunk (the head's logits) runs its backward right after its forward: one in flight.
        last = partition.n_chunks - 1
        held = max(in_flight * max((saved[c].saved for c in chunks if c != last), default=0)
                   + (saved[last].saved if last in chunks else 0) for chunks in rank_chunks)
        peak = max(self.fixed_bytes(candidate, partition)) + held + recomputed + kept_until_w + cache
        return step, peak

    def _walk(self, candidate: Candidate):
        """Everything a row is made of: (row, the fullest rank's RankMemory, its pp rank, the simulation,
        the cost model, the schedule, the data-parallel collectives)."""
        request = self.request
        partition = self.chunk_costs(candidate)[0]
        forward, backward = self.chunk_times(candidate)
        cfg, tokens = self.model_for(candidate), self.tokens(candidate)
        schedule = build_schedule(candidate.schedule, candidate.n_stages, candidate.n_virtual, candidate.n_microbatches)
        plan = self.payloads(candidate, partition)
        setup = MemorySetup(schedule=candidate.schedule, n_stages=candidate.n_stages, n_virtual=candidate.n_virtual,
                            n_microbatches=candidate.n_microbatches, tokens=tokens, dtype=request.dtype,
                            cache=candidate.cache, data_parallel=candidate.data_parallel,
                            dp_shard=candidate.dp_shard, activation_checkpoint=candidate.activation_checkpoint,
                            attention_kernel=request.attention_kernel, tensor_parallel=candidate.tensor_parallel,
                            sequence_parallel=candidate.sp,
                            reshard_after_forward=candidate.reshard_after_forward if candidate.dp_shard == "fsdp"
                            else "never")
        # Reshard after forward always: the walk holds a chunk's gathered copy only while it is unsharded.
        ranks = predict_ranks(cfg, setup, schedule, partition, plan, dp_ranks=range(1))
        wire, hops, tensor_bytes = self.hop_seconds(candidate, partition, plan)
        costs = CostModel(forward_s=tuple(forward), backward_s=tuple(backward), hop_fwd_s=tuple(hops),
                          hop_bwd_s=tuple(hops), wire_fwd_s=tuple(wire), wire_bwd_s=tuple(wire), label="plan")
        result = simulate(schedule, costs)
        collectives = self.dp_collectives(candidate, partition, fsdp_gathers(schedule, candidate))
        step = result.makespan + collectives["total_s"]
        flops = 3 * request.global_batch * sum(sublayer_forward_flops(cfg, s, cfg.seq_len)
                                               for s in range(cfg.n_sublayers))
        flops += 3 * 2.0 * request.global_batch * cfg.seq_len * cfg.d_model * cfg.vocab_size
        fullest_rank = max(range(len(ranks)), key=lambda r: ranks[r].peak_bytes)
        fullest = ranks[fullest_rank]
        row = {
            "config": dataclasses.asdict(candidate) | {"placement": partition.placement,
                                                       "tokens_per_microbatch": tokens, "blocks": cfg.blocks},
            "step_time_s": step,
            "pipeline_s": result.makespan,
            "dp_collectives": collectives,
            "tokens_per_s_per_gpu": request.global_batch * cfg.seq_len / step / request.gpus,
            "mfu": flops / (step * request.gpus * request.peak_tflops * 1e12),
            "bubble_fraction": 1 - sum(result.compute_s) / (candidate.n_stages * result.makespan),
            "payload_mode": plan.mode,
            "bytes_per_hop": max(plan.fwd_hop_tensors, default=0) * tensor_bytes,  # per tp rank's pair
            "peak_memory_bytes": fullest.peak_bytes,
            "peak_memory_per_rank": [r.peak_bytes for r in ranks],
            "dominated_by": fullest.dominant,
            "peak_action": fullest.peak_action,
            "command": train_command(request, candidate),
        }
        return row, fullest, fullest_rank, result, costs, schedule, collectives

    def evaluate(self, candidate: Candidate) -> dict:
        """The exact memory walk and the simulated step of one candidate: a row of the plan."""
        return self._walk(candidate)[0]

    def explain(self, candidate: Candidate) -> dict:
        """The row of `candidate` and the terms of its estimate: `memory` (label, bytes) summing to
        peak_memory_bytes, `time` (label, seconds) summing to step_time_s.

        Time: the busiest rank's compute, the idle time the schedule adds with free hops (bubble), what
        the hops add over that (a second simulation with free hops), and the collectives. Memory: the
        fullest rank's fp32 state, fsdp's gathered parameters, the activation and cache peaks, less what
        those two peaks overcount by not falling on one moment (and the saved gathered parameters)."""
        row, fullest, pp_rank, result, costs, schedule, collectives = self._walk(candidate)
        free = dataclasses.replace(costs, hop_fwd_s=(0.0,) * len(costs.hop_fwd_s),
                                   hop_bwd_s=(0.0,) * len(costs.hop_bwd_s), wire_fwd_s=(), wire_bwd_s=())
        without_hops = simulate(schedule, free).makespan
        busiest = max(range(candidate.n_stages), key=lambda r: result.compute_s[r])
        compute = result.compute_s[busiest]
        partition = self.chunk_costs(candidate)[0]
        tp = self.tp_seconds(candidate, partition)
        recompute = 2 if candidate.activation_checkpoint == "full" else 1
        tp_s = candidate.n_microbatches * sum((1 + recompute) * tp[c] for c in partition.chunks_of(busiest))
        # The tp terms appear on rows with T > 1 only (at T = 1 they are zero).
        tp_terms = [(f"tp collectives (T={candidate.tensor_parallel}, SP {'on' if candidate.sp else 'off'}, "
                     "busiest rank)", tp_s)] if candidate.tensor_parallel > 1 else []
        time_terms = [("compute (busiest rank" + (", tp collectives apart)" if tp_terms else ")"), compute - tp_s),
                      *tp_terms,
                      ("bubble (its idle, free hops)", without_hops - compute),
                      ("pipeline hops", result.makespan - without_hops),
                      ("data-parallel all-reduce", collectives["all_reduce_s"]),
                      (f"data-parallel all-gather (x{collectives['all_gathers']})", collectives["all_gather_s"]),
                      ("data-parallel reduce-scatter", collectives["reduce_scatter_s"])]
        if tp_terms:
            time_terms.append(("tp all-reduce of replicated gradients (SP)", collectives["tp_all_reduce_s"]))
        terms = fullest.terms
        gathered = fullest.gathered_bytes  # fsdp: the whole copy (never), the chunks unsharded at the peak (always)
        memory_terms = [("parameters (fp32)", terms["param_bytes"]), ("gradients (fp32)", terms["grad_bytes"]),
                        ("optimizer state (AdamW)", terms["optimizer_bytes"]),
                        ("gathered parameters (fsdp)", gathered),
                        ("activation peak", terms["activation_peak_bytes"]), ("cache peak", terms["cache_peak_bytes"])]
        # The two peaks need not fall on one moment, and under fsdp the activation peak counts the
        # saved gathered parameters that the gathered term holds already.
        memory_terms.append(("counted twice (peaks apart, fsdp saved)",
                             fullest.peak_bytes - sum(v for _k, v in memory_terms)))
        return {"row": row, "pp_rank": pp_rank, "memory": memory_terms, "time": time_terms}


class _OneChunk:
    """A partition's view of one chunk as if it were rank 0's only one (`rank_parameter_shapes` per chunk)."""

    def __init__(self, partition, chunk_index: int) -> None:
        self.n_chunks, self.layers_per_chunk, self._chunk = partition.n_chunks, partition.layers_per_chunk, chunk_index

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


def train_command(request: PlanRequest, candidate: Candidate) -> str:
    """The `attnres-pp train` command line of a candidate (one optimiser step per --steps)."""
    cfg = request.model
    parts = ["attnres-pp train", f"--layers {cfg.n_layers}", f"--d-model {cfg.d_model}", f"--heads {cfg.n_heads}",
             f"--seq-len {cfg.seq_len}", f"--vocab-size {cfg.vocab_size}", f"--residual {cfg.residual}"]
    if cfg.uses_depth_attention:
        parts.append(f"--blocks {cfg.blocks}" if cfg.blocks else f"--block-size {candidate.block_size}")
        if cfg.key_norm_gain:
            parts.append("--key-norm-gain")
    if cfg.residual == "lr_attnres":
        parts += [f"--key-mode {cfg.key_mode}", f"--key-rank {cfg.key_rank}"]
    parts += [f"--batch-size {request.global_batch}", f"--microbatches {candidate.n_microbatches}",
              f"--stages {candidate.n_stages}", f"--virtual {candidate.n_virtual}",
              f"--data-parallel {candidate.data_parallel}", f"--schedule {candidate.schedule}",
              f"--cache {'on' if candidate.cache else 'off'}",
              f"--dtype {request.dtype}", "--device cuda", f"--dp-shard {candidate.dp_shard}",
              f"--activation-checkpoint {candidate.activation_checkpoint}"]
    if candidate.dp_shard == "fsdp" and candidate.reshard_after_forward != "never":
        parts.append(f"--fsdp-reshard-after-forward {candidate.reshard_after_forward}")
    if candidate.tensor_parallel > 1:  # train has no tp axis yet: the flags it will take (docs/spec.md section 10)
        parts.append(f"--tensor-parallel {candidate.tensor_parallel}"
                     + ("" if candidate.sp else " --no-sequence-parallel"))
    return " ".join(parts)


def _gib(n_bytes: float) -> str:
    gib = n_bytes / GIB
    return f"{gib:.1f}" if gib < 10 else f"{gib:.0f}"


class Infeasible(ValueError):
    """No configuration fits: the message says what is short."""


def plan(request: PlanRequest, *, evaluate_at_most: int = 32) -> list[dict]:
    """Rows that fit, fastest first (at most request.top); Infeasible if none does."""
    planner = Planner(request)
    budget = request.gpu_memory_gib * GIB
    priced = []
    for candidate in candidates(request):
        step, peak = planner.estimate(candidate)
        priced.append((step, peak, candidate))
    if not priced:
        raise Infeasible(f"no layout of {request.model.n_layers} layers and a batch of {request.global_batch} "
                         f"sequences over {request.gpus} GPUs: give a batch divisible by the replicas")
    # Stage 1 keeps the estimated fits (with slack: the estimate is rough), fastest first.
    hopeful = sorted((p for p in priced if p[1] <= 1.25 * budget), key=lambda p: p[0])
    evaluated: dict[int, dict] = {}  # id(candidate) -> its row
    for index, (_step, _peak, candidate) in enumerate(hopeful):
        # Enough rows after the first `evaluate_at_most`; fewer (the estimate was too kind): go on, to a cap.
        fits = sum(1 for row in evaluated.values() if row["peak_memory_bytes"] <= budget)
        if index >= evaluate_at_most and (fits >= request.top or index >= 8 * evaluate_at_most):
            break
        evaluated[id(candidate)] = planner.evaluate(candidate)
    leanest = sorted(priced, key=lambda p: p[1])[:16]
    if sum(1 for row in evaluated.values() if row["peak_memory_bytes"] <= budget) < request.top:
        # The estimate can be too strict as well as too kind: the candidates it finds leanest, walked
        # exactly, join the rows if they fit; if none does, the least of them says what is short.
        for _step, _peak, candidate in leanest:
            if id(candidate) not in evaluated:
                evaluated[id(candidate)] = planner.evaluate(candidate)
    rows = [row for row in evaluated.values() if row["peak_memory_bytes"] <= budget]
    if not rows:
        best = min((evaluated[id(p[2])] for p in leanest), key=lambda r: r["peak_memory_bytes"])
        c = best["config"]
        shard = "" if any(p[2].dp_shard == "fsdp" for p in priced) else " or enable fsdp (it needs D > 1)"
        raise Infeasible(
            f"needs {_gib(best['peak_memory_bytes'])} GiB per rank at best ({c['schedule']} "
            f"{'T=' + str(c['tensor_parallel']) + ' ' if c['tensor_parallel'] > 1 else ''}P={c['n_stages']} "
            f"V={c['n_virtual']} D={c['data_parallel']} {c['dp_shard']}, AC {c['activation_checkpoint']}, "
            f"{c['tokens_per_microbatch']} tokens per microbatch), over the {request.gpu_memory_gib:g} GiB given: "
            f"add GPUs{shard}")
    rows.sort(key=lambda r: r["step_time_s"])
    return rows[:request.top]
