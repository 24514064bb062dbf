"""PipelineEngine: a pipelined training run (the `Engine` protocol of `attnres_pp.train.loop`) on top of
a rank group (`launch.rank_group`: spawned processes, Ray actors or threads of this process, as
the launcher says), each rank a `StageWorker` (D x P of them: D replicas of P pipeline ranks).

The launch layer decides every rank's device (`launch.resolve`, against the GPUs the group can give:
this node's, or the Ray cluster's): a GPU each and nccl when there is one per rank, else gloo on the
CPU; in one process a GPU if one is visible. The ranks receive the resolved config. Per step the
driver sends each rank (step, lr) and gets scalars back (`StepReply`); the ranks read their own
data and write their own checkpoint shards straight into the run directory, which every rank must
therefore see (checked at start). A dead rank is WorkerLost naming it, and `restart_workers()`
replaces every rank (the training loop's recovery).

Here too: the step accounting from the ranks' replies, the trace of one step, the slices of a
driver-fed batch, and, for ranks on several nodes, each rank's node and the nodes lost.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from attnres_pp.data import Corpus
from attnres_pp.launch.rank_group import RankGroup
from attnres_pp.launch.resolve import check_tensor_parallel, visible_gpus
from attnres_pp.model.routing import routing_metrics
from attnres_pp.pipeline.mesh import RankCoords
from attnres_pp.train.config import RunConfig
from attnres_pp.train.loop import StepResult
from attnres_pp.train.rank_data import resolve_data_path
from attnres_pp.train.rank_engine import RankEngine, absolute, check_shared_out_dir, mean_eval_loss
from attnres_pp.train.stage_worker import RankBatch, StageWorker
from attnres_pp.train.step_stats import StepReply


class PipelineEngine(RankEngine):
    """`ranks()` makes the (unstarted) rank group, after the split is checked. `corpus` (the loaded
    `train.data`) is shared by ranks in this process; the others load their own. `fail_at` = (global
    rank, 0-based step) makes that rank exit mid-step (not for ranks in this process); `rehearse`: the
    ranks' env rehearsal hooks (`train.faults`) may act, as on a run's first start (not on a start
    that follows a rank lost at start-up, nor on a restart).
    `record_timelines`: every rank returns its action timeline every step (the benchmarks read
    `stats.last_events`); otherwise only on the traced step, so other steps exchange scalars only."""

    def __init__(self, run_cfg: RunConfig, out_dir: str | Path | None = None, *, ranks: Callable[[], RankGroup],
                 corpus: Corpus | None = None, fail_at: tuple[int, int] | None = None,
                 record_timelines: bool = False, rehearse: bool = True) -> None:
        super().__init__(run_cfg, out_dir, record_timelines=record_timelines)
        pipe = run_cfg.pipeline
        self.world_size = pipe.world_size
        self._corpus = corpus
        self.ranks: RankGroup | None = None
        try:
            self.ranks = ranks()
            # Decided against the GPUs the group can give: the Ray cluster's once joined, else this node's.
            gpus = self.ranks.gpus()
            gpus = visible_gpus() if gpus is None else gpus
            check_tensor_parallel(run_cfg.model, pipe, run_cfg.train.device, gpus=gpus)
            self.decide(gpus, self.ranks.where)
            self._note_setup(self.ranks.start(StageWorker, self._rank_kwargs(fail_at, rehearse=rehearse),
                                              device=self.device))
            check_shared_out_dir(self.out_dir, lambda path, token: self.ranks.call_all(
                "sees_file", path, token, what="the --out visibility check"))
        except BaseException:
            self.close()
            raise

    def _rank_kwargs(self, fail_at: tuple[int, int] | None, *, rehearse: bool = False) -> list[dict]:
        """Each rank's StageWorker arguments: the resolved config, where to read the data, and the
        rehearsals of the first start (`fail_at`, `rehearse`: the env hooks of `train.faults`)."""
        data = {"corpus": self._corpus} if self.ranks.one_process else \
            {"data_path": resolve_data_path(self.run_cfg.train.data)}
        return [{"run_cfg_dict": self.run_cfg.to_dict(), "rank": rank, **data,
                 "fail_at_step": fail_at[1] if fail_at is not None and fail_at[0] == rank else None,
                 "rehearse": rehearse}
                for rank in range(self.world_size)]

    def _note_setup(self, descriptions: list[dict]) -> None:
        """Record the ranks' set-up replies (`StageWorker.describe`, in rank order); summary.json gets
        the parameters held per rank of replica 0 (one per pp rank; under tensor parallelism one per
        (pp, tp) rank, in global rank order: the shards of the split matrices, and every replicated
        parameter on each) and, for ranks on nodes, their nodes."""
        self.rank_descriptions = descriptions
        self.backend = descriptions[0]["backend"]
        self.static_extras["params_per_rank"] = [d["params"] for d in sorted(descriptions, key=lambda d: d["rank"])
                                                 if d["dp_rank"] == 0]
        self._transport_bytes_known = False
        if self.ranks.spans_nodes:
            self.static_extras["nodes"] = [node_id for node_id, _ip in self.ranks.rank_nodes]
            self.static_extras["node_addresses"] = [ip for _node_id, ip in self.ranks.rank_nodes]

    def restart_workers(self) -> None:
        """Fresh ranks and process group (survivors may be blocked on the lost one), without any
        injected failure; the loop then loads the last checkpoint into them."""
        self.ranks.restart(self._rank_kwargs(None))
        self._note_setup(self.ranks.setup_results)

    def train_step(self, step: int, inputs_BT: torch.Tensor | None, targets_BT: torch.Tensor | None,
                   lr: float) -> StepResult:
        """`inputs_BT`/`targets_BT` None: every rank reads its own share of step `step` (training
        runs); given (tests, benchmarks), each rank is sent its share."""
        want_events = self._wants_events(step)
        before = self.ranks.bytes_exchanged
        args = [(step, lr, batch, want_events) for batch in self.rank_batches(inputs_BT, targets_BT)]
        replies = self.ranks.call("train_step", args, what=f"step {step + 1}")
        driver_bytes = self.ranks.bytes_exchanged - before
        if self.ranks.spans_nodes and not self._transport_bytes_known:
            # The same every step (one plan): asked once per set of ranks.
            by_rank = self.ranks.call_all("transport_bytes", what="the transport byte counts")
            self.static_extras["bytes_sent_per_step_by_transport"] = {
                way: sum(counts.get(way, 0) for counts in by_rank) for way in ("shm", "gloo")}
            self._transport_bytes_known = True
        return self._step_result(step, replies, driver_bytes)

    def _step_result(self, step: int, replies: list[StepReply], driver_bytes: int) -> StepResult:
        loss, extras, metrics = self._add_step(step, replies, self.run_cfg.pipeline.data_parallel, driver_bytes)
        if self.ranks.lost_nodes:  # summary.json's `lost_nodes`: each lost rank, its node and when
            self.static_extras["lost_nodes"] = list(self.ranks.lost_nodes)
        extras.update(self.static_extras)
        if self._traced(step):
            self._write_trace(extras, per_rank_clocks=len({d["host"] for d in self.rank_descriptions}) > 1)
        return StepResult(loss=loss, extras=extras, metrics=metrics)

    def rank_batches(self, inputs_BT: torch.Tensor | None, targets_BT: torch.Tensor | None) -> list[RankBatch | None]:
        """What a driver-fed global batch gives each global rank: its replica's rows of the inputs
        (first chunk's rank) and targets (last chunk's rank); None for a rank that needs neither, and
        for every rank when there is no batch (the ranks read their own)."""
        pipe = self.run_cfg.pipeline
        if inputs_BT is None:
            return [None] * self.world_size
        share = inputs_BT.shape[0] // pipe.data_parallel
        first, last = self.partition.rank_of(0), self.partition.rank_of(pipe.n_chunks - 1)
        batches: list[RankBatch | None] = []
        for rank in range(self.world_size):
            coords = RankCoords(rank, pipe.data_parallel, pipe.stages, pipe.tensor_parallel)
            dp_rank, pp_rank = coords.dp_rank, coords.pp_rank
            rows = slice(dp_rank * share, (dp_rank + 1) * share)
            needed = pp_rank in (first, last)
            batches.append((inputs_BT[rows] if pp_rank == first else None,
                            targets_BT[rows] if pp_rank == last else None) if needed else None)
        return batches

    def eval_loss(self, inputs_BT: torch.Tensor, targets_BT: torch.Tensor) -> float:
        """Forward-only pipeline over one driver-given batch."""
        return mean_eval_loss(self.ranks.call("evaluate", [([batch],) for batch in
                                                           self.rank_batches(inputs_BT, targets_BT)],
                                              what="evaluation"))

    def evaluate(self) -> float:
        """Mean loss over the run's validation batches, each rank reading its own share."""
        return mean_eval_loss(self.ranks.call_all("evaluate", what="evaluation"))

    def routing_metrics(self) -> dict:
        """Routing entropy and embedding weight per site on validation batch 0, each rank probing the
        reads of its own chunks; only their scalar sums are merged."""
        return routing_metrics(self.ranks.call_all("routing_sums", what="routing statistics"))

    def save_checkpoint(self, step_dir) -> None:
        """Every rank writes its own shard into `step_dir` (DCP), on the filesystem all nodes share."""
        self.ranks.call_all("save_shard", absolute(step_dir), what="checkpoint save")

    def begin_checkpoint(self, step_dir) -> float:
        """Every rank starts writing its shard into `step_dir` in the background (`--async-checkpoint`);
        returns the longest time a rank blocked (its previous write, then copying its state)."""
        return max(self.ranks.call_all("begin_save", absolute(step_dir), what="checkpoint save"))

    def checkpoint_written(self) -> bool:
        """Whether every rank's background write is done."""
        return all(self.ranks.call_all("save_written", what="checkpoint save"))

    def finish_checkpoint(self) -> None:
        """Wait for every rank's background write (a rank's failed write raises)."""
        self.ranks.call_all("finish_save", what="checkpoint save")

    def load_checkpoint(self, step_dir) -> None:
        """Every rank loads the parameters it holds, whatever split saved them."""
        self.ranks.call_all("load_shard", absolute(step_dir), what="checkpoint load")

    def close(self) -> None:
        """Stop the ranks (and a Ray instance the group started). Safe to call twice and after a
        failed start."""
        if self.ranks is not None:
            self.ranks.stop(graceful=True)
