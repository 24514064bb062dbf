"""`--launcher inprocess`: a whole pipelined run in one process over the loopback transport
(`pipeline.loopback`), for debugging and fast tests."""

from __future__ import annotations

import dataclasses

import torch

from attnres_pp.comm.plan import plan_for_model
from attnres_pp.comm.transport import ByteLedger
from attnres_pp.model import Transformer
from attnres_pp.model.precision import activation_dtype
from attnres_pp.pipeline.chunk import build_rank_chunks
from attnres_pp.pipeline.loopback import make_loopback_runtimes, run_loopback_step
from attnres_pp.pipeline.stage_setup import lowered_schedule, run_partition
from attnres_pp.train.checkpoint import capture_state, read_checkpoint, restore_state, write_rank_file
from attnres_pp.train.config import RunConfig
from attnres_pp.train.devices import decide_device, resolve_train, visible_gpus
from attnres_pp.train.loop import StepResult
from attnres_pp.train.optim import build_optimizer, optimizer_step
from attnres_pp.train.pipeline_engine import PipelineEngineBase


class InProcessEngine(PipelineEngineBase):
    """Every rank in this process over the loopback transport; one model, one optimizer, so tied
    parameters are shared objects and clipping sees every gradient once."""

    def __init__(self, run_cfg: RunConfig, out_dir=None) -> None:
        decision = decide_device(run_cfg.train.device, n_ranks=run_cfg.pipeline.stages, one_process=True,
                                 gpus=visible_gpus())
        run_cfg = dataclasses.replace(run_cfg, train=resolve_train(run_cfg.train, decision.device))
        super().__init__(run_cfg, out_dir)
        cfg, train, pipe = run_cfg.model, run_cfg.train, run_cfg.pipeline
        torch.set_num_threads(train.threads)
        torch.manual_seed(train.seed)
        self.device = torch.device(decision.device)  # every rank in this process, on one device
        self.model = Transformer(cfg, backend=train.kernels, precision=train.dtype).to(self.device)
        self.optimizer = build_optimizer(self.model, train, fused=self.device.type == "cuda")
        partition = run_partition(cfg.n_layers, pipe)
        rank_chunks = [build_rank_chunks(self.model, partition, r) for r in range(pipe.stages)]
        self.ledger = ByteLedger()
        schedule = lowered_schedule(pipe, train.microbatches)
        self.runtimes = make_loopback_runtimes(cfg, rank_chunks, plan_for_model(cfg, partition, pipe.cache), schedule,
                                               (train.microbatch_size, cfg.seq_len), self.ledger,
                                               p2p_semantics=pipe.resolved_p2p("loopback"),
                                               activation_dtype=activation_dtype(train.dtype))

    def train_step(self, step: int, inputs_BT: torch.Tensor, targets_BT: torch.Tensor, lr: float) -> StepResult:
        m = self.run_cfg.train.microbatches
        self.ledger.clear()
        inputs_BT, targets_BT = inputs_BT.to(self.device), targets_BT.to(self.device)
        records = run_loopback_step(self.runtimes, list(inputs_BT.chunk(m)), list(targets_BT.chunk(m)), 1.0 / m)
        grad_norm = optimizer_step(self.optimizer, self.model.parameters(), lr, self.run_cfg.train.grad_clip)
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
        loss = float(self.model(inputs_BT.to(self.device), targets_BT.to(self.device)))
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
