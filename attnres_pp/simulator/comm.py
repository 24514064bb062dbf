"""Communication per hop and per microbatch for the four modes (docs/spec.md section 4).

The counts come from `attnres_pp.comm.plan.plan_payloads`, the planner the runtime uses;
`closed_form_*` restate docs/spec.md section 4.2 so tests can hold the planner to it.

Modes:
    standard    one residual stream per hop (the baseline transformer)
    full_naive  Full AttnRes (block_size 1) without a cache: every earlier sublayer output travels
    naive       Block AttnRes without a cache: every completed block plus the open partial
    cached      Block AttnRes with the cross-stage cache: only what the receiving rank lacks
"""

from __future__ import annotations

from dataclasses import dataclass

from attnres_pp.comm.partition import Partition, make_partition
from attnres_pp.comm.plan import PayloadPlan, plan_payloads, shard_tokens
from attnres_pp.model.config import block_ends_of

COMM_MODES = ("standard", "full_naive", "naive", "cached")
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


def plan_for_mode(mode: str, *, n_sublayers: int, block_size: int, partition: Partition,
                  blocks: int = 0) -> PayloadPlan:
    """The planner's answer for one of COMM_MODES (full_naive = naive with block_size 1); `blocks` > 0
    places the block boundaries by the number of blocks instead (docs/spec.md section 1.2, ModelConfig.block_ends)."""
    if mode not in COMM_MODES:
        raise ValueError(f"mode {mode!r} is unknown; choose one of {', '.join(COMM_MODES)}")
    if mode == "full_naive":
        return plan_payloads(n_sublayers=n_sublayers, block_size=1, partition=partition, mode="naive")
    block_ends = block_ends_of(n_sublayers, block_size=block_size, blocks=blocks)
    return plan_payloads(n_sublayers=n_sublayers, block_ends=block_ends, partition=partition, mode=mode)


def closed_form_naive(n_stages: int, n_virtual: int) -> list[int]:
    """docs/spec.md section 4.2 (loop placement): with one block completing per chunk, naive hop c carries c + 2
    tensors over the wire; with P = 1 every hop is a self-hop and carries none (docs/spec.md section 3)."""
    return [c + 2 if n_stages > 1 else 0 for c in range(n_stages * n_virtual - 1)]


def closed_form_cached(n_stages: int, n_virtual: int) -> list[int]:
    """docs/spec.md section 4.2: cached hops carry c + 2 while c + 1 < P, then P - 1 each (0 for P = 1: self-hops)."""
    return [c + 2 if c + 1 < n_stages else n_stages - 1 for c in range(n_stages * n_virtual - 1)]


@dataclass(frozen=True, kw_only=True)
class CommReport:
    """Per-hop forward tensor counts and bytes per microbatch for every mode.

    `source_width` is d, or d + r under projected low-rank keys; the standard residual always
    sends width d_model. The backward carries the same bytes again (one gradient per tensor).
    With `tensor_parallel` T > 1 the bytes are those of one tp rank's hop pair (d, p, t) -> (d, p + 1, t):
    1/T of them under sequence parallelism (`comm.plan.shard_tokens`), all of them without it;
    `tp_collectives` lists one layer's tp collectives per direction (`simulator.tensor_parallel`).
    """

    n_layers: int
    block_size: int
    n_stages: int
    n_virtual: int
    tokens: int
    d_model: int
    source_width: int
    dtype: str
    fwd_hop_tensors: dict[str, list[int]]
    blocks: int = 0  # > 0: the blocks are placed by their number (docs/spec.md section 1.2), block_size is not used
    tensor_parallel: int = 1
    sequence_parallel: bool = False
    tp_collectives: tuple[dict, ...] = ()
    tp_collective_s_per_layer: float = 0.0  # one direction, on the intra-node link

    def width_of(self, mode: str) -> int:
        return self.d_model if mode == "standard" else self.source_width

    @property
    def tokens_per_rank(self) -> int:
        return shard_tokens(self.tokens, self.tensor_parallel, self.sequence_parallel)

    def tensor_bytes(self, mode: str) -> int:
        return self.tokens_per_rank * self.width_of(mode) * DTYPE_BYTES[self.dtype]

    @property
    def bytes_per_microbatch(self) -> dict[str, int]:
        """Forward bytes summed over hops (one direction)."""
        return {mode: sum(hops) * self.tensor_bytes(mode) for mode, hops in self.fwd_hop_tensors.items()}

    @property
    def bytes_per_microbatch_both_directions(self) -> dict[str, int]:
        return {mode: 2 * value for mode, value in self.bytes_per_microbatch.items()}

    def to_dict(self) -> dict:
        return {
            "layers": self.n_layers, "sublayers": 2 * self.n_layers, "block_size": self.block_size,
            "blocks": self.blocks, "stages": self.n_stages, "virtual": self.n_virtual,
            "chunks": self.n_stages * self.n_virtual,
            "tokens": self.tokens, "d_model": self.d_model, "source_width": self.source_width,
            "dtype": self.dtype,
            "fwd_hop_tensors": self.fwd_hop_tensors,
            "fwd_tensors_per_microbatch": {m: sum(h) for m, h in self.fwd_hop_tensors.items()},
            "bytes_per_microbatch": self.bytes_per_microbatch,
            "bytes_per_microbatch_both_directions": self.bytes_per_microbatch_both_directions,
            "note": "bytes_per_microbatch counts the forward hops; the backward sends the same again",
            "tensor_parallel": self.tensor_parallel, "sequence_parallel": self.sequence_parallel,
            "tokens_per_rank": self.tokens_per_rank,
            "tp_collectives_per_layer": list(self.tp_collectives),
            "tp_collective_s_per_layer": self.tp_collective_s_per_layer,
            "tp_note": "with T > 1 the bytes are one tp rank's hop pair; tp collectives per layer and direction "
                       "(the backward has the same); derived, not measured",
        }


