"""A calibration that transfers: costs per unit of work, fitted to ONE measured pipelined run by the
measurement lab (`attnres_lab.transfer_fit`), priced here for any other schedule, V, m, payload mode
(standard / naive / cached), layer split, block size and link (`units` says what a unit is).

`TransferCalibration` is what a fit gives and what `attnres-pp simulate predict` reads from a
calibration file (its `to_dict`, the "calibration" of an `attnres-lab fidelity` result): unit
times already scaled to the run, message costs, the W share of a split backward (None: halves, as
`CostModel.split_s`), and the `RunShape` it was fitted on. `costs` prices a `RunShape`:
    compute   the chunk's units (`units.chunk_work`) at the fitted unit times, plus under tensor
              parallelism the tp group's collectives and host cost (`RunShape.tp_costs`);
    messages  the sender's and receiver's work and the fitted link; a link emulated with
              `--link-gbps` replaces the link: latency + bytes / bandwidth per message, the messages
              from one rank to another one after the other on one shared link (`comm.link`).
Measured links between ranks (`RunShape.rank_links`, one per direction: a probe of the real link)
replace the fitted link the same way, each direction on its own; with an emulated link as well, a
message arrives when both have delivered it (the emulation holds a message that the real link
brought sooner) and queues on the real link.
Pure Python: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from attnres_pp.comm.link import LinkModel
from attnres_pp.comm.partition import Partition, make_partition
from attnres_pp.comm.plan import PayloadPlan, plan_for_model, shard_tokens
from attnres_pp.model.config import ModelConfig
from attnres_pp.schedule.schedules import build_schedule, schedule_placement
from attnres_pp.simulator.costs import CostModel
from attnres_pp.simulator.engine import simulate
from attnres_pp.simulator.tensor_parallel import (
    TensorParallel,
    TensorParallelCosts,
    chunk_tp_seconds,
    layer_share,
    token_share,
)
from attnres_pp.simulator.units import MessageCosts, UnitTimes, chunk_work


@dataclass(frozen=True, kw_only=True)
class RunShape:
    """What a pipelined run computes and sends: enough to price it (`TransferCalibration.costs`)."""

    model: ModelConfig
    schedule: str
    n_stages: int
    n_virtual: int
    n_microbatches: int
    microbatch_size: int
    cache: bool
    layer_counts: tuple[int, ...] | None = None
    link: LinkModel | None = None
    dtype_bytes: int = 4
    # (src pp rank, dst pp rank, link): the real link of each direction a hop crosses, measured
    rank_links: tuple[tuple[int, int, LinkModel], ...] = ()
    # T tp ranks per chunk (docs/spec.md section 10); `tp_costs`: the tp group's probed link and
    # host cost per layer (`tensor_parallel.TensorParallelCosts`), None: the collectives and the
    # host cost left out (only the work divided)
    tensor_parallel: int = 1
    sequence_parallel: bool = True
    tp_costs: TensorParallelCosts | None = None

    @property
    def tokens(self) -> int:
        return self.microbatch_size * self.model.seq_len

    @property
    def tp(self) -> TensorParallel:
        return TensorParallel(self.tensor_parallel, self.sequence_parallel)

    @property
    def mode(self) -> str:
        return "standard" if self.model.residual == "standard" else ("cached" if self.cache else "naive")

    def partition(self) -> Partition:
        return make_partition(self.model.n_layers, self.n_stages, self.n_virtual, self.layer_counts,
                              placement=schedule_placement(self.schedule))

    def plan(self) -> PayloadPlan:
        return plan_for_model(self.model, self.partition(), self.cache)

    def to_dict(self) -> dict:
        return {"model": self.model.to_dict(), "schedule": self.schedule, "n_stages": self.n_stages,
                "n_virtual": self.n_virtual, "n_microbatches": self.n_microbatches,
                "microbatch_size": self.microbatch_size, "cache": self.cache,
                "layer_counts": list(self.layer_counts) if self.layer_counts else None,
                "dtype_bytes": self.dtype_bytes, "tensor_parallel": self.tensor_parallel,
                "sequence_parallel": self.sequence_parallel,
                "tp_costs": self.tp_costs.to_dict() if self.tp_costs is not None else None}

    @classmethod
    def from_dict(cls, values: dict) -> RunShape:
        values = dict(values)
        values["model"] = ModelConfig.from_dict(values["model"])
        if values.get("layer_counts"):
            values["layer_counts"] = tuple(values["layer_counts"])
        if values.get("tp_costs") is not None:
            values["tp_costs"] = TensorParallelCosts.from_dict(values["tp_costs"])
        return cls(**values)

    def hop_bytes(self) -> list[int]:
        """Bytes of one message on each hop (the backward carries the same as the forward)."""
        width = self.model.d_model if self.mode == "standard" else self.model.source_width
        tokens = shard_tokens(self.tokens, self.tensor_parallel, self.tp.sp)  # a tp rank's hop pair
        return [n * tokens * width * self.dtype_bytes for n in self.plan().fwd_hop_tensors]


@dataclass(frozen=True, kw_only=True)
class TransferCalibration:
    """Unit times (already scaled to the run) and message costs; `costs` prices any RunShape."""

    forward: UnitTimes
    backward: UnitTimes
    messages: MessageCosts
    forward_scale: float
    backward_scale: float
    calibrated_on: RunShape
    weight_share: float | None = None  # W / (I + W) of a chunk's backward; None: not measured (halves)

    def costs(self, shape: RunShape) -> CostModel:
        if shape.tokens != self.calibrated_on.tokens or shape.model.d_model != self.calibrated_on.model.d_model:
            raise ValueError(f"unit costs were calibrated at {self.calibrated_on.tokens} tokens x d="
                             f"{self.calibrated_on.model.d_model} per microbatch; calibrate again for "
                             f"{shape.tokens} x {shape.model.d_model}")
        partition = shape.partition()
        works = [chunk_work(shape.model, partition, c) for c in range(partition.n_chunks)]
        msg = self.messages
        hop_bytes = shape.hop_bytes()
        self_hop = [partition.is_self_hop(c) for c in range(partition.n_chunks - 1)]
        send = tuple(0.0 if local else msg.send_fixed_s + b * msg.send_s_per_byte
                     for b, local in zip(hop_bytes, self_hop, strict=True))
        recv = tuple(0.0 if local else msg.recv_fixed_s for local in self_hop)
        send_bwd, recv_bwd = send, recv
        if shape.rank_links:
            (link, wire, send_cpu, recv_cpu), (link_bwd, wire_bwd, send_cpu_bwd, recv_cpu_bwd) = (
                measured_hops(shape, partition, hop_bytes, forward) for forward in (True, False))
            # the stack's CPU while a message is on the wire: taken from the compute of each end
            send, send_bwd = (_plus(send, extra) for extra in (send_cpu, send_cpu_bwd))
            recv, recv_bwd = (_plus(recv, extra) for extra in (recv_cpu, recv_cpu_bwd))
        elif shape.link is None:
            link = tuple(0.0 if local else msg.link_latency_s + b * msg.link_s_per_byte
                         for b, local in zip(hop_bytes, self_hop, strict=True))
            wire: tuple[float, ...] = ()
            link_bwd, wire_bwd = link, wire
        else:  # the emulated link: arrival = departure + latency + bytes / bandwidth, one link per pair
            link = tuple(0.0 if local else shape.link.message_s(b)
                         for b, local in zip(hop_bytes, self_hop, strict=True))
            wire = tuple(0.0 if local else shape.link.wire_s(b) for b, local in zip(hop_bytes, self_hop, strict=True))
            link_bwd, wire_bwd = link, wire
        forward_units, backward_units = self.forward, self.backward
        if shape.tensor_parallel > 1:
            forward_units, backward_units = (units.shares(layer_share(shape.tp), token_share(shape.tp))
                                             for units in (self.forward, self.backward))
        tp_fwd, tp_bwd = zip(*(_tp_layer_s(shape, partition.sublayer_range(c)) for c in range(partition.n_chunks)),
                             strict=True)
        forward = tuple(forward_units.chunk_s(w) + x for w, x in zip(works, tp_fwd, strict=True))
        backward = tuple(backward_units.chunk_s(w) + x for w, x in zip(works, tp_bwd, strict=True))
        weight = None if self.weight_share is None else tuple(self.weight_share * b for b in backward)
        return CostModel(forward_s=forward, backward_s=backward,
                         weight_s=weight, hop_fwd_s=link, hop_bwd_s=link_bwd, send_fwd_s=send, send_bwd_s=send_bwd,
                         recv_fwd_s=recv, recv_bwd_s=recv_bwd, wire_fwd_s=wire, wire_bwd_s=wire_bwd,
                         dispatch_s=msg.dispatch_s,
                         label="transferred calibration")

    def predict_step_s(self, shape: RunShape) -> float:
        """The simulated pipeline window of one step of `shape`."""
        schedule = build_schedule(shape.schedule, shape.n_stages, shape.n_virtual, shape.n_microbatches)
        return simulate(schedule, self.costs(shape)).makespan

    def to_dict(self) -> dict:
        """Everything `from_dict` needs to predict again (`attnres-pp simulate predict`)."""
        return {"forward_units_s": self.forward.to_dict(), "backward_units_s": self.backward.to_dict(),
                "forward_scale": self.forward_scale, "backward_scale": self.backward_scale,
                "messages": self.messages.to_dict(), "calibrated_on": self.calibrated_on.to_dict(),
                "weight_share": self.weight_share}

    @classmethod
    def from_dict(cls, values: dict) -> TransferCalibration:
        return cls(forward=UnitTimes.from_dict(values["forward_units_s"]),
                   backward=UnitTimes.from_dict(values["backward_units_s"]),
                   messages=MessageCosts(**values["messages"]), forward_scale=values["forward_scale"],
                   backward_scale=values["backward_scale"], calibrated_on=RunShape.from_dict(values["calibrated_on"]),
                   weight_share=values.get("weight_share"))


def _tp_layer_s(shape: RunShape, sublayers: range) -> tuple[float, float]:
    """(forward, backward) seconds a chunk's layers add under tensor parallelism, one microbatch:
    their collectives on the tp group's link (the same both ways) and the host's cost per tp layer,
    both from `shape.tp_costs` (0 without it, or at T = 1)."""
    costs = shape.tp_costs
    if shape.tensor_parallel == 1 or costs is None:
        return 0.0, 0.0
    wire = chunk_tp_seconds(shape.model, sublayers, tokens=shape.tokens, element_bytes=shape.dtype_bytes, tp=shape.tp,
                            bytes_per_s=0.0, latency_s=0.0, links=costs.links)
    layers = len(sublayers) // 2
    return (wire + layers * costs.host_s(shape.tp, "fwd"), wire + layers * costs.host_s(shape.tp, "bwd"))


def _plus(a: tuple[float, ...], b: tuple[float, ...]) -> tuple[float, ...]:
    return tuple(x + y for x, y in zip(a, b, strict=True))


def measured_hops(shape: RunShape, partition: Partition, hop_bytes: list[int], forward: bool) -> tuple[
        tuple[float, ...], tuple[float, ...], tuple[float, ...], tuple[float, ...]]:
    """(hop seconds, wire seconds, sender's CPU, receiver's CPU) per hop in one direction over
    `shape.rank_links`; the CPU is each end's share of a core for the message's wire time."""
    links = {(src, dst): link for src, dst, link in shape.rank_links}
    hops, wires, send_cpu, recv_cpu = [], [], [], []
    for c, n_bytes in enumerate(hop_bytes):
        src, dst = partition.rank_of(c), partition.rank_of(c + 1)
        if src == dst:
            for column in (hops, wires, send_cpu, recv_cpu):
                column.append(0.0)
            continue
        pair = (src, dst) if forward else (dst, src)
        if pair not in links:
            raise ValueError(f"RunShape.rank_links has no link from rank {pair[0]} to rank {pair[1]}, which hop "
                             f"{c} crosses {'forward' if forward else 'backward'}: give one per direction")
        real = links[pair]
        seconds = real.message_s(n_bytes)
        if shape.link is not None:
            seconds = max(seconds, shape.link.message_s(n_bytes))
        hops.append(seconds)
        wires.append(real.wire_s(n_bytes))
        send_cpu.append(real.sender_cpu_share * real.wire_s(n_bytes))
        recv_cpu.append(real.receiver_cpu_share * real.wire_s(n_bytes))
    return tuple(hops), tuple(wires), tuple(send_cpu), tuple(recv_cpu)
