"""`--launcher local`: one spawned process per rank on this machine, gloo over a file-based
rendezvous in a temporary folder (no port hunting), one thread per rank.

The processes, pipes and bounded waits are `rank_processes.RankProcesses`: a dead rank becomes
WorkerLost naming it, and `restart_workers()` replaces every rank process (the training loop's
recovery). Rank processes ignore Ctrl-C: the driver, which receives it too, stops them in `close()`.
"""

from __future__ import annotations

import dataclasses

import torch

from attnres_pp.pipeline.errors import WorkerLost
from attnres_pp.pipeline.rank_processes import RankProcesses, serve
from attnres_pp.pipeline.stage_setup import check_split
from attnres_pp.train.checkpoint import read_checkpoint, write_rank_file
from attnres_pp.train.config import RunConfig
from attnres_pp.train.devices import decide_device, resolve_train, visible_gpus
from attnres_pp.train.loop import StepResult
from attnres_pp.train.pipeline_engine import PipelineEngineBase, model_from_parameters

__all__ = ["ProcessEngine", "WorkerLost"]  # WorkerLost lives in train.recovery; re-exported for callers


def _serve(pp_rank: int, init_method: str, world_size: int, conn, run_cfg_dict: dict,
           fail_at_step: int | None) -> None:
    """The rank process: build the worker, join the group, then answer requests."""
    from attnres_pp.train.stage_worker import StageWorker

    def make_worker():
        worker = StageWorker(run_cfg_dict, pp_rank)
        worker.fail_at_step = fail_at_step
        return worker, worker.join_process_group(init_method, world_size)

    serve(make_worker, conn)


class ProcessEngine(PipelineEngineBase):
    def __init__(self, run_cfg: RunConfig, out_dir=None, *, fail_at: tuple[int, int] | None = None) -> None:
        # The driver decides every rank's device: a GPU each (nccl) if the node has enough, else gloo.
        decision = decide_device(run_cfg.train.device, n_ranks=run_cfg.pipeline.stages, one_process=False,
                                 gpus=visible_gpus())
        run_cfg = dataclasses.replace(run_cfg, train=resolve_train(run_cfg.train, decision.device))
        super().__init__(run_cfg, out_dir)
        # A bad split fails here, in one line, before any process starts.
        self.partition = check_split(run_cfg.model.n_layers, run_cfg.pipeline, run_cfg.train.microbatches)
        self.timeout_s = run_cfg.pipeline.timeout_s
        self._ranks: RankProcesses | None = None
        self._start_workers(fail_at)

    def _start_workers(self, fail_at: tuple[int, int] | None) -> None:
        pipe = self.run_cfg.pipeline
        extra = [(self.run_cfg.to_dict(), fail_at[1] if fail_at is not None and fail_at[0] == rank else None)
                 for rank in range(pipe.stages)]
        self._ranks = RankProcesses(_serve, pipe.stages, self.timeout_s, name="attnres-pp", extra_args=extra)
        self.backend = self._ranks.setup_results[0]
        self._eval_model = None

    @property
    def _procs(self) -> list:
        return self._ranks.procs if self._ranks is not None else []

    def restart_workers(self) -> None:
        """Stop every rank process (survivors may be blocked on the lost one) and start fresh ones."""
        self._stop_workers(graceful=False)
        self._start_workers(None)

    def train_step(self, step: int, inputs_BT: torch.Tensor, targets_BT: torch.Tensor, lr: float) -> StepResult:
        pipe = self.run_cfg.pipeline
        last_rank = self.partition.rank_of(pipe.n_chunks - 1)
        args = [(step, inputs_BT if rank == 0 else None, targets_BT if rank == last_rank else None, lr)
                for rank in range(pipe.stages)]
        self._eval_model = None
        return self._step_result(step, self._ranks.call("train_step", args))

    @torch.no_grad()
    def eval_loss(self, inputs_BT: torch.Tensor, targets_BT: torch.Tensor) -> float:
        if self._eval_model is None:
            named = {}
            for part in self._ranks.call_all("named_parameters"):
                named.update(part)
            self._eval_model = model_from_parameters(self.run_cfg, named)
        return float(self._eval_model(inputs_BT, targets_BT))

    def save_checkpoint(self, step_dir) -> None:
        for rank, state in enumerate(self._ranks.call_all("checkpoint_state")):
            write_rank_file(step_dir, rank, state)

    def load_checkpoint(self, step_dir) -> None:
        merged, rng_by_rank = read_checkpoint(step_dir)
        self._ranks.call("load_checkpoint_state", [(merged, rng_by_rank.get(r)) for r in range(len(self._procs))])
        self._eval_model = None

    def close(self) -> None:
        self._stop_workers(graceful=True)

    def _stop_workers(self, graceful: bool) -> None:
        if self._ranks is not None:
            self._ranks.stop(graceful)
            self._ranks = None
