"""Tensor and sequence parallelism in the simulator (docs/spec.md section 10). Pure standard library.
The per-layer collective bytes (`layer_collectives`) equal what the runtime's tp ranks send, counted
(`pipeline/tp_bytes.py`; Block AttnRes, `tests/distributed/test_tensor_parallel_gloo.py`); their time on the
intra-node link is derived from the link model. Measured CPU runs (`attnres-lab fidelity --tp`) need one
more term, the host's cost per split layer (`TensorParallelCosts`, probed), which on gloo ranks is
most of a tp step.

The layout is Megatron's: a (dp, pp, tp) mesh with tp innermost, global rank (dp x P + pp) x T + t, so a
tp group sits on one node. Each transformer layer is split over T ranks: q, k, v and the MLP's first
projection column-parallel (1/T of the heads or hidden units each), the attention output and the MLP's
second projection row-parallel. What this module prices per layer and microbatch, on the intra-node link:

- without sequence parallelism (SP): two all-reduces of the layer's activation [tokens, d] in the
  forward (after each row-parallel projection) and two in the backward (before each column-parallel one);
- with SP: an all-gather before each column-parallel projection and a reduce-scatter after each
  row-parallel one, two of each in the forward, the same in the backward; each of the full [tokens, d]
  buffer, each rank sending (T - 1) / T of it (`collectives.ring_all_gather_s`, `ring_reduce_scatter_s`);
- MSAR under SP: each source's causal convolutions need the (kappa_max - 1) tokens before the shard from
  the previous tp rank (a halo per source read, and its gradient back);
- once a step, the gradients of the parameters replicated over tp (norm gains, depth-attention
  pseudo-queries, LR key projections, MSAR gates and convolutions, embedding, positions and head) are
  summed over the T ranks under SP, where each rank computes them on its own shard (an all-reduce in
  fp32); without SP every tp rank computes them on the same tokens and they agree, so none is needed.

The projected keys' r columns (r << d) of the row-parallel outputs are left out of the collectives.
"""

from __future__ import annotations

from dataclasses import dataclass

from attnres_pp.model.config import ModelConfig, block_of, has_partial_before
from attnres_pp.simulator.collectives import ring_all_gather_s, ring_all_reduce_s, ring_reduce_scatter_s

TP_SIZES = (1, 2, 4, 8)  # what `simulate plan` searches, within a node
# NVLink 4 (H100 / H200 SXM): 18 links x 25 GB/s per direction = 450 GB/s per GPU per direction
# (NVIDIA H100 Tensor Core GPU datasheet: "NVLink: 900GB/s", both directions), i.e. 3600 Gb/s.
INTRA_NODE_GBPS = 3600.0
INTRA_NODE_LATENCY_US = 2.0  # one ring step inside a node (NCCL over NVLink: a few microseconds)


@dataclass(frozen=True)
class TensorParallel:
    """T tensor-parallel ranks per chunk; `sequence_parallel` None = on when T > 1."""

    size: int = 1
    sequence_parallel: bool | None = None

    def __post_init__(self) -> None:
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"--tensor-parallel {self.size!r} is invalid: expected an integer > 0")

    @property
    def sp(self) -> bool:
        """Sequence parallelism in effect (meaningless, and False, at T = 1)."""
        return self.size > 1 and (self.sequence_parallel if self.sequence_parallel is not None else True)


def check_tensor_parallel(cfg: ModelConfig, tp: TensorParallel, *, gpus_per_node: int | None = None,
                          tokens: int | None = None, ranks: int | None = None, n_stages: int = 1,
                          data_parallel: int = 1) -> None:
    """ValueError naming the first rule `tp` breaks for this model and cluster (docs/spec.md section 10)."""
    t = tp.size
    if t == 1:
        if ranks is not None and n_stages * data_parallel != ranks:
            raise ValueError(f"T x P x D = 1 x {n_stages} x {data_parallel} = {n_stages * data_parallel} "
                             f"is not the {ranks} ranks given: the mesh (dp, pp, tp) must use every rank")
        return
    cfg.check_tensor_split(t, sequence_parallel=tp.sp)
    if tp.sp and tokens is not None and tokens % t:
        raise ValueError(f"--tensor-parallel {t} does not divide the {tokens} tokens per microbatch: "
                         "sequence parallelism gives each tp rank 1/T of them")
    if gpus_per_node is not None and t > gpus_per_node:
        raise ValueError(f"--tensor-parallel {t} is larger than a node's {gpus_per_node} GPUs "
                         "(--gpus-per-node): a tp group must sit on one node")
    if gpus_per_node is not None and gpus_per_node % t:
        raise ValueError(f"--tensor-parallel {t} does not divide a node's {gpus_per_node} GPUs "
                         "(--gpus-per-node): tp groups must tile the nodes")
    if ranks is not None and t * n_stages * data_parallel != ranks:
        raise ValueError(f"T x P x D = {t} x {n_stages} x {data_parallel} = {t * n_stages * data_parallel} "
                         f"is not the {ranks} ranks given: the mesh (dp, pp, tp) must use every rank")


