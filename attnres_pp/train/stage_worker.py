"""StageWorker: one pipeline rank with its chunks, optimizer and runtime, talking over
torch.distributed. The local launcher's processes and the Ray actors are thin shells around it.
It lives in the training layer because it owns the optimiser step and the checkpoint state; the
pipeline below it provides the chunks, the schedule, the runtime and the transports.

Every rank builds the whole model from the run's seed and keeps its own chunks, so initial weights
equal the single-process model's. MSAR stream convolutions are replicated on every rank; their
gradients are summed across ranks before clipping (tied parameters), and counted once in the norm.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from attnres_pp.comm.nccl_transport import BatchedDistTransport
from attnres_pp.comm.plan import plan_for_model
from attnres_pp.comm.transport import DistTransport
from attnres_pp.model import Transformer
from attnres_pp.model.precision import activation_dtype
from attnres_pp.pipeline.chunk import build_rank_chunks, rank_parameters
from attnres_pp.pipeline.runtime import StageRuntime, StepRecord
from attnres_pp.pipeline.stage_setup import init_process_group, lowered_schedule, run_partition
from attnres_pp.train.checkpoint import capture_state, restore_state
from attnres_pp.train.config import RunConfig
from attnres_pp.train.devices import resolve_train
from attnres_pp.train.optim import build_optimizer, optimizer_step


class StageWorker:
    def __init__(self, run_cfg_dict: dict, pp_rank: int) -> None:
        run_cfg = RunConfig.from_dict(run_cfg_dict)
        if run_cfg.train.device == "auto":  # not from a driver (tests): cpu, as gloo needs
            run_cfg = dataclasses.replace(run_cfg, train=resolve_train(run_cfg.train, "cpu"))
        self.run_cfg = run_cfg
        self.pp_rank = pp_rank
        cfg, train, pipe = self.run_cfg.model, self.run_cfg.train, self.run_cfg.pipeline
        torch.set_num_threads(train.threads)
        torch.manual_seed(train.seed)
        self.model = Transformer(cfg, backend=train.kernels, precision=train.dtype)
        self.partition = run_partition(cfg.n_layers, pipe)
        self.chunks = build_rank_chunks(self.model, self.partition, pp_rank)
        self.params = rank_parameters(self.chunks, self.model)
        self.tied = list(self.model.stream_convs.parameters()) if self.model.stream_convs is not None else []
        self.optimizer = build_optimizer(self.params.items(), train)
        self.plan = plan_for_model(cfg, self.partition, pipe.cache)
        self.schedule = lowered_schedule(pipe, train.microbatches)
        self.runtime: StageRuntime | None = None
        self.fail_at_step: int | None = None  # rehearsal of a lost rank: exit mid-step at this step

    def join_process_group(self, init_method: str, world_size: int) -> str:
        """Join the run's process group (gloo on CPU, nccl when this worker has a GPU)."""
        backend, device = init_process_group(init_method, self.pp_rank, world_size, self.run_cfg.pipeline.timeout_s,
                                             self.run_cfg.train.device)
        self.attach(device, backend)
        return backend

    def attach(self, device: torch.device, backend: str = "gloo") -> None:
        """Move to `device` and build the runtime over the (already initialised) process group;
        under NCCL's rules (the nccl backend, or p2p_semantics="nccl") messages go out in batches."""
        self.device = device
        self.model.to(device)
        cfg, train, pipe = self.run_cfg.model, self.run_cfg.train, self.run_cfg.pipeline
        if device.type == "cuda":  # fused AdamW needs the parameters on the GPU; no state exists yet
            self.optimizer = build_optimizer(self.params.items(), train, fused=True)
        nccl_rules = pipe.resolved_p2p(backend) == "nccl"
        transport_cls = BatchedDistTransport if nccl_rules else DistTransport
        self.runtime = StageRuntime(
            pp_rank=self.pp_rank, chunks=self.chunks, plan=self.plan, schedule=self.schedule,
            transport=transport_cls(self.pp_rank, pipe.timeout_s, device),
            microbatch_shape=(train.microbatch_size, cfg.seq_len),
            source_width=cfg.source_width, residual_width=cfg.d_model,
            dtype=activation_dtype(train.dtype, next(self.model.parameters()).dtype),
        )

    def forward_backward(self, step: int, inputs_BT: torch.Tensor | None,
                         targets_BT: torch.Tensor | None) -> StepRecord:
        """Run this rank's action list for one step; gradients accumulate in the parameters.

        Only rank 0 needs inputs and only the last chunk's rank targets.
        """
        m = self.run_cfg.train.microbatches
        to_device = (lambda t: None if t is None else [x.to(self.device) for x in t.chunk(m)])
        runtime = self.runtime
        runtime.transport.ledger.clear()
        runtime.start_step(to_device(inputs_BT), to_device(targets_BT), 1.0 / m)
        if step == self.fail_at_step:
            for _ in range(len(runtime.actions) // 2):
                runtime.run_next()
            os._exit(17)
        return runtime.run_to_end()

    def reduce_tied_grads(self) -> torch.Tensor:
        """Sum the replicated stream-conv gradients over ranks; returns their squared norm (float64)."""
        import torch.distributed as dist

        if not self.tied:
            return torch.zeros((), dtype=torch.float64)
        for p in self.tied:  # a source this rank never reads has no gradient here
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in self.tied])
        dist.all_reduce(flat)
        for p, piece in zip(self.tied, flat.split([p.numel() for p in self.tied]), strict=True):
            p.grad.copy_(piece.view_as(p))
        return flat.double().square().sum().cpu()

    def train_step(self, step: int, inputs_BT: torch.Tensor | None, targets_BT: torch.Tensor | None,
                   lr: float) -> dict:
        """One optimiser step: forward/backward, tied-gradient sum, global-norm clipping, AdamW."""
        import torch.distributed as dist

        record = self.forward_backward(step, inputs_BT, targets_BT)
        tied_sq = self.reduce_tied_grads()

        def reduce_sq(local_sq: torch.Tensor) -> torch.Tensor:
            # The tied gradients are identical on every rank: count them once.
            untied = (local_sq - tied_sq).to(self.device)
            dist.all_reduce(untied)
            return untied.cpu() + tied_sq

        grad_norm = optimizer_step(self.optimizer, self.params.values(), lr, self.run_cfg.train.grad_clip, reduce_sq)
        return {
            "losses": record.losses,
            "events": [(e.pp_rank, e.name, e.start_s, e.end_s, e.category) for e in record.events],
            "ledger": list(self.runtime.transport.ledger.records),
            "cache_peak_bytes": record.cache_peak_bytes,
            "grad_norm": grad_norm,
        }

    def checkpoint_state(self) -> dict:
        """This rank's parameters, optimizer and RNG states (CPU tensors; see train.checkpoint)."""
        return capture_state(self.params, self.optimizer)

    def load_checkpoint_state(self, merged: dict, rng: dict | None) -> None:
        """Take this rank's parameters and optimizer state from a merged checkpoint."""
        restore_state(merged, self.params, self.optimizer, rng)

    def named_parameters(self) -> dict[str, torch.Tensor]:
        return {name: p.detach().cpu().clone() for name, p in self.params.items()}

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
