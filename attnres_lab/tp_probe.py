"""Probe one machine's tensor-parallel group: what `simulator.tensor_parallel.TensorParallelCosts`
needs to price runs with T > 1 (`attnres-lab fidelity --tp`), measured on T gloo rank processes
of this host, never on the runs it predicts.

1. The collectives: all-gathers, reduce-scatters and all-reduces of whole buffers from 16 KiB to
   4 MiB, each started together (a barrier first), the median of `repeats` per size. A ring link
   is fitted per kind (`fit_ring_link`): an all-gather or reduce-scatter of n bytes over T ranks
   takes (T - 1) steps of latency + (T - 1) / T n / bandwidth, an all-reduce twice that, as
   `simulator.collectives` prices them; one link for all three does not fit gloo, whose
   reduce-scatter runs at about half its all-gather's rate.
2. One transformer layer split over the T ranks with the runtime's plan (`pipeline.tensor_parallel
   .layer_plan`, with and without sequence parallelism), its forward and backward timed, and the
   same layer whole on every rank at once (both cores busy, as in a run). What the split layer
   takes beyond its share of the whole one's work (`layer_share`) and its collectives priced on
   the fitted link is the host's cost per tp layer: DTensor's dispatch, which on a CPU at these
   sizes is most of it.
Wall-clock seconds (a rank blocked in a collective waits, it does not compute), one torch thread
per rank.
"""

from __future__ import annotations

import statistics
import time

import torch

from attnres_pp.launch.process_rank_group import ProcessRankGroup
from attnres_pp.simulator.tensor_parallel import (
    TensorParallel,
    TensorParallelCosts,
    layer_collective_s,
    layer_share,
)

BUFFER_BYTES = (16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20)
KINDS = ("all_gather", "reduce_scatter", "all_reduce")
RING_PASSES = {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 2}  # an all-reduce: both passes


def fit_ring_link(points: list[tuple[str, int, float]], group: int) -> tuple[float, float, float]:
    """(latency per ring step, bytes per second, largest relative residual) through `points`
    (kind, buffer bytes, seconds) of one kind or several: seconds = passes (group - 1) latency +
    passes (group - 1) / group bytes / rate, least squares of the relative error (each point's row
    divided by its time, so a 16 KiB collective weighs as much as a 4 MiB one) in (latency, 1 / rate)."""
    rows = [(RING_PASSES[kind] * (group - 1) / t, RING_PASSES[kind] * (group - 1) / group * n / t)
            for kind, n, t in points]
    times = [1.0] * len(points)
    a11 = sum(x * x for x, _ in rows)
    a12 = sum(x * y for x, y in rows)
    a22 = sum(y * y for _, y in rows)
    b1 = sum(x * t for (x, _), t in zip(rows, times, strict=True))
    b2 = sum(y * t for (_, y), t in zip(rows, times, strict=True))
    det = a11 * a22 - a12 * a12
    if det <= 0:
        raise ValueError("the collective probe's points do not determine a link: probe two sizes or more")
    latency, s_per_byte = (a22 * b1 - a12 * b2) / det, (a11 * b2 - a12 * b1) / det
    if s_per_byte <= 0:
        raise ValueError(f"the collective probe's fit has no positive time per byte ({s_per_byte:.3g} s/B): "
                         "its times do not grow with the buffer; probe larger buffers or a quieter machine")
    latency = max(0.0, latency)
    residual = max(abs(latency * x + s_per_byte * y - 1.0) for x, y in rows)
    return latency, 1.0 / s_per_byte, residual


def fit_links(points: list[tuple[str, int, float]], group: int) -> dict:
    """{kind: {"latency_s", "bytes_per_s", "max_rel_residual"}}: `fit_ring_link` per collective kind."""
    links = {}
    for kind in KINDS:
        latency, rate, residual = fit_ring_link([p for p in points if p[0] == kind], group)
        links[kind] = {"latency_s": latency, "bytes_per_s": rate, "max_rel_residual": residual}
    return links


def host_costs(layer: dict, tokens: int, d_model: int, element_bytes: int, group: int, links: dict) -> dict:
    """{"sp"|"no_sp": {"fwd"|"bwd": seconds}}: the split layer's time less its share of the whole
    layer's and its collectives' on the fitted links (`layer`: the probe's medians)."""
    out = {}
    for plan in ("sp", "no_sp"):
        tp = TensorParallel(group, plan == "sp")
        wire = layer_collective_s(tokens, d_model, element_bytes, tp, bytes_per_s=0.0, latency_s=0.0, links=links)
        out[plan] = {direction: layer[plan][direction] - layer_share(tp) * layer["whole"][direction] - wire
                     for direction in ("fwd", "bwd")}
    return out


def costs_from_probe(probe: dict) -> TensorParallelCosts:
    """The pricing a probe's result (`run_tp_probe`) stands for."""
    links = {kind: {"latency_s": link["latency_s"], "bytes_per_s": link["bytes_per_s"]}
             for kind, link in probe["links"].items()}
    return TensorParallelCosts(links=links, layer_host_s=probe["layer_host_s"])


