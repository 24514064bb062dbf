"""Engine: the one training engine over rank groups (the `Engine` protocol of
`attnres_pp.train.loop`), under a replica policy (`train.replica_policy`): one group of D x P x T
ranks (`OneGroup`, every launcher) or D torchft replica groups of P x T ranks stepped apart
(`train.ft_replicas.FtReplicaGroups`, `--fault-tolerance replicas`). `train.engines.make_engine`
chooses the policy.

What the engine does whatever the policy: the split checked before any rank starts, the launch
layer's decision (`launch.resolve`), each rank's arguments, the slices of a driver-fed batch, the
per-step statistics and the loss over the reporting ranks, the scalars every step's summary
carries, the Chrome trace of one step, checkpoint folders every rank can open, and the check that
every rank sees the run directory. Which ranks answer each call is the policy's.
"""

from __future__ import annotations

import secrets
import time
from pathlib import Path

import torch

from attnres_pp.data import Corpus
from attnres_pp.launch.rank_group import RankGroup
from attnres_pp.launch.resolve import ResolvedRun
from attnres_pp.model import parameter_count
from attnres_pp.model.routing import routing_metrics
from attnres_pp.pipeline.mesh import RankCoords
from attnres_pp.pipeline.stage_setup import check_split
from attnres_pp.schedule.timeline import align_per_rank
from attnres_pp.schedule.trace import write_chrome_trace
from attnres_pp.train.config import RunConfig, resolve_training
from attnres_pp.train.loop import StepResult
from attnres_pp.train.replica_policy import ReplicaPolicy
from attnres_pp.train.stage_worker import RankBatch
from attnres_pp.train.step_stats import StepStatsLog


