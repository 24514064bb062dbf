"""The torch.distributed.pipelining side of `bench peer`: the same standard-residual model cut into
the same chunks (our partition, our `PipelineChunk` modules, the same seed), driven by
`Schedule1F1B` (V = 1), `ScheduleInterleaved1F1B` (V > 1) or, for our `interleaved_zb`,
`ScheduleInterleavedZeroBubble` (its I/W split: `stage_backward_input` / `_weight`), for our
`dualpipev` `ScheduleDualPipeV` on the V placement, over gloo, one
spawned process and one
thread per rank, with the same optimiser step as our workers (global-norm clipping summed over
ranks, AdamW), so a step does the same work on both sides.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from attnres_pp.launch.process_rank_group import ProcessRankGroup
from attnres_pp.train.config import RunConfig


class TorchStageModule(nn.Module):
    """One of our chunks as a pipelining stage: token ids (first) or the residual stream h in,
    h or logits (last) out. The math is our chunk's (`forward_sublayers`, the model's head)."""

    def __init__(self, chunk) -> None:
        super().__init__()
        if chunk.cfg.residual != "standard":
            raise ValueError("the peer comparison runs the standard residual (one tensor per hop)")
        self.chunk = chunk

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from attnres_pp.model.stack import forward_sublayers
        from attnres_pp.model.transformer import embed_state

        chunk = self.chunk
        state = embed_state(chunk.cfg, chunk.embed, x) if chunk.is_first else None
        if state is None:
            from attnres_pp.model.stack import DepthState

            state = DepthState(residual=x)
        layers = {int(k): v for k, v in chunk.layers.items()}
        state = forward_sublayers(chunk.cfg, layers, None, state, chunk.sublayers, chunk.backend)
        return chunk.head(state, None, chunk.backend) if chunk.is_last else state.residual


def lm_loss_fn(logits_BTV: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
    from attnres_pp.model.transformer import lm_loss

    return lm_loss(logits_BTV, targets_BT)


class TorchPipeWorker:
    """One rank: its chunks as PipelineStages, the schedule, the optimiser."""

    def __init__(self, run_cfg_dict: dict, pp_rank: int) -> None:
        self.run_cfg_dict, self.pp_rank = run_cfg_dict, pp_rank

    def join_process_group(self, init_method: str, world_size: int) -> None:
        """Join the gloo group, then build the stages and the schedule (they need the group)."""
        import datetime

        import torch.distributed as dist
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleDualPipeV,
            ScheduleInterleaved1F1B,
            ScheduleInterleavedZeroBubble,
        )

        from attnres_pp.comm.partition import make_partition
        from attnres_pp.model import Transformer
        from attnres_pp.pipeline.chunk import build_rank_chunks, rank_parameters
        from attnres_pp.schedule.schedules import schedule_placement
        from attnres_pp.train.optim import build_optimizer

        pp_rank = self.pp_rank
        self.run_cfg = RunConfig.from_dict(self.run_cfg_dict)
        cfg, train, pipe = self.run_cfg.model, self.run_cfg.train, self.run_cfg.pipeline
        torch.set_num_threads(train.threads)
        dist.init_process_group("gloo", init_method=init_method, rank=pp_rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=pipe.timeout_s))
        torch.manual_seed(train.seed)
        model = Transformer(cfg, seed=train.seed)
        partition = make_partition(cfg.n_layers, pipe.stages, pipe.virtual, pipe.layer_counts,
                                   placement=schedule_placement(pipe.schedule))
        chunks = build_rank_chunks(model, partition, pp_rank)
        self.params = rank_parameters(chunks, model)
        self.optimizer = build_optimizer(self.params.items(), train)
        device = torch.device("cpu")
        self.stages = [PipelineStage(TorchStageModule(chunk), c, partition.n_chunks, device)
                       for c, chunk in sorted(chunks.items())]
        self.is_first = any(chunk.is_first for chunk in chunks.values())
        self.is_last = any(chunk.is_last for chunk in chunks.values())
        if pipe.schedule == "dualpipev":  # it maps stages to ranks in a V itself
            self.schedule = ScheduleDualPipeV(self.stages, train.microbatches, loss_fn=lm_loss_fn)
        elif pipe.schedule == "interleaved_zb":
            self.schedule = ScheduleInterleavedZeroBubble(self.stages, train.microbatches, loss_fn=lm_loss_fn)
        elif pipe.virtual == 1:
            self.schedule = Schedule1F1B(self.stages[0], train.microbatches, loss_fn=lm_loss_fn)
        else:
            self.schedule = ScheduleInterleaved1F1B(self.stages, train.microbatches, loss_fn=lm_loss_fn)

    def train_step(self, inputs_BT: torch.Tensor | None, targets_BT: torch.Tensor | None, lr: float) -> dict:
        import torch.distributed as dist

        from attnres_pp.train.optim import optimizer_step

        started = time.perf_counter()
        losses: list[torch.Tensor] = []
        args = (inputs_BT,) if self.is_first else ()
        if self.is_last:
            self.schedule.step(*args, target=targets_BT, losses=losses)
        else:
            self.schedule.step(*args)
        pipeline_s = time.perf_counter() - started

        def reduce_sq(local_sq: torch.Tensor) -> torch.Tensor:
            dist.all_reduce(local_sq)
            return local_sq

        optimizer_step(self.optimizer, self.params.values(), lr, self.run_cfg.train.grad_clip, reduce_sq)
        return {"losses": [float(loss.detach()) for loss in losses], "pipeline_s": pipeline_s,
                "step_s": time.perf_counter() - started}

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


class TorchPipeEngine:
    """P spawned processes running torch.distributed.pipelining; `train_step` returns per-rank dicts."""

    def __init__(self, run_cfg: RunConfig) -> None:
        pipe = run_cfg.pipeline
        self.run_cfg = run_cfg
        self._ranks = ProcessRankGroup(pipe.stages, pipe.timeout_s + 60.0, name="torchpipe")
        self._ranks.start(TorchPipeWorker, [{"run_cfg_dict": run_cfg.to_dict(), "pp_rank": rank}
                                            for rank in range(pipe.stages)])

    def train_step(self, inputs_BT: torch.Tensor, targets_BT: torch.Tensor, lr: float) -> list[dict]:
        from attnres_pp.comm.partition import chunk_rank
        from attnres_pp.schedule.schedules import schedule_placement

        pipe = self.run_cfg.pipeline
        last_rank = chunk_rank(pipe.n_chunks - 1, pipe.stages, schedule_placement(pipe.schedule))
        return self._ranks.call("train_step", [(inputs_BT if rank == 0 else None,
                                                targets_BT if rank == last_rank else None, lr)
                                               for rank in range(pipe.stages)])

    def close(self) -> None:
        self._ranks.stop(graceful=True)
