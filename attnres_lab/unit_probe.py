"""Time the units of work a pipeline chunk is made of, alone, in this process (one thread): a
transformer layer, a residual / partial-sum add, the embedding, the head (output norm, LM head,
loss), phase 1 of a depth read over n sources for k queries, a phase-2 merge with the open partial,
and packing a message (the copy inside every send).

The result (`probe_units`, a JSON-able dict) is the shape of a chunk's cost: `attnres_lab.transfer_fit`
scales it to one measured pipelined run, so its level comes from the run and only the split between
units comes from here. Times are CPU seconds of this thread (`time.thread_time`, page faults
included): with one torch thread that is the unit's own work, and a machine shared with other work
(which stretches wall-clock times by whole scheduler slices) changes it little. Units are timed
round-robin (each once per round, forward then backward) and each figure is a median over rounds.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from attnres_pp.model.config import ModelConfig
from attnres_pp.model.depth import BlockReader, DepthRead
from attnres_pp.model.layers import Embedding, TransformerLayer
from attnres_pp.model.transformer import Head, lm_loss

# Sources and queries at which phase 1 is timed; `attnres_lab.transfer_fit` fits a plane through them.
PHASE1_SOURCES = (1, 2, 4, 8, 16)
PHASE1_QUERIES = (1, 2, 4)
PACK_SIZES = (1, 4, 16)  # message sizes in tensors of [tokens, width]


def _timed(run_forward: Callable[[], torch.Tensor | tuple], grads: Callable[[object], tuple]) -> tuple[float, float]:
    """Seconds of one forward and of its backward (constant output gradients)."""
    started = time.thread_time()
    outputs = run_forward()
    forward_s = time.thread_time() - started
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    output_grads = grads(outputs)  # made outside the timed spans
    started = time.thread_time()
    torch.autograd.backward(outputs, output_grads)
    return forward_s, time.thread_time() - started


def _like(outputs) -> tuple:
    return tuple(torch.full_like(o, 0.5) if o.dim() else torch.ones_like(o) for o in outputs)


def probe_units(cfg: ModelConfig, microbatch_size: int, *, rounds: int = 15, warmup: int = 3) -> dict:
    """Median forward and backward seconds of every unit for microbatches of `microbatch_size`
    sequences of `cfg` (Block or Full AttnRes; a standard model uses the layer, add, embedding and
    head units alone)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _probe(cfg, microbatch_size, rounds, warmup)
    finally:
        torch.set_num_threads(threads)


def _probe(cfg: ModelConfig, microbatch_size: int, rounds: int, warmup: int) -> dict:
    torch.manual_seed(0)
    batch, seq, d, width = microbatch_size, cfg.seq_len, cfg.d_model, cfg.source_width
    layer, embed, head = TransformerLayer(cfg), Embedding(cfg), Head(cfg)
    idx_BT = torch.randint(0, cfg.vocab_size, (batch, seq))

    def leaf(*shape: int) -> torch.Tensor:
        return torch.randn(*shape).requires_grad_(True)

    h_BTD = leaf(batch, seq, d)
    a_BTW, b_BTW = leaf(batch, seq, width), leaf(batch, seq, width)
    units: dict[str, Callable[[], tuple[float, float]]] = {
        "layer": lambda: _timed(lambda: layer.mlp(layer.attn(h_BTD)), _like),
        "add": lambda: _timed(lambda: a_BTW + b_BTW, _like),
        "embed": lambda: _timed(lambda: embed(idx_BT), _like),
        "head": lambda: _timed(lambda: lm_loss(head.lm_head(head.norm(h_BTD)), idx_BT), _like),
    }
    reads = [DepthRead(cfg) for _ in range(max(PHASE1_QUERIES))]
    sources = [leaf(batch, seq, width) for _ in range(max(PHASE1_SOURCES))]
    for n in PHASE1_SOURCES:
        for k in PHASE1_QUERIES:
            units[f"phase1_{n}_{k}"] = (lambda n=n, k=k: _timed(
                lambda: BlockReader(cfg, reads[:k], sources[:n], None, "torch").phase1_by_stream[0], _like))

    def merge() -> tuple[float, float]:
        # Phase 2 with the open partial, then the partial sum; phase 1 runs before the clock starts.
        reader = BlockReader(cfg, reads[:1], sources[:2], None, "torch")
        reader.phase1_by_stream[0] = tuple(t.detach().requires_grad_(True) for t in reader.phase1_by_stream[0])
        return _timed(lambda: reader.read(0, a_BTW, 1) + a_BTW[..., :d], _like)

    units["merge"] = merge
    leaves = [h_BTD, a_BTW, b_BTW, *sources]
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in units}
    for index in range(warmup + rounds):
        for name, run in units.items():
            for tensor in leaves:  # received tensors get fresh gradients every microbatch in a run
                tensor.grad = None
            sample = run()
            if index >= warmup:
                samples[name].append(sample)
    medians = {name: {"fwd_s": statistics.median(s[0] for s in values),
                      "bwd_s": statistics.median(s[1] for s in values)} for name, values in samples.items()}
    return {
        "tokens": batch * seq, "d_model": d, "source_width": width, "dtype_bytes": 4,
        "layer": medians["layer"], "add": medians["add"], "embed": medians["embed"], "head": medians["head"],
        "merge": medians["merge"],
        "phase1": [{"sources": n, "queries": k, **medians[f"phase1_{n}_{k}"]}
                   for n in PHASE1_SOURCES for k in PHASE1_QUERIES],
        "pack_s_per_byte": _pack_seconds_per_byte(batch * seq, width, rounds),
        "rounds": rounds,
    }


def _pack_seconds_per_byte(tokens: int, width: int, rounds: int) -> float:
    """Slope of the time of `torch.cat` (the copy a send makes) against bytes, fitted by least squares."""
    pieces = [torch.randn(tokens, width) for _ in range(max(PACK_SIZES))]
    points = []
    for _ in range(rounds):
        for n in PACK_SIZES:
            started = time.thread_time()
            torch.cat([p.reshape(-1) for p in pieces[:n]])
            points.append((n * tokens * width * 4, time.thread_time() - started))
    mean_x = statistics.fmean(x for x, _ in points)
    mean_y = statistics.fmean(y for _, y in points)
    slope = (sum((x - mean_x) * (y - mean_y) for x, y in points)
             / sum((x - mean_x) ** 2 for x, _ in points))
    return max(0.0, slope)
