"""`--launcher local`: one spawned process per rank (D x P of them) on this machine, gloo over a
file-based rendezvous in a temporary folder (no port hunting), one thread per rank.

The processes, pipes and bounded waits are `rank_processes.RankProcesses`: a dead rank becomes
WorkerLost naming it, and `restart_workers()` replaces every rank process (the training loop's
recovery). Rank processes ignore Ctrl-C: the driver, which receives it too, stops them in `close()`.
Per step the driver sends each rank (step, lr) and gets scalars back (`StepReply`); the ranks read
their own data and write their own checkpoint shards.

The driver decides every rank's device (`train.devices`): a GPU each and nccl when the node has one
per rank (D x P of them), else gloo on the CPU; the ranks receive the resolved config.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from attnres_pp.model.routing import routing_metrics
from attnres_pp.pipeline.errors import WorkerLost
from attnres_pp.pipeline.rank_processes import RankProcesses, serve
from attnres_pp.train.config import RunConfig
from attnres_pp.train.devices import decide_device, resolve_train, visible_gpus
from attnres_pp.train.loop import StepResult
from attnres_pp.train.pipeline_engine import PipelineEngineBase, mean_eval_loss
from attnres_pp.train.rank_data import resolve_data_path

__all__ = ["ProcessEngine", "WorkerLost"]  # WorkerLost lives in train.recovery; re-exported for callers


def _serve(rank: int, init_method: str, world_size: int, conn, run_cfg_dict: dict, data_path: str,
           fail_at_step: int | None) -> None:
    """The rank process: build the worker, join the group, then answer requests."""
    from attnres_pp.train.stage_worker import StageWorker

    def make_worker():
        worker = StageWorker(run_cfg_dict, rank, data_path=data_path, fail_at_step=fail_at_step)
        return worker, worker.join_process_group(init_method, world_size)

    serve(make_worker, conn)


class ProcessEngine(PipelineEngineBase):
    def __init__(self, run_cfg: RunConfig, out_dir=None, *, fail_at: tuple[int, int] | None = None,
                 record_timelines: bool = False) -> None:
        decision = decide_device(run_cfg.train.device, n_ranks=run_cfg.pipeline.world_size, one_process=False,
                                 gpus=visible_gpus(), data_parallel=run_cfg.pipeline.data_parallel)
        run_cfg = dataclasses.replace(run_cfg, train=resolve_train(run_cfg.train, decision.device))
        super().__init__(run_cfg, out_dir, record_timelines=record_timelines)
        self.timeout_s = run_cfg.pipeline.timeout_s
        self._ranks: RankProcesses | None = None
        self._start_workers(fail_at)
        try:
            self._check_shared_out_dir(
                lambda path, token: self._ranks.call("sees_file", [(path, token)] * self.world_size))
        except BaseException:
            self.close()
            raise

    def _start_workers(self, fail_at: tuple[int, int] | None) -> None:
        data_path = resolve_data_path(self.run_cfg.train.data)
        extra = [(self.run_cfg.to_dict(), data_path, fail_at[1] if fail_at is not None and fail_at[0] == rank else None)
                 for rank in range(self.world_size)]
        self._ranks = RankProcesses(_serve, self.world_size, self.timeout_s, name="attnres-pp", extra_args=extra)
        self.backend = self._ranks.setup_results[0]["backend"]
        self._note_setup(self._ranks.setup_results)

    @property
    def _procs(self) -> list:
        return self._ranks.procs if self._ranks is not None else []

    def restart_workers(self) -> None:
        """Stop every rank process (survivors may be blocked on the lost one) and start fresh ones."""
        self._stop_workers(graceful=False)
        self._start_workers(None)

    def train_step(self, step: int, inputs_BT: torch.Tensor | None, targets_BT: torch.Tensor | None,
                   lr: float) -> StepResult:
        """`inputs_BT`/`targets_BT` None: every rank reads its own share of step `step` (training
        runs); given (tests, benchmarks), each rank is sent its share."""
        want_events = self._wants_events(step)
        before = self._ranks.bytes_exchanged
        args = [(step, lr, self._rank_batch(rank, inputs_BT, targets_BT), want_events)
                for rank in range(self.world_size)]
        replies = self._ranks.call("train_step", args)
        return self._step_result(step, replies, self._ranks.bytes_exchanged - before)

    def eval_loss(self, inputs_BT: torch.Tensor, targets_BT: torch.Tensor) -> float:
        """Forward-only pipeline over one driver-given batch."""
        return mean_eval_loss(self._ranks.call(
            "evaluate", [([self._rank_batch(rank, inputs_BT, targets_BT)],) for rank in range(self.world_size)]))

    def evaluate(self) -> float:
        """Mean loss over the run's validation batches, each rank reading its own share."""
        return mean_eval_loss(self._ranks.call_all("evaluate"))

    def routing_metrics(self) -> dict:
        """Routing scalars per site on validation batch 0, summed by the ranks that own the sites."""
        return routing_metrics(self._ranks.call_all("routing_sums"))

    def save_checkpoint(self, step_dir) -> None:
        """Every rank writes its own shard into `step_dir` (DCP)."""
        self._ranks.call("save_shard", [(_absolute(step_dir),)] * self.world_size)

    def load_checkpoint(self, step_dir) -> None:
        """Every rank loads the parameters it holds, whatever split saved them."""
        self._ranks.call("load_shard", [(_absolute(step_dir),)] * self.world_size)

    def close(self) -> None:
        self._stop_workers(graceful=True)

    def _stop_workers(self, graceful: bool) -> None:
        if self._ranks is not None:
            self._ranks.stop(graceful)
            self._ranks = None


def _absolute(step_dir) -> str:
    """A checkpoint folder as every rank can open it (a rank's working directory need not be the driver's)."""
    return str(Path(step_dir).resolve())
