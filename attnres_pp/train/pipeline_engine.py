"""PipelineEngine: a pipelined training run (the `Engine` protocol of `attnres_pp.train.loop`) on top of
a rank group (`launch.rank_group`: spawned processes, Ray actors or threads of this process, as
the launcher says), each rank a `StageWorker` (D x P of them: D replicas of P pipeline ranks).

The driver decides every rank's device (`train.devices`, against the GPUs the group can give:
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

import dataclasses
import secrets
from collections.abc import Callable
from pathlib import Path

import torch

from attnres_pp.data import Corpus
from attnres_pp.launch.rank_group import RankGroup
from attnres_pp.model import parameter_count
from attnres_pp.model.routing import routing_metrics
from attnres_pp.pipeline.mesh import RankCoords
from attnres_pp.pipeline.stage_setup import check_split
from attnres_pp.schedule.timeline import align_per_rank
from attnres_pp.schedule.trace import write_chrome_trace
from attnres_pp.train.config import RunConfig
from attnres_pp.train.devices import decide_device, resolve_train, visible_gpus
from attnres_pp.train.loop import StepResult
from attnres_pp.train.rank_data import resolve_data_path
from attnres_pp.train.stage_worker import RankBatch, StageWorker
from attnres_pp.train.step_stats import StepReply, StepStatsLog


class PipelineEngine:
    """`ranks()` makes the (unstarted) rank group, after the split is checked. `corpus` (the loaded
    `train.data`) is shared by ranks in this process; the others load their own. `fail_at` = (global
    rank, 0-based step) makes that rank exit mid-step (not for ranks in this process).
    `record_timelines`: every rank returns its action timeline every step (the benchmarks read
    `stats.last_events`); otherwise only on the traced step, so other steps exchange scalars only."""

    def __init__(self, run_cfg: RunConfig, out_dir: str | Path | None = None, *, ranks: Callable[[], RankGroup],
                 corpus: Corpus | None = None, fail_at: tuple[int, int] | None = None,
                 record_timelines: bool = False) -> None:
        self.out_dir = Path(out_dir).resolve() if out_dir is not None else None
        pipe = run_cfg.pipeline
        # A bad split fails here, in one line, before any rank starts.
        self.partition = check_split(run_cfg.model.n_layers, pipe, run_cfg.train.microbatches)
        self.run_cfg = run_cfg
        self.world_size = pipe.world_size
        # Replica 0's ranks of tp rank 0 (every tp rank's hops carry the same tensors, each its shard).
        self.stats = StepStatsLog(n_chunks=pipe.n_chunks,
                                  replica0_ranks=[p * pipe.tensor_parallel for p in range(pipe.stages)])
        self.record_timelines = record_timelines
        # The second step is the first one free of warm-up effects; a 1-step run traces step 0.
        self._trace_step = min(1, run_cfg.train.steps - 1)
        self.static_extras: dict = {"data_parallel": pipe.data_parallel}
        self._corpus = corpus
        self.ranks: RankGroup | None = None
        try:
            self.ranks = ranks()
            gpus = self.ranks.gpus()
            decision = decide_device(run_cfg.train.device, n_ranks=self.world_size, one_process=self.ranks.one_process,
                                     gpus=visible_gpus() if gpus is None else gpus, where=self.ranks.where,
                                     data_parallel=pipe.data_parallel)
            self.run_cfg = dataclasses.replace(run_cfg, train=resolve_train(run_cfg.train, decision.device))
            self.device = decision.device
            self._note_setup(self.ranks.start(StageWorker, self._rank_kwargs(fail_at), device=self.device))
            check_shared_out_dir(self.out_dir, lambda path, token: self.ranks.call_all(
                "sees_file", path, token, what="the --out visibility check"))
        except BaseException:
            self.close()
            raise

    def _rank_kwargs(self, fail_at: tuple[int, int] | None) -> list[dict]:
        """Each rank's StageWorker arguments: the resolved config and where to read the data."""
        data = {"corpus": self._corpus} if self.ranks.one_process else \
            {"data_path": resolve_data_path(self.run_cfg.train.data)}
        return [{"run_cfg_dict": self.run_cfg.to_dict(), "rank": rank, **data,
                 "fail_at_step": fail_at[1] if fail_at is not None and fail_at[0] == rank else None}
                for rank in range(self.world_size)]

    @property
    def train_cfg(self):
        """The run's TrainConfig with device, dtype and kernels resolved by the driver (summary.json's
        config; `train.devices`)."""
        return self.run_cfg.train

    def param_count(self) -> int:
        return parameter_count(self.run_cfg.model)

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

    def _wants_events(self, step: int) -> bool:
        return self.record_timelines or (self.out_dir is not None and step == self._trace_step)

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
        pipe = self.run_cfg.pipeline
        traced = self.out_dir is not None and step == self._trace_step
        # Each of the last stage's T tp ranks reports its microbatch losses (under sequence parallelism
        # each its shard's mean): the mean over all of them is the global batch's mean loss.
        n_losses = pipe.data_parallel * self.run_cfg.train.microbatches * pipe.tensor_parallel
        loss, extras, metrics = self.stats.add(replies, n_losses, driver_bytes, traced)
        if self.ranks.lost_nodes:  # summary.json's `lost_nodes`: each lost rank, its node and when
            self.static_extras["lost_nodes"] = list(self.ranks.lost_nodes)
        extras.update(self.static_extras)
        if traced:
            events = self.stats.last_events
            if len({d["host"] for d in self.rank_descriptions}) > 1:
                # Ranks on several hosts: their clocks are not comparable, so every rank's step starts at 0.
                events = align_per_rank(events)
            trace = write_chrome_trace(sorted(events, key=lambda e: e[2]), self.out_dir / "trace.json")
            extras["trace"] = str(trace)
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
        self.ranks.call_all("save_shard", _absolute(step_dir), what="checkpoint save")

    def begin_checkpoint(self, step_dir) -> float:
        """Every rank starts writing its shard into `step_dir` in the background (`--async-checkpoint`);
        returns the longest time a rank blocked (its previous write, then copying its state)."""
        return max(self.ranks.call_all("begin_save", _absolute(step_dir), what="checkpoint save"))

    def checkpoint_written(self) -> bool:
        """Whether every rank's background write is done."""
        return all(self.ranks.call_all("save_written", what="checkpoint save"))

    def finish_checkpoint(self) -> None:
        """Wait for every rank's background write (a rank's failed write raises)."""
        self.ranks.call_all("finish_save", what="checkpoint save")

    def load_checkpoint(self, step_dir) -> None:
        """Every rank loads the parameters it holds, whatever split saved them."""
        self.ranks.call_all("load_shard", _absolute(step_dir), what="checkpoint load")

    def close(self) -> None:
        """Stop the ranks (and a Ray instance the group started). Safe to call twice and after a
        failed start."""
        if self.ranks is not None:
            self.ranks.stop(graceful=True)