def comm_report(*, n_layers: int, block_size: int, n_stages: int, n_virtual: int, tokens: int,
                d_model: int, source_width: int, dtype: str = "bf16",
                layer_counts: tuple[int, ...] | None = None, blocks: int = 0, tensor_parallel: int = 1,
                sequence_parallel: bool = False, tp_bytes_per_s: float | None = None,
                tp_latency_s: float = 0.0) -> CommReport:
    """Plan all four modes for one model shape and partition (`blocks` > 0: N blocks, docs/spec.md section 1.2);
    with `tensor_parallel` T, one tp rank's bytes and one layer's tp collectives (priced on
    `tp_bytes_per_s` when given)."""
    from attnres_pp.simulator.tensor_parallel import TensorParallel, layer_collective_s, layer_collectives
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype {dtype!r} is unknown; choose one of {', '.join(DTYPE_BYTES)}")
    if tokens < 1:
        raise ValueError(f"tokens={tokens} is invalid: tokens per microbatch must be >= 1")
    if n_stages < 1 or n_virtual < 1:  # before the partition divides by stages x virtual
        raise ValueError(f"stages={n_stages}, virtual={n_virtual} are invalid: each must be an integer >= 1")
    partition = make_partition(n_layers, n_stages, n_virtual, layer_counts)
    if not 0 <= blocks <= 2 * n_layers:
        raise ValueError(f"blocks={blocks} is invalid: the number of blocks must be in 1..{2 * n_layers}, or 0")
    counts = {mode: plan_for_mode(mode, n_sublayers=2 * n_layers, block_size=block_size, partition=partition,
                                  blocks=blocks).fwd_hop_tensors for mode in COMM_MODES}
    tp = TensorParallel(tensor_parallel, sequence_parallel)
    shard_tokens(tokens, tp.size, tp.sp)  # T must divide the tokens under SP
    collectives = tuple(layer_collectives(tokens, d_model, DTYPE_BYTES[dtype], tp))
    seconds = layer_collective_s(tokens, d_model, DTYPE_BYTES[dtype], tp, bytes_per_s=tp_bytes_per_s,
                                 latency_s=tp_latency_s) if tp_bytes_per_s else 0.0
    return CommReport(n_layers=n_layers, block_size=block_size, n_stages=n_stages, n_virtual=n_virtual,
                      tokens=tokens, d_model=d_model, source_width=source_width, dtype=dtype,
                      fwd_hop_tensors=counts, blocks=blocks, tensor_parallel=tp.size, sequence_parallel=tp.sp,
                      tp_collectives=collectives, tp_collective_s_per_layer=seconds)


def format_bytes(n_bytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n_bytes) < 1024 or unit == "GiB":
            return f"{n_bytes:.0f} {unit}" if unit == "B" else f"{n_bytes:.2f} {unit}"
        n_bytes /= 1024
    raise AssertionError("unreachable")


def format_comm_table(report: CommReport) -> str:
    """A readable per-hop table: one row per mode, one column per hop, then totals."""
    n_hops = report.n_stages * report.n_virtual - 1
    hop_names = [f"{c}->{c + 1}" for c in range(n_hops)]
    per_rank = report.tensor_parallel > 1
    header = ["mode"] + hop_names + ["sum", "bytes/mb (fwd)" + (" per tp rank" if per_rank else "")]
    rows = [header]
    for mode, hops in report.fwd_hop_tensors.items():
        rows.append([mode] + [str(n) for n in hops] + [str(sum(hops)),
                                                        format_bytes(report.bytes_per_microbatch[mode])])
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in
                       enumerate(zip(row, widths, strict=True))) for row in rows]
    return "\n".join([
        f"L={2 * report.n_layers} sublayers, "
        f"{f'N={report.blocks} blocks' if report.blocks else f'S={report.block_size}'}, P={report.n_stages}, "
        f"V={report.n_virtual}, {report.tokens} tokens/mb, width {report.source_width} "
        f"(standard {report.d_model}), {report.dtype}",
        "tensors per forward hop c -> c+1:",
        *lines,
        "the backward carries the same bytes again (one gradient per forwarded tensor)",
        *_tp_lines(report),
    ])


def _tp_lines(report: CommReport) -> list[str]:
    if report.tensor_parallel == 1:
        return []
    lines = [f"tensor parallel T={report.tensor_parallel}, sequence parallel "
             f"{'on' if report.sequence_parallel else 'off'}: each tp rank's hop pair carries "
             f"{report.tokens_per_rank} of the {report.tokens} tokens; per layer and direction (derived):"]
    for c in report.tp_collectives:
        lines.append(f"  {c['count']} x {c['kind']} of {format_bytes(c['buffer_bytes'])}, each rank sending "
                     f"{format_bytes(c['sent_bytes_per_rank'])}")
    if report.tp_collective_s_per_layer:
        lines.append(f"  {1e3 * report.tp_collective_s_per_layer:.3f} ms per layer and direction on the "
                     "intra-node link")
    return lines
