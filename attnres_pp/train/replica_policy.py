"""How the one training engine (`train.engine.Engine`) holds its replicas: the `ReplicaPolicy`
protocol, and `OneGroup`, the policy of every run but `--fault-tolerance replicas`: one rank group
(`launch.rank_group`: spawned processes, Ray actors, threads of this process or the processes
torchrun started, as the launcher says) of D x P x T ranks, each a `StageWorker`, stepped together.
The other policy, D torchft replica groups stepped apart, is `train.ft_replicas.FtReplicaGroups`.

The launch layer decides every rank's device (`launch.resolve`, against the GPUs the group can
give: this node's, or the Ray cluster's once joined). Per step the driver sends each rank (step,
lr) and gets scalars back (`StepReply`); the ranks read their own data and write their own
checkpoint shards straight into the run directory. A dead rank is WorkerLost naming it, and
`restart()` replaces every rank (the training loop's recovery).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from attnres_pp.launch.rank_group import RankGroup
from attnres_pp.launch.resolve import check_tensor_parallel, visible_gpus
from attnres_pp.train.rank_data import resolve_data_path
from attnres_pp.train.stage_worker import RankBatch, StageWorker
from attnres_pp.train.step_stats import StepReply


class EngineSide(Protocol):
    """What a replica policy reads from and tells the engine (`train.engine.Engine`, which imports
    the policies: they name its side here rather than import it back)."""

    run_cfg: object  # RunConfig, resolved by `decide`
    world_size: int
    corpus: object
    device: str
    backend: str
    static_extras: dict
    rank_descriptions: list[dict]

    def decide(self, gpus: int, where: str = "on this node") -> None: ...

    def rank_kwargs(self, rank: int, fail_at: tuple | None, **extra) -> dict: ...


@dataclass
class StepOutcome:
    """What the ranks answered for one step: the reporting ranks' replies, how many replicas trained
    it (the loss is their share of the batch's mean), the driver's traffic, and which replicas
    committed (torchft groups; every replica under one group)."""

    replies: list[StepReply]
    replicas: int
    driver_bytes: int
    committed: list[int] = field(default_factory=list)


class ReplicaPolicy(Protocol):
    """Which ranks the engine calls, and how, for each of its jobs."""

    restartable: bool  # the loop may restart the ranks after a loss (not torchrun's processes)
    background_saves: bool  # the ranks write checkpoints in the background (`--async-checkpoint`)
    per_rank_clocks: bool  # ranks on several hosts: each rank's trace starts at its own 0

    def start(self, engine: EngineSide, *, fail_at: tuple | None, rehearse: bool) -> None:
        """Start the ranks (after `engine.decide`), noting `engine.backend` and its static extras."""

    def step(self, step: int, lr: float, want_events: bool, batches: list[RankBatch | None] | None) -> StepOutcome:
        """Train step `step` (`batches`: each global rank's share of a driver-fed batch, or None)."""

    def step_extras(self, step: int, outcome: StepOutcome, metrics: dict) -> dict:
        """The policy's own summary scalars for the step (and its per-step metrics, into `metrics`)."""

    def call_every(self, method: str, *args, what: str) -> list:
        """`method` on every rank; a lost rank raises WorkerLost."""

    def call_live(self, method: str, *args, what: str) -> list:
        """`method` on every live replica's ranks, each answering for its own share (a replica lost
        meanwhile is left out and restarted, where the policy can)."""

    def call_holder(self, method: str, *args, what: str) -> list:
        """`method` on the ranks that hold one whole copy of the trained state."""

    def call_ranks(self, method: str, per_rank_args: list[tuple], what: str) -> list:
        """`method` with per-rank arguments (driver-fed batches)."""

    def load(self, step_dir: str) -> None:
        """Every live rank loads checkpoint `step_dir`."""

    def restart(self) -> None:
        """Fresh ranks, without an injected failure (the loop then loads the last checkpoint)."""

    def close(self) -> None:
        """Stop every rank. Safe to call twice and after a failed start."""


class OneGroup:
    """One rank group of all D x P x T ranks, from `make_ranks()` (unstarted; called once the
    engine has checked the split). `restartable` False: ranks only their starter can start again
    (torchrun's, `torchrun --max-restarts`), so the loop ends the run at a lost rank, in one line."""

    background_saves = True

    def __init__(self, make_ranks: Callable[[], RankGroup], *, restartable: bool = True) -> None:
        self._make_ranks = make_ranks
        self.restartable = restartable
        self.ranks: RankGroup | None = None
        self._transport_bytes_known = False

    def start(self, engine: EngineSide, *, fail_at: tuple | None, rehearse: bool) -> None:
        self.engine = engine
        run_cfg = engine.run_cfg
        self.ranks = self._make_ranks()
        # Decided against the GPUs the group can give: the Ray cluster's once joined, else this node's.
        gpus = self.ranks.gpus()
        gpus = visible_gpus() if gpus is None else gpus
        check_tensor_parallel(run_cfg.model, run_cfg.pipeline, run_cfg.train.device, gpus=gpus)
        engine.decide(gpus, self.ranks.where)
        self._note_setup(self.ranks.start(StageWorker, self._rank_kwargs(fail_at, rehearse=rehearse),
                                          device=engine.device))

    def _rank_kwargs(self, fail_at: tuple | None, *, rehearse: bool = False) -> list[dict]:
        """Each rank's StageWorker arguments: the resolved config, where to read the data (ranks in
        this process share the driver's corpus), and the rehearsals of the first start (`fail_at`,
        `rehearse`: the env hooks of `train.faults`)."""
        engine = self.engine
        data = {"corpus": engine.corpus} if self.ranks.one_process else \
            {"data_path": resolve_data_path(engine.run_cfg.train.data)}
        return [engine.rank_kwargs(rank, fail_at, **data, rehearse=rehearse) for rank in range(engine.world_size)]

    def _note_setup(self, descriptions: list[dict]) -> None:
        """Record the ranks' set-up replies (`StageWorker.describe`, in rank order); summary.json gets
        the parameters held per rank of replica 0 (one per pp rank; under tensor parallelism one per
        (pp, tp) rank, in global rank order: the shards of the split matrices, and every replicated
        parameter on each) and, for ranks on nodes, their nodes."""
        engine = self.engine
        engine.rank_descriptions = descriptions
        engine.backend = descriptions[0]["backend"]
        engine.static_extras["params_per_rank"] = [d["params"] for d in sorted(descriptions, key=lambda d: d["rank"])
                                                   if d["dp_rank"] == 0]
        self._transport_bytes_known = False
        if self.ranks.spans_nodes:
            engine.static_extras["nodes"] = [node_id for node_id, _ip in self.ranks.rank_nodes]
            engine.static_extras["node_addresses"] = [ip for _node_id, ip in self.ranks.rank_nodes]

    @property
    def per_rank_clocks(self) -> bool:
        return len({d["host"] for d in self.engine.rank_descriptions}) > 1

    def step(self, step: int, lr: float, want_events: bool, batches: list[RankBatch | None] | None) -> StepOutcome:
        before = self.ranks.bytes_exchanged
        batches = [None] * self.ranks.world_size if batches is None else batches
        replies = self.ranks.call("train_step", [(step, lr, batch, want_events) for batch in batches],
                                  what=f"step {step + 1}")
        driver_bytes = self.ranks.bytes_exchanged - before
        if self.ranks.spans_nodes and not self._transport_bytes_known:
            # The same every step (one plan): asked once per set of ranks.
            by_rank = self.ranks.call_all("transport_bytes", what="the transport byte counts")
            self.engine.static_extras["bytes_sent_per_step_by_transport"] = {
                way: sum(counts.get(way, 0) for counts in by_rank) for way in ("shm", "gloo")}
            self._transport_bytes_known = True
        return StepOutcome(replies, self.engine.run_cfg.pipeline.data_parallel, driver_bytes)

    def step_extras(self, step: int, outcome: StepOutcome, metrics: dict) -> dict:
        # summary.json's `lost_nodes`: each lost rank, its node and when
        return {"lost_nodes": list(self.ranks.lost_nodes)} if self.ranks.lost_nodes else {}

    def call_every(self, method: str, *args, what: str) -> list:
        return self.ranks.call_all(method, *args, what=what)

    # Every replica's ranks answer (a loss raises, for the loop's restart): each holds the whole
    # state, and each writes, probes or evaluates its own share.
    call_live = call_holder = call_every

    def call_ranks(self, method: str, per_rank_args: list[tuple], what: str) -> list:
        return self.ranks.call(method, per_rank_args, what=what)

    def load(self, step_dir: str) -> None:
        self.ranks.call_all("load_shard", step_dir, what="checkpoint load")

    def restart(self) -> None:
        self.ranks.restart(self._rank_kwargs(None))
        self._note_setup(self.ranks.setup_results)

    def close(self) -> None:
        """Stop the ranks (and a Ray instance the group started)."""
        if self.ranks is not None:
            self.ranks.stop(graceful=True)