def check_shared_out_dir(out_dir: Path | None, ask_ranks) -> None:
    """Ranks write their checkpoint shards straight into the run directory, so every rank must see
    the driver's. The driver writes a probe file there; `ask_ranks(path, token)` returns each rank's
    (sees it, host name). Raises RuntimeError naming the ranks that do not."""
    if out_dir is None:
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    token = secrets.token_hex(8)
    probe = out_dir / f".probe-{token}"
    probe.write_text(token)
    try:
        answers = ask_ranks(str(probe), token)
    finally:
        probe.unlink(missing_ok=True)
    blind = [f"rank {rank} on {host}" for rank, (seen, host) in enumerate(answers) if not seen]
    if blind:
        raise RuntimeError(
            f"--out {out_dir} is not visible to {', '.join(blind)}: ranks write their checkpoint shards "
            "there directly, so with several nodes --out must be on a filesystem every node mounts at the same "
            "path (NFS, a cluster filesystem); choose such a directory")


def mean_eval_loss(answers: list[tuple[float, int]]) -> float:
    """The ranks' (loss sum, count) answers to `evaluate` as one mean over microbatches."""
    total, count = sum(a[0] for a in answers), sum(a[1] for a in answers)
    if count == 0:
        raise RuntimeError("no rank reported an evaluation loss")
    return total / count


def _absolute(step_dir) -> str:
    """A checkpoint folder as every rank can open it (a rank's working directory need not be the driver's)."""
    return str(Path(step_dir).resolve())
