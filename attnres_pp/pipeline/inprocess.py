"""Run a whole pipeline in one process over the loopback transport (debugging and fast tests).

Ranks take turns: each runs its next action when it can (a receive only once its message is in the
mailbox), the same unit-step execution the validator proves deadlock-free.
"""

from __future__ import annotations

import torch

from attnres_pp.comm.plan import PayloadPlan, plan_for_model
from attnres_pp.comm.transport import ByteLedger, LoopbackTransport
from attnres_pp.model import Transformer
from attnres_pp.model.config import ModelConfig
from attnres_pp.pipeline.chunk import PipelineChunk, build_rank_chunks
from attnres_pp.pipeline.engines import PipelineEngineBase
from attnres_pp.pipeline.ir import Schedule
from attnres_pp.pipeline.partition import make_partition
from attnres_pp.pipeline.runtime import StageRuntime, StepRecord
from attnres_pp.pipeline.worker import lowered_schedule
from attnres_pp.train.checkpoint import capture_state, read_checkpoint, restore_state, write_rank_file
from attnres_pp.train.config import RunConfig
from attnres_pp.train.loop import StepResult
from attnres_pp.train.optim import build_optimizer, clip_grad_norm_, set_lr


def make_loopback_runtimes(cfg: ModelConfig, rank_chunks: list[dict[int, PipelineChunk]], plan: PayloadPlan,
                           schedule: Schedule, microbatch_shape: tuple[int, int],
                           ledger: ByteLedger | None = None) -> list[StageRuntime]:
    mailbox: dict = {}
    ledger = ledger or ByteLedger()
    dtype = next(rank_chunks[0][min(rank_chunks[0])].parameters()).dtype
    return [
        StageRuntime(pp_rank=rank, chunks=chunks, plan=plan, schedule=schedule,
                     transport=LoopbackTransport(rank, mailbox, ledger), microbatch_shape=microbatch_shape,
                     source_width=cfg.source_width, residual_width=cfg.d_model, dtype=dtype)
        for rank, chunks in enumerate(rank_chunks)
    ]


def run_loopback_step(runtimes: list[StageRuntime], inputs_by_mb: list[torch.Tensor],
                      targets_by_mb: list[torch.Tensor], loss_scale: float) -> list[StepRecord]:
    """One forward/backward of every microbatch through all ranks; returns each rank's record."""
    for runtime in runtimes:
        runtime.start_step(inputs_by_mb, targets_by_mb, loss_scale)
    while not all(r.finished for r in runtimes):
        progressed = False
        for runtime in runtimes:
            if not runtime.finished and runtime.next_ready():
                runtime.run_next()
                progressed = True
        if not progressed:
            stuck = {r.pp_rank: str(r.actions[r.cursor]) for r in runtimes if not r.finished}
            raise RuntimeError(f"loopback pipeline is stuck; next actions per rank: {stuck}")
    return [runtime.finish_step() for runtime in runtimes]


class InProcessEngine(PipelineEngineBase):
    """Every rank in this process over the loopback transport; one model, one optimizer, so tied
    parameters are shared objects and clipping sees every gradient once."""

    def __init__(self, run_cfg: RunConfig, out_dir=None) -> None:
        super().__init__(run_cfg, out_dir)
        cfg, train, pipe = run_cfg.model, run_cfg.train, run_cfg.pipeline
        torch.set_num_threads(train.threads)
        torch.manual_seed(train.seed)
        self.model = Transformer(cfg)
        self.optimizer = build_optimizer(self.model, train)
        partition = make_partition(cfg.n_layers, pipe.stages, pipe.virtual, pipe.layer_counts)
        rank_chunks = [build_rank_chunks(self.model, partition, r) for r in range(pipe.stages)]
        self.ledger = ByteLedger()
        self.runtimes = make_loopback_runtimes(cfg, rank_chunks, plan_for_model(cfg, partition, pipe.cache),
                                               lowered_schedule(run_cfg), (train.microbatch_size, cfg.seq_len),
                                               self.ledger)

    def train_step(self, step: int, inputs_BT: torch.Tensor, targets_BT: torch.Tensor, lr: float) -> StepResult:
        m = self.run_cfg.train.microbatches
        self.ledger.clear()
        records = run_loopback_step(self.runtimes, list(inputs_BT.chunk(m)), list(targets_BT.chunk(m)), 1.0 / m)
        grad_norm = clip_grad_norm_(self.model.parameters(), self.run_cfg.train.grad_clip)
        set_lr(self.optimizer, lr)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        ledger = list(self.ledger.records)
        rank_results = [
            {"losses": rec.losses, "grad_norm": grad_norm, "cache_peak_bytes": rec.cache_peak_bytes,
             "events": [(e.pp_rank, e.name, e.start_s, e.end_s, e.category) for e in rec.events],
             "ledger": ledger if rank == 0 else []}
            for rank, rec in enumerate(records)
        ]
        return self._step_result(step, rank_results)

    @torch.no_grad()
    def eval_loss(self, inputs_BT: torch.Tensor, targets_BT: torch.Tensor) -> float:
        self.model.eval()
        loss = float(self.model(inputs_BT, targets_BT))
        self.model.train()
        return loss

    def save_checkpoint(self, step_dir) -> None:
        """One process and one optimizer for every rank, so one rank file: rank_0.pt."""
        write_rank_file(step_dir, 0, capture_state(dict(self.model.named_parameters()), self.optimizer))

    def load_checkpoint(self, step_dir) -> None:
        merged, rng_by_rank = read_checkpoint(step_dir)
        restore_state(merged, dict(self.model.named_parameters()), self.optimizer, rng_by_rank.get(0))

    def close(self) -> None:
        """Nothing to release in one process."""
