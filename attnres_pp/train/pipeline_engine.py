"""Pipelined training engines (the `Engine` protocol of `attnres_pp.train.loop`), shared pieces: the
rank layout, step accounting from the ranks' scalar replies, the trace of one step, the slices of a
driver-fed batch, and the check that every rank sees the run directory."""

from __future__ import annotations

import secrets
from pathlib import Path

import torch

from attnres_pp.model import parameter_count
from attnres_pp.pipeline.stage_setup import check_split
from attnres_pp.schedule.timeline import align_per_rank
from attnres_pp.schedule.trace import write_chrome_trace
from attnres_pp.train.config import RunConfig
from attnres_pp.train.loop import StepResult
from attnres_pp.train.stage_worker import RankBatch
from attnres_pp.train.step_stats import StepReply, StepStatsLog


class PipelineEngineBase:
    """Turns per-rank step replies into a StepResult; writes DIR/trace.json for one step.

    `record_timelines`: every rank returns its action timeline every step (the benchmarks read
    `stats.last_events`); otherwise only on the traced step, so other steps exchange scalars only."""

    def __init__(self, run_cfg: RunConfig, out_dir: str | Path | None, *, record_timelines: bool = False) -> None:
        self.run_cfg = run_cfg
        self.out_dir = Path(out_dir).resolve() if out_dir is not None else None
        pipe = run_cfg.pipeline
        # A bad split fails here, in one line, before any worker starts.
        self.partition = check_split(run_cfg.model.n_layers, pipe, run_cfg.train.microbatches)
        self.world_size = pipe.world_size
        self.stats = StepStatsLog(n_chunks=pipe.n_chunks, replica0_ranks=list(range(pipe.stages)))
        self.record_timelines = record_timelines
        # The second step is the first one free of warm-up effects; a 1-step run traces step 0.
        self._trace_step = min(1, run_cfg.train.steps - 1)
        self.static_extras: dict = {"data_parallel": pipe.data_parallel}

    @property
    def train_cfg(self):
        """The run's TrainConfig with device, dtype and kernels resolved by the driver (summary.json's
        config; `train.devices`)."""
        return self.run_cfg.train

    def param_count(self) -> int:
        return parameter_count(self.run_cfg.model)

    def _note_setup(self, descriptions: list[dict]) -> None:
        """Record the ranks' set-up replies (`StageWorker.describe`, in rank order); summary.json gets
        the parameters held per pp rank (replica 0's ranks)."""
        self.rank_descriptions = descriptions
        by_pp = {d["pp_rank"]: d["params"] for d in descriptions if d["dp_rank"] == 0}
        self.static_extras["params_per_rank"] = [by_pp[p] for p in range(self.run_cfg.pipeline.stages)]

    def _wants_events(self, step: int) -> bool:
        return self.record_timelines or (self.out_dir is not None and step == self._trace_step)

    def _step_result(self, step: int, replies: list[StepReply], driver_bytes: int) -> StepResult:
        pipe = self.run_cfg.pipeline
        traced = self.out_dir is not None and step == self._trace_step
        loss, extras, metrics = self.stats.add(replies, pipe.data_parallel * self.run_cfg.train.microbatches,
                                               driver_bytes, traced)
        extras.update(self.static_extras)
        if traced:
            events = self.stats.last_events
            if len({d["host"] for d in getattr(self, "rank_descriptions", [])}) > 1:
                # Ranks on several hosts: their clocks are not comparable, so every rank's step starts at 0.
                events = align_per_rank(events)
            trace = write_chrome_trace(sorted(events, key=lambda e: e[2]), self.out_dir / "trace.json")
            extras["trace"] = str(trace)
        return StepResult(loss=loss, extras=extras, metrics=metrics)

    def _rank_batch(self, rank: int, inputs_BT: torch.Tensor | None,
                    targets_BT: torch.Tensor | None) -> RankBatch | None:
        """What a driver-fed global batch gives global rank `rank`: its replica's rows of the inputs
        (first chunk's rank) and targets (last chunk's rank); None for a rank that needs neither."""
        if inputs_BT is None:
            return None
        pipe = self.run_cfg.pipeline
        dp_rank, pp_rank = divmod(rank, pipe.stages)
        share = inputs_BT.shape[0] // pipe.data_parallel
        rows = slice(dp_rank * share, (dp_rank + 1) * share)
        first = self.partition.rank_of(0) == pp_rank
        last = self.partition.rank_of(pipe.n_chunks - 1) == pp_rank
        if not (first or last):
            return None
        return (inputs_BT[rows] if first else None, targets_BT[rows] if last else None)

    def _check_shared_out_dir(self, ask_ranks) -> None:
        """Ranks write their checkpoint shards straight into the run directory, so every rank must see
        the driver's. The driver writes a probe file there; `ask_ranks(path, token)` returns each
        rank's (sees it, host name). Raises RuntimeError naming the ranks that do not."""
        if self.out_dir is None:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        token = secrets.token_hex(8)
        probe = self.out_dir / f".probe-{token}"
        probe.write_text(token)
        try:
            answers = ask_ranks(str(probe), token)
        finally:
            probe.unlink(missing_ok=True)
        blind = [f"rank {rank} on {host}" for rank, (seen, host) in enumerate(answers) if not seen]
        if blind:
            raise RuntimeError(
                f"--out {self.out_dir} is not visible to {', '.join(blind)}: ranks write their checkpoint shards "
                "there directly, so with several nodes --out must be on a filesystem every node mounts at the same "
                "path (NFS, a cluster filesystem); choose such a directory")


def mean_eval_loss(answers: list[tuple[float, int]]) -> float:
    """The ranks' (loss sum, count) answers to `evaluate` as one mean over microbatches."""
    total, count = sum(a[0] for a in answers), sum(a[1] for a in answers)
    if count == 0:
        raise RuntimeError("no rank reported an evaluation loss")
    return total / count
