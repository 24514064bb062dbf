"""RankEngine: what every training engine over rank groups shares, whatever its replica policy (one
group of D x P x T ranks, `PipelineEngine`, or D torchft replica groups of P x T ranks, `FtEngine`):
the split checked before any rank starts, the launch layer's decision (`launch.resolve`), per-step
statistics and the loss over the reporting ranks, the Chrome trace of one step, the scalars every
step's summary carries, and the `Engine` protocol's plain answers (`attnres_pp.train.loop`)."""

from __future__ import annotations

import secrets
from pathlib import Path

from attnres_pp.launch.resolve import ResolvedRun
from attnres_pp.model import parameter_count
from attnres_pp.pipeline.stage_setup import check_split
from attnres_pp.schedule.timeline import align_per_rank
from attnres_pp.schedule.trace import write_chrome_trace
from attnres_pp.train.config import RunConfig, resolve_training
from attnres_pp.train.step_stats import StepReply, StepStatsLog


class RankEngine:
    """The shared core: `run_cfg` as the launch layer decides it against `gpus` GPUs `where` the
    ranks run (`decide`), the step statistics of replica 0's pipeline ranks of tp rank 0 (every tp
    rank's hops carry the same tensors, each its shard), and the trace of the second step (the
    first free of warm-up effects; a 1-step run traces step 0). `record_timelines`: every step
    returns every rank's timeline (the benchmarks read `stats.last_events`)."""

    run_cfg: RunConfig
    resolved: ResolvedRun
    device: str

    def __init__(self, run_cfg: RunConfig, out_dir: str | Path | None, *, record_timelines: bool) -> None:
        pipe = run_cfg.pipeline
        self.out_dir = Path(out_dir).resolve() if out_dir is not None else None
        # A bad split fails here, in one line, before any rank starts.
        self.partition = check_split(run_cfg.model.n_layers, pipe, run_cfg.train.microbatches)
        self.run_cfg = run_cfg
        self.record_timelines = record_timelines
        self._trace_step = min(1, run_cfg.train.steps - 1)
        self.stats = StepStatsLog(n_chunks=pipe.n_chunks,
                                  replica0_ranks=[p * pipe.tensor_parallel for p in range(pipe.stages)])
        self.static_extras: dict = {"data_parallel": pipe.data_parallel}

    def decide(self, gpus: int, where: str = "on this node") -> None:
        """Take the launch layer's decision for the ranks about to start (device, dtype, kernels)."""
        self.run_cfg, self.resolved = resolve_training(self.run_cfg, gpus=gpus, where=where)
        self.device = self.resolved.device

    @property
    def train_cfg(self):
        """The run's TrainConfig with device, dtype and kernels decided (summary.json's config)."""
        return self.run_cfg.train

    def param_count(self) -> int:
        return parameter_count(self.run_cfg.model)

    def _traced(self, step: int) -> bool:
        return self.out_dir is not None and step == self._trace_step

    def _wants_events(self, step: int) -> bool:
        return self.record_timelines or self._traced(step)

    def _add_step(self, step: int, replies: list[StepReply], replicas: int, driver_bytes: int):
        """(loss, extras, metrics) of a step that `replicas` pipelines trained, from their ranks'
        replies. Each of the last stage's T tp ranks reports its microbatches' losses (under sequence
        parallelism its shard's mean): the mean over them all is the replicas' share of the batch's
        mean loss."""
        n_losses = replicas * self.run_cfg.train.microbatches * self.run_cfg.pipeline.tensor_parallel
        return self.stats.add(replies, n_losses, driver_bytes, self._traced(step))

    def _write_trace(self, extras: dict, *, per_rank_clocks: bool = False) -> None:
        """The traced step's events as `out_dir`/trace.json, named in `extras`. `per_rank_clocks`:
        ranks on several hosts, whose clocks are not comparable, each start at 0."""
        events = align_per_rank(self.stats.last_events) if per_rank_clocks else self.stats.last_events
        extras["trace"] = str(write_chrome_trace(sorted(events, key=lambda e: e[2]), self.out_dir / "trace.json"))


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


def absolute(step_dir) -> str:
    """A checkpoint folder as every rank can open it (a rank's working directory need not be the driver's)."""
    return str(Path(step_dir).resolve())