def layer_collectives(tokens: int, d_model: int, element_bytes: int, tp: TensorParallel) -> list[dict]:
    """One transformer layer's tp collectives in one direction (the forward; the backward has the same),
    for a microbatch of `tokens` tokens: each {kind, count, buffer_bytes (the whole [tokens, d]),
    sent_bytes_per_rank (per collective, ring)}. None at T = 1."""
    t = tp.size
    if t == 1:
        return []
    buffer = tokens * d_model * element_bytes
    if tp.sp:
        share = (t - 1) * buffer // t
        return [{"kind": "all_gather", "count": 2, "buffer_bytes": buffer, "sent_bytes_per_rank": share},
                {"kind": "reduce_scatter", "count": 2, "buffer_bytes": buffer, "sent_bytes_per_rank": share}]
    return [{"kind": "all_reduce", "count": 2, "buffer_bytes": buffer,
             "sent_bytes_per_rank": 2 * (t - 1) * buffer // t}]


RING_PRICES = {"all_gather": ring_all_gather_s, "reduce_scatter": ring_reduce_scatter_s,
               "all_reduce": ring_all_reduce_s}


def layer_collective_s(tokens: int, d_model: int, element_bytes: int, tp: TensorParallel, *, bytes_per_s: float,
                       latency_s: float, links: dict | None = None) -> float:
    """Seconds of one layer's tp collectives in one direction (ring algorithms, not overlapped), on
    one link (`latency_s` per ring step, `bytes_per_s`) or, where `links` names a kind, on that
    kind's own {"latency_s", "bytes_per_s"} (a backend whose collectives run at different rates)."""
    seconds = 0.0
    for c in layer_collectives(tokens, d_model, element_bytes, tp):
        link = (links or {}).get(c["kind"], {"latency_s": latency_s, "bytes_per_s": bytes_per_s})
        seconds += c["count"] * RING_PRICES[c["kind"]](c["buffer_bytes"], tp.size, link["bytes_per_s"],
                                                       link["latency_s"])
    return seconds


def halo_bytes(cfg: ModelConfig, sublayers: range, *, n_sequences: int, element_bytes: int,
               tp: TensorParallel) -> int:
    """MSAR under SP: bytes a tp rank receives from the previous one for `sublayers`' reads, one
    direction: (kappa_max - 1) tokens of each source read, per sequence (0 otherwise)."""
    if cfg.residual != "msar" or not tp.sp:
        return 0
    ends, halo = cfg.block_ends, max(cfg.stream_kernels) - 1
    sources = sum(block_of(s, ends) + (1 if has_partial_before(s, ends) else 0) for s in sublayers)
    return sources * halo * n_sequences * cfg.d_model * element_bytes


def chunk_tp_seconds(cfg: ModelConfig, sublayers: range, *, tokens: int, element_bytes: int, tp: TensorParallel,
                     bytes_per_s: float, latency_s: float, links: dict | None = None) -> float:
    """Seconds of a chunk's tp traffic in one direction, one microbatch: its layers' collectives
    (`layer_collective_s`) and, under MSAR with SP, one halo message per sublayer (latency + bytes /
    bandwidth)."""
    if tp.size == 1:
        return 0.0
    layers = len(sublayers) // 2
    seconds = layers * layer_collective_s(tokens, cfg.d_model, element_bytes, tp, bytes_per_s=bytes_per_s,
                                          latency_s=latency_s, links=links)
    halo = halo_bytes(cfg, sublayers, n_sequences=max(1, tokens // cfg.seq_len), element_bytes=element_bytes, tp=tp)
    if halo:
        seconds += len(sublayers) * latency_s + halo / bytes_per_s
    return seconds


def layer_share(tp: TensorParallel) -> float:
    """The share of a transformer layer's work (its matmuls and attention) one tp rank does: 1/T (each
    rank holds 1/T of the heads and of the MLP's hidden units)."""
    return 1.0 / tp.size


def token_share(tp: TensorParallel) -> float:
    """The share of per-token work outside the layers' split matrices (depth reads, embedding, head,
    the residual's adds) one tp rank does: 1/T of the tokens under sequence parallelism, all of
    them without it (every tp rank then computes the same values)."""
    return 1.0 / tp.size if tp.sp else 1.0


@dataclass(frozen=True, kw_only=True)
class TensorParallelCosts:
    """What a probe of one machine's tp group measured (`attnres_lab.tp_probe`), for pricing its runs:
    `links`, each collective kind's ring link {kind: {"latency_s" per ring step, "bytes_per_s"}}
    (gloo's reduce-scatter, for one, runs at another rate than its all-gather), and `layer_host_s`,
    the host's own cost of one tp-split layer beyond its share of the layer's work and its
    collectives (DTensor's dispatch: sharding propagation and redistribution bookkeeping per op),
    per microbatch and direction, for the plan with and without sequence parallelism:
    {"sp"|"no_sp": {"fwd"|"bwd": seconds}}."""

    links: dict
    layer_host_s: dict

    def host_s(self, tp: TensorParallel, direction: str) -> float:
        return self.layer_host_s["sp" if tp.sp else "no_sp"][direction]

    def to_dict(self) -> dict:
        return {"links": self.links, "layer_host_s": self.layer_host_s}

    @classmethod
    def from_dict(cls, values: dict) -> TensorParallelCosts:
        return cls(links=values["links"], layer_host_s=values["layer_host_s"])