class TpProbeWorker:
    """One rank of the probe (`launch.rank_group` calls `join_process_group`, then `probe`)."""

    def __init__(self, model: dict, microbatch_size: int, repeats: int, rank: int) -> None:
        self.model, self.microbatch_size, self.repeats, self.rank = model, microbatch_size, repeats, rank

    def join_process_group(self, init_method: str, world_size: int) -> None:
        import datetime

        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=init_method, rank=self.rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=120))

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()

    def probe(self) -> dict:
        import torch.distributed as dist

        return {"collectives": self._collectives(), "layer": self._layers(), "rank": dist.get_rank()}

    def _timed(self, run) -> float:
        import torch.distributed as dist

        times = []
        for _ in range(self.repeats + 2):
            dist.barrier()
            started = time.perf_counter()
            run()
            times.append(time.perf_counter() - started)
        return statistics.median(times[2:])

    def _collectives(self) -> list[tuple[str, int, float]]:
        import torch.distributed as dist

        group, points = dist.get_world_size(), []
        for n_bytes in BUFFER_BYTES:
            whole, shard = torch.ones(n_bytes // 4), torch.ones(n_bytes // 4 // group)
            ops = {"all_gather": lambda w=whole, s=shard: dist.all_gather_into_tensor(w, s),
                   "reduce_scatter": lambda w=whole, s=shard: dist.reduce_scatter_tensor(s, w),
                   "all_reduce": lambda w=whole: dist.all_reduce(w)}
            points += [(kind, n_bytes, self._timed(ops[kind])) for kind in KINDS]
        return points

    def _layers(self) -> dict:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import parallelize_module

        from attnres_pp.model.config import ModelConfig
        from attnres_pp.model.layers import TransformerLayer
        from attnres_pp.pipeline.tensor_parallel import layer_plan

        cfg = ModelConfig.from_dict(self.model)
        group = dist.get_world_size()
        mesh = init_device_mesh("cpu", (group,))
        seq = cfg.seq_len

        def times(layer, x) -> dict:
            def forward():
                return layer.mlp(layer.attn(x))

            def backward():
                out = forward()
                grad = torch.full_like(out, 0.5)
                started = time.perf_counter()
                out.backward(grad)
                return time.perf_counter() - started

            fwd = self._timed(forward)
            bwd = []
            for _ in range(self.repeats + 2):
                dist.barrier()
                bwd.append(backward())
            return {"fwd": fwd, "bwd": statistics.median(bwd[2:])}

        torch.manual_seed(0)
        whole = TransformerLayer(cfg)
        out = {"whole": times(whole, torch.randn(self.microbatch_size, seq, cfg.d_model, requires_grad=True))}
        for plan, sp in (("sp", True), ("no_sp", False)):
            torch.manual_seed(0)
            layer = parallelize_module(TransformerLayer(cfg), mesh, layer_plan(cfg, sp))
            rows = seq // group if sp else seq
            out[plan] = times(layer, torch.randn(self.microbatch_size, rows, cfg.d_model, requires_grad=True))
        return out  # this rank's own times: the driver takes the median over ranks


def run_tp_probe(model: dict, microbatch_size: int, *, group: int = 2, repeats: int = 15,
                 timeout_s: float = 300.0) -> dict:
    """Probe a tp group of `group` rank processes; a JSON-able dict with the points, the fitted link
    and the host's cost per tp layer (`costs_from_probe`)."""
    ranks = ProcessRankGroup(group, timeout_s, name="tp-probe")
    try:
        ranks.start(TpProbeWorker, [{"model": model, "microbatch_size": microbatch_size, "repeats": repeats,
                                     "rank": rank} for rank in range(group)])
        replies = ranks.call_all("probe", what="the tp probe")
    finally:
        ranks.stop(graceful=True)
    points = [(kind, n, statistics.median(r["collectives"][i][2] for r in replies))
              for i, (kind, n, _) in enumerate(replies[0]["collectives"])]
    return analyse(points, [r["layer"] for r in replies], model, microbatch_size, group, repeats)


def analyse(points: list[tuple[str, int, float]], rank_layers: list[dict], model: dict, microbatch_size: int,
            group: int, repeats: int) -> dict:
    """The probe's result from its measurements (each rank's layer times, the collectives' medians)."""
    links = fit_links(points, group)
    layer = {plan: {d: statistics.median(r[plan][d] for r in rank_layers) for d in ("fwd", "bwd")}
             for plan in ("whole", "sp", "no_sp")}
    tokens = microbatch_size * model["seq_len"]
    return {"group": group, "repeats": repeats, "model": model, "microbatch_size": microbatch_size,
            "collectives": [list(p) for p in points], "links": links, "layer_s": layer,
            "layer_host_s": host_costs(layer, tokens, model["d_model"], 4, group, links)}
