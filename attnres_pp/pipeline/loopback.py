"""Run a whole pipeline in one process over the loopback transport (debugging and fast tests).

Ranks take turns: each runs its next action when it can (a receive only once its message is in the
mailbox), the same unit-step execution the validator proves deadlock-free.
"""

from __future__ import annotations

import torch

from attnres_pp.comm.plan import PayloadPlan
from attnres_pp.comm.transport import ByteLedger, LoopbackTransport
from attnres_pp.model.config import ModelConfig
from attnres_pp.pipeline.chunk import PipelineChunk
from attnres_pp.pipeline.runtime import StageRuntime, StepRecord
from attnres_pp.schedule.ir import Schedule


def make_loopback_runtimes(cfg: ModelConfig, rank_chunks: list[dict[int, PipelineChunk]], plan: PayloadPlan,
                           schedule: Schedule, microbatch_shape: tuple[int, int],
                           ledger: ByteLedger | None = None, p2p_semantics: str = "gloo",
                           activation_dtype: torch.dtype | None = None) -> list[StageRuntime]:
    """p2p_semantics "gloo": messages matched by tag, sends buffered; "nccl": NCCL's rules, enforced
    (`loopback_nccl`), with the executor issuing messages in its NCCL order. Hops carry
    `activation_dtype` (default: the parameters' dtype; bf16 under bf16 autocast)."""
    mailbox: dict = {}
    ledger = ledger or ByteLedger()
    dtype = activation_dtype or next(rank_chunks[0][min(rank_chunks[0])].parameters()).dtype
    if p2p_semantics == "nccl":
        from attnres_pp.pipeline.loopback_nccl import NcclLoopbackTransport
        from attnres_pp.schedule.validate_nccl import NcclP2P

        fabric = NcclP2P(len(rank_chunks))
        transports = [NcclLoopbackTransport(rank, fabric, ledger) for rank in range(len(rank_chunks))]
    elif p2p_semantics == "gloo":
        transports = [LoopbackTransport(rank, mailbox, ledger) for rank in range(len(rank_chunks))]
    else:
        raise ValueError(f"p2p_semantics={p2p_semantics!r} is invalid: choose 'gloo' or 'nccl'")
    return [
        StageRuntime(pp_rank=rank, chunks=chunks, plan=plan, schedule=schedule,
                     transport=transports[rank], microbatch_shape=microbatch_shape,
                     source_width=cfg.source_width, residual_width=cfg.d_model, dtype=dtype)
        for rank, chunks in enumerate(rank_chunks)
    ]


def run_loopback_step(runtimes: list[StageRuntime], inputs_by_mb: list[torch.Tensor],
                      targets_by_mb: list[torch.Tensor], loss_scale: float) -> list[StepRecord]:
    """One forward/backward of every microbatch through all ranks; returns each rank's record."""
    for runtime in runtimes:
        runtime.start_step(inputs_by_mb, targets_by_mb, loss_scale)
    run_in_turns(runtimes, "pipeline")
    return [runtime.finish_step() for runtime in runtimes]


def run_in_turns(runtimes: list, what: str) -> None:
    """Run started runtimes (training or generation: anything with `finished`, `next_ready()`,
    `run_next()`, `actions`, `cursor`, `pp_rank`) to their ends in this process, each taking its next
    action when it can; raises naming every rank's next action if none can move."""
    index = -1
    while (index := next_turn(runtimes, index, what)) is not None:
        runtimes[index].run_next()


def next_turn(runtimes: list, last: int, what: str) -> int | None:
    """The index of the runtime that takes the next turn after runtime `last` took one (-1: none yet):
    the first after it, in order and round again, whose next action can run; None once all have
    finished. Sweeping in order, each ready runtime runs one action per sweep. Raises RuntimeError
    naming every rank's next action if none can move."""
    if all(r.finished for r in runtimes):
        return None
    for step in range(1, len(runtimes) + 1):
        index = (last + step) % len(runtimes)
        if not runtimes[index].finished and runtimes[index].next_ready():
            return index
    stuck = {r.pp_rank: str(r.actions[r.cursor]) for r in runtimes if not r.finished}
    raise RuntimeError(f"loopback {what} is stuck; next actions per pipeline rank: {stuck}")
