"""Cost models for the event engine: seconds per chunk forward/backward and per hop message.

Three sources of costs:
- `unit_costs`: a rank's whole forward of one microbatch takes 1 and its backward 2 (input
  gradients I = 1, weight gradients W = 1 when split), split evenly over its V chunks;
  communication is free. Reproduces the closed-form bubbles exactly.
- `model_costs`: chunk compute from a FLOP count and an achieved FLOP/s (`DeviceProfile`); a hop
  message takes latency + bytes / bandwidth with per-hop bytes from the payload planner.
- `calibrate.calibrated_costs`: medians measured in a real run's trace.
Links are modelled without contention: each message has its own latency and bandwidth.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from attnres_pp.comm.partition import Partition
from attnres_pp.comm.plan import PayloadPlan
from attnres_pp.model.config import ModelConfig, block_of, has_partial_before

# The ring collectives' prices, used here and by the tensor-parallel terms (`tensor_parallel`).
from attnres_pp.simulator.collectives import ring_all_gather_s, ring_all_reduce_s, ring_reduce_scatter_s  # noqa: F401
from attnres_pp.simulator.layer_recipe import attention_flops_per_token, mlp_flops_per_token


@dataclass(frozen=True, kw_only=True)
class CostModel:
    """Seconds per action of a pipelined step.

    forward_s[c] / backward_s[c]: one microbatch through chunk c. hop_fwd_s[c] / hop_bwd_s[c]: one
    message on hop c <-> c + 1 (forward activations / backward gradients), from the end of the send
    to its arrival (latency + bytes / bandwidth).
    The runtime's own work, all optional (empty or 0 = none; the closed forms assume none):
        send_fwd_s[c] / send_bwd_s[c]  the sender's busy time per message (packing, posting)
        recv_fwd_s[c] / recv_bwd_s[c]  the receiver's busy time once the message is there
        dispatch_s                     the gap before every action (the runtime's dispatch)
    wire_fwd_s / wire_bwd_s: seconds a message occupies its link (bytes / bandwidth); when given,
    the messages from one rank to another share one link and leave one after the other, in the
    order the sender posts them (the link emulation does the same), else every message has a link
    of its own. overlap_comm=False keeps a sender busy for the whole link time.
    weight_s[c]: the W part of backward_s[c] when a schedule splits the backward into I and W (I
    takes the rest); None splits it in halves.
    """

    forward_s: tuple[float, ...]
    backward_s: tuple[float, ...]
    hop_fwd_s: tuple[float, ...]
    hop_bwd_s: tuple[float, ...]
    send_fwd_s: tuple[float, ...] = ()
    send_bwd_s: tuple[float, ...] = ()
    recv_fwd_s: tuple[float, ...] = ()
    recv_bwd_s: tuple[float, ...] = ()
    wire_fwd_s: tuple[float, ...] = ()
    wire_bwd_s: tuple[float, ...] = ()
    dispatch_s: float = 0.0
    overlap_comm: bool = True
    label: str = "custom"
    weight_s: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        n_chunks = len(self.forward_s)
        if len(self.backward_s) != n_chunks:
            raise ValueError(f"CostModel: {n_chunks} forward costs but {len(self.backward_s)} backward costs")
        per_hop = ("hop_fwd_s", "hop_bwd_s", "send_fwd_s", "send_bwd_s", "recv_fwd_s", "recv_bwd_s",
                   "wire_fwd_s", "wire_bwd_s")
        for index, name in enumerate(per_hop):
            got = len(getattr(self, name))
            if got != n_chunks - 1 and not (index >= 2 and got == 0):
                raise ValueError(f"CostModel.{name} needs one entry per hop ({n_chunks - 1}), got {got}"
                                 + ("" if index < 2 else " (or none)"))
        every = [self.dispatch_s, *self.forward_s, *self.backward_s]
        for name in per_hop:
            every += getattr(self, name)
        if any(not value >= 0 or value == float("inf") for value in every):
            raise ValueError("CostModel: every time must be a finite number >= 0 seconds")
        for wire, hop in ((self.wire_fwd_s, self.hop_fwd_s), (self.wire_bwd_s, self.hop_bwd_s)):
            if any(w > h for w, h in zip(wire, hop, strict=False)):
                raise ValueError("CostModel: a message's wire time (bytes / bandwidth) is part of its hop "
                                 "time, so wire_*_s must not exceed hop_*_s")
        if self.weight_s is not None and (
                len(self.weight_s) != n_chunks
                or any(not 0 <= w <= b for w, b in zip(self.weight_s, self.backward_s, strict=True))):
            raise ValueError("CostModel.weight_s needs one entry per chunk, each between 0 and that chunk's "
                             "backward_s (W is a part of B = I + W)")

    @property
    def n_chunks(self) -> int:
        return len(self.forward_s)

    @property
    def split_s(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """(I, W) seconds per chunk for split-backward schedules; I + W = backward_s."""
        weight = self.weight_s if self.weight_s is not None else tuple(b / 2 for b in self.backward_s)
        return tuple(b - w for b, w in zip(self.backward_s, weight, strict=True)), weight

    @property
    def shared_links(self) -> bool:
        """True if messages between one pair of ranks queue on one link (wire times given)."""
        return bool(self.wire_fwd_s or self.wire_bwd_s)


def unit_costs(n_stages: int, n_virtual: int) -> CostModel:
    n_chunks = n_stages * n_virtual
    return CostModel(forward_s=(1.0 / n_virtual,) * n_chunks, backward_s=(2.0 / n_virtual,) * n_chunks,
                     weight_s=(1.0 / n_virtual,) * n_chunks, hop_fwd_s=(0.0,) * (n_chunks - 1),
                     hop_bwd_s=(0.0,) * (n_chunks - 1), label="unit")


@dataclass(frozen=True, kw_only=True)
class DeviceProfile:
    """Achieved (not peak) compute rate and a point-to-point link between neighbouring ranks."""

    name: str
    flops_per_s: float
    link_latency_s: float
    link_bytes_per_s: float

    def __post_init__(self) -> None:
        for name, minimum in (("flops_per_s", "> 0"), ("link_bytes_per_s", "> 0"), ("link_latency_s", ">= 0")):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0 or (value == 0 and minimum == "> 0"):
                raise ValueError(f"DeviceProfile {self.name!r}: {name}={value!r} is invalid: "
                                 f"must be a finite number {minimum}")


# Rough achieved numbers (about 40-50% of peak compute, typical measured p2p bandwidth).
PROFILES = {
    "h100-nvlink": DeviceProfile(name="h100-nvlink", flops_per_s=400e12, link_latency_s=5e-6,
                                 link_bytes_per_s=350e9),
    "h100-ib": DeviceProfile(name="h100-ib", flops_per_s=400e12, link_latency_s=10e-6,
                             link_bytes_per_s=40e9),
    "a100-ib": DeviceProfile(name="a100-ib", flops_per_s=150e12, link_latency_s=10e-6,
                             link_bytes_per_s=20e9),
    "cpu": DeviceProfile(name="cpu", flops_per_s=50e9, link_latency_s=50e-6, link_bytes_per_s=2e9),
}


def sublayer_forward_flops(cfg: ModelConfig, sublayer: int, tokens: int) -> float:
    """Forward FLOPs of one sublayer for `tokens` tokens (matmuls, causal attention, depth read).

    The layer recipe's part (`simulator.layer_recipe`): the qkv projection d -> (H + 2 G) E, SwiGLU's
    three d x f matrices or GELU's two, QK-norm and the rotation of q and k (elementwise, small).
    A depth read costs about 5 FLOPs per source element (key norm, score, weighted sum); its
    keys are r wide under low-rank keys, but the weighted sum over d-wide values dominates.
    """
    d = cfg.d_model
    if sublayer % 2 == 0:  # attention: q, k, v projections (G kv heads), output projection, causal scores
        flops = tokens * attention_flops_per_token(cfg)
    else:  # MLP: SwiGLU's gate, up and down projections (GELU: up and down); an MoE sublayer's K + S experts
        flops = tokens * mlp_flops_per_token(cfg, sublayer // 2)
    if cfg.uses_depth_attention:
        ends = cfg.block_ends
        sources = block_of(sublayer, ends) + (1 if has_partial_before(sublayer, ends) else 0)
        flops += 5 * sources * tokens * d * cfg.n_streams
    return float(flops)


def chunk_forward_flops(cfg: ModelConfig, partition: Partition, chunk_index: int, tokens: int) -> float:
    flops = sum(sublayer_forward_flops(cfg, s, tokens) for s in partition.sublayer_range(chunk_index))
    if chunk_index == partition.n_chunks - 1:  # final read (depth attention only), LM head (tied or not)
        final_read = 5 * (cfg.n_blocks + 1) * tokens * cfg.d_model if cfg.uses_depth_attention else 0
        flops += final_read + 2 * tokens * cfg.d_model * cfg.vocab_size
    return flops


def tp_chunk_forward_flops(cfg: ModelConfig, partition: Partition, chunk_index: int, tokens: int,
                           tensor_parallel: int = 1, sequence_parallel: bool = False) -> float:
    """`chunk_forward_flops` on one of T tp ranks (docs/spec.md section 10, derived): the layers'
    matmuls and attention 1/T; the depth reads and the replicated head on the rank's tokens (1/T of
    them under sequence parallelism, all of them without it)."""
    full = chunk_forward_flops(cfg, partition, chunk_index, tokens)
    if tensor_parallel == 1:
        return full
    import dataclasses

    from attnres_pp.simulator.tensor_parallel import TensorParallel, layer_share, token_share

    plain = dataclasses.replace(cfg, residual="standard")
    sublayers = partition.sublayer_range(chunk_index)
    matmul = sum(sublayer_forward_flops(plain, s, tokens) for s in sublayers)
    rest = full - matmul  # depth reads, final read, head
    tp = TensorParallel(tensor_parallel, sequence_parallel)
    return matmul * layer_share(tp) + rest * token_share(tp)


def model_costs(cfg: ModelConfig, partition: Partition, plan: PayloadPlan, *, tokens: int,
                profile: DeviceProfile, dtype_bytes: int = 2, overlap_comm: bool = True, tp=None,
                tp_bytes_per_s: float = 0.0, tp_latency_s: float = 0.0) -> CostModel:
    """Costs of `cfg` split by `partition` on `profile`; backward = 2 x forward FLOPs.

    Hops between two chunks of the same rank (P == 1) are local and cost nothing. `tp` (a
    `tensor_parallel.TensorParallel`): one tp rank's FLOPs (`tp_chunk_forward_flops`), its layers' tp
    collectives on the intra-node link in each direction, and its hop pair's bytes (1/T under SP).
    """
    from attnres_pp.comm.plan import shard_tokens
    from attnres_pp.simulator.tensor_parallel import TensorParallel, chunk_tp_seconds

    tp = tp or TensorParallel()
    forward = tuple(tp_chunk_forward_flops(cfg, partition, c, tokens, tp.size, tp.sp) / profile.flops_per_s
                    for c in range(partition.n_chunks))
    collectives = tuple(chunk_tp_seconds(cfg, partition.sublayer_range(c), tokens=tokens, element_bytes=dtype_bytes,
                                         tp=tp, bytes_per_s=tp_bytes_per_s, latency_s=tp_latency_s)
                        if tp.size > 1 else 0.0 for c in range(partition.n_chunks))
    width = cfg.d_model if plan.mode == "standard" else cfg.source_width
    rank_tokens = shard_tokens(tokens, tp.size, tp.sp)
    hops = []
    for c, tensors in enumerate(plan.fwd_hop_tensors):
        if partition.rank_of(c) == partition.rank_of(c + 1):
            hops.append(0.0)
            continue
        hops.append(profile.link_latency_s + tensors * rank_tokens * width * dtype_bytes / profile.link_bytes_per_s)
    return CostModel(forward_s=tuple(f + x for f, x in zip(forward, collectives, strict=True)),
                     backward_s=tuple(2 * f + x for f, x in zip(forward, collectives, strict=True)),
                     hop_fwd_s=tuple(hops), hop_bwd_s=tuple(hops), overlap_comm=overlap_comm,
                     label=f"model on {profile.name}" + (f", T={tp.size}" if tp.size > 1 else ""))