class Engine:
    """`run_cfg` on ranks that `policy` starts and calls. `corpus` (the loaded `train.data`) is
    shared by ranks in this process; the others load their own. `fail_at` = (global rank, 0-based
    step[, "allreduce"]) makes that rank exit mid-step, once (not for ranks in this process);
    `rehearse`: the ranks' env rehearsal hooks (`train.faults`) may act, as on a run's first start.

    The step statistics are replica 0's pipeline ranks' of tp rank 0 (every tp rank's hops carry
    the same tensors, each its shard); the trace is the second step's (the first free of warm-up
    effects; a 1-step run traces step 0). `record_timelines`: every rank returns its action
    timeline every step (the benchmarks read `stats.last_events`); otherwise only on the traced
    step, so other steps exchange scalars only."""

    resolved: ResolvedRun
    device: str
    backend: str

    def __init__(self, run_cfg: RunConfig, out_dir: str | Path | None = None, *, policy: ReplicaPolicy,
                 corpus: Corpus | None = None, fail_at: tuple | None = None, record_timelines: bool = False,
                 rehearse: bool = True) -> None:
        pipe = run_cfg.pipeline
        self.out_dir = Path(out_dir).resolve() if out_dir is not None else None
        # A bad split fails here, in one line, before any rank starts.
        self.partition = check_split(run_cfg.model.n_layers, pipe, run_cfg.train.microbatches)
        self.run_cfg = run_cfg
        self.world_size = pipe.world_size
        self.corpus = corpus
        self.record_timelines = record_timelines
        self._trace_step = min(1, run_cfg.train.steps - 1)
        self.stats = StepStatsLog(n_chunks=pipe.n_chunks,
                                  replica0_ranks=[p * pipe.tensor_parallel for p in range(pipe.stages)])
        self.static_extras: dict = {"data_parallel": pipe.data_parallel}
        self.rank_descriptions: list[dict] = []
        self.policy = policy
        if not policy.restartable:
            self.restart_workers = None  # the loop reads None as "this launcher cannot restart workers"
        try:
            policy.start(self, fail_at=fail_at, rehearse=rehearse)
            check_shared_out_dir(self.out_dir, lambda path, token: policy.call_every(
                "sees_file", path, token, what="the --out visibility check"))
        except BaseException:
            self.close()
            raise

    # ---- what the policy asks of the engine as it starts ranks ----
    def decide(self, gpus: int, where: str = "on this node") -> None:
        """Take the launch layer's decision for the ranks about to start (device, dtype, kernels)."""
        self.run_cfg, self.resolved = resolve_training(self.run_cfg, gpus=gpus, where=where)
        self.device = self.resolved.device

    def rank_kwargs(self, rank: int, fail_at: tuple | None, **extra) -> dict:
        """Global rank `rank`'s worker arguments: the resolved config, the step at which `fail_at`
        makes it exit (None for the others), and the policy's `extra`."""
        failing = fail_at is not None and fail_at[0] == rank
        return {"run_cfg_dict": self.run_cfg.to_dict(), "rank": rank,
                "fail_at_step": fail_at[1] if failing else None, **extra}

    @property
    def ranks(self) -> RankGroup:
        """The rank group of a one-group run (tests and benchmarks reach its workers through it)."""
        return self.policy.ranks

    @property
    def train_cfg(self):
        """The run's TrainConfig with device, dtype and kernels decided (summary.json's config)."""
        return self.run_cfg.train

    @property
    def model(self):
        """The whole model of a one-process run (its lone rank's `Transformer`), for callers that read
        it after training; other runs hold it spread over their ranks."""
        workers = getattr(self.policy.ranks, "workers", None)
        if self.world_size != 1 or not workers:
            raise AttributeError("only a one-process run's engine holds the whole model")
        return workers[0].model

    def param_count(self) -> int:
        return parameter_count(self.run_cfg.model)

    # ---- one step ----
    def _traced(self, step: int) -> bool:
        return self.out_dir is not None and step == self._trace_step

    def train_step(self, step: int, inputs_BT: torch.Tensor | None, targets_BT: torch.Tensor | None,
                   lr: float) -> StepResult:
        """`inputs_BT`/`targets_BT` None: every rank reads its own share of step `step` (training
        runs); given (tests, benchmarks), each rank is sent its share. The loss is the reporting
        ranks' mean: each of the last stage's T tp ranks of every replica that trained the step
        reports its microbatches' losses (under sequence parallelism its shard's mean)."""
        batches = None if inputs_BT is None else self.rank_batches(inputs_BT, targets_BT)
        outcome = self.policy.step(step, lr, self.record_timelines or self._traced(step), batches)
        n_losses = outcome.replicas * self.run_cfg.train.microbatches * self.run_cfg.pipeline.tensor_parallel
        loss, extras, metrics = self.stats.add(outcome.replies, n_losses, outcome.driver_bytes, self._traced(step))
        policy_extras = self.policy.step_extras(step, outcome, metrics)
        extras.update(self.static_extras)
        extras.update(policy_extras)
        if self._traced(step):
            # Ranks on several hosts, whose clocks are not comparable, each start at 0.
            events = align_per_rank(self.stats.last_events) if self.policy.per_rank_clocks else self.stats.last_events
            extras["trace"] = str(write_chrome_trace(sorted(events, key=lambda e: e[2]), self.out_dir / "trace.json"))
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

    # ---- evaluation ----
    def eval_loss(self, inputs_BT: torch.Tensor, targets_BT: torch.Tensor) -> float:
        """Forward-only pipeline over one driver-given batch."""
        return mean_eval_loss(self.policy.call_ranks(
            "evaluate", [([batch],) for batch in self.rank_batches(inputs_BT, targets_BT)], what="evaluation"))

    def evaluate(self) -> float:
        """Mean loss over the run's validation batches, each rank reading its own share."""
        return mean_eval_loss(self.policy.call_live("evaluate", what="evaluation"))

    def routing_metrics(self) -> dict:
        """Routing entropy and embedding weight per site on validation batch 0, each rank probing the
        reads of its own chunks; only their scalar sums are merged."""
        return routing_metrics(self.policy.call_holder("routing_sums", what="routing statistics"))

    # ---- checkpoints: every rank writes and reads its own shard, on the filesystem all nodes share ----
    def save_checkpoint(self, step_dir) -> None:
        self.policy.call_holder("save_shard", absolute(step_dir), what="checkpoint save")

    def begin_checkpoint(self, step_dir) -> float:
        """The ranks start writing their shards in the background (`--async-checkpoint`); returns the
        longest time a rank blocked (its previous write, then copying its state). A policy without
        background writes writes at once: the seconds it took."""
        if self.policy.background_saves:
            return max(self.policy.call_holder("begin_save", absolute(step_dir), what="checkpoint save"))
        start = time.perf_counter()
        self.save_checkpoint(step_dir)
        return time.perf_counter() - start

    def checkpoint_written(self) -> bool:
        """Whether every rank's background write is done."""
        return not self.policy.background_saves or all(self.policy.call_holder("save_written",
                                                                                what="checkpoint save"))

    def finish_checkpoint(self) -> None:
        """Wait for every rank's background write (a rank's failed write raises)."""
        if self.policy.background_saves:
            self.policy.call_holder("finish_save", what="checkpoint save")

    def load_checkpoint(self, step_dir) -> None:
        """Every rank loads the parameters it holds, whatever split saved them."""
        self.policy.load(absolute(step_dir))

    def restart_workers(self) -> None:
        """Fresh ranks and process group (survivors may be blocked on the lost one), without any
        injected failure; the loop then loads the last checkpoint into them."""
        self.policy.restart()

    def close(self) -> None:
        """Stop the ranks (and what the policy started for them). Safe to call twice and after a failed start."""
        self.policy.close()


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
