"""FtReplicaGroups: the replica policy (`train.replica_policy`) of a run whose D replicas are torchft
replica groups (`--fault-tolerance replicas`, docs/ray.md), under the one engine (`train.engine`).
Each replica's P x T ranks (P stages of T tensor-parallel ranks) are a
rank group of their own (local processes, or Ray actors in a placement group of their own; a
process group of their P x T ranks; `train.ft_groups`), each rank an `FtStageWorker` with a
torchft Manager; the policy starts one torchft Lighthouse for the job (or joins `--lighthouse`).

A step: the driver sends every live group `ft_step` and waits for the groups that are live. A
group whose rank is lost (WorkerLost) is stopped and started again in the background, alone; the
other groups' reduction with it fails, so their attempt does not commit and they train the same
step again with the quorum they have (`--min-replicas`, default 1), while the restarted group's
ranks build their chunks. Once started it is sent the step too: its ranks join the next quorum,
heal from a live group's same group rank (parameters, AdamW and RNG state, over torchft's
checkpoint transport) and commit that step with the others. A step's result is the committing groups'
replies: the loss is their share of the global batch's mean. When every group is lost the engine
raises WorkerLost, and the training loop restarts the whole job from its last checkpoint.

summary.json gets `participants_per_step` (the groups that committed each step), `replicas_equal`
(at the last step: every group's parameters, by sha256 of their bytes, equal) and `recoveries`
(per lost group: the step, seconds from the loss to the first step committed, to the first
committed without it, if any, and to its own first committed step after healing); metrics.jsonl
gets each step's `participants` and `replica_groups`. Under Ray, summary.json also gets
`replica_node_addresses` (each group's ranks' node addresses at the last step) and, after a loss,
`lost_nodes` (each lost rank: its replica, group rank, node, address and what it was doing).

Under Ray the groups may run on different nodes: the Lighthouse is advertised at the driver's node
address, and each group's store, ManagerServer and checkpoint server at its rank's node address
(`ft_worker`), so that no address depends on a host name resolving the same on every node.
"""

from __future__ import annotations

import time
from collections.abc import Container
from pathlib import Path

from attnres_pp.launch.launchers import make_rank_group
from attnres_pp.launch.rank_group import RankGroup
from attnres_pp.launch.resolve import require_torchft
from attnres_pp.pipeline.errors import WorkerLost
from attnres_pp.train import ft_lighthouse
from attnres_pp.train.checkpoint import read_meta
from attnres_pp.train.ft_groups import ReplicaGroup, public, replica_rank
from attnres_pp.train.ft_worker import FtStageWorker
from attnres_pp.train.rank_data import resolve_data_path
from attnres_pp.train.recovery import RunFailed
from attnres_pp.train.replica_policy import EngineSide, StepOutcome
from attnres_pp.train.stage_worker import RankBatch

_POLL_S = 0.005


class FtReplicaGroups:
    """The replica policy of a `--fault-tolerance replicas` run (`--launcher local` or `ray`;
    `address` and `placement` are Ray's). The engine's `fail_at` = (global rank, 0-based step): that
    rank exits mid-step, once (its group's restart has no failure); with a third item "allreduce" it
    exits instead as it would join the replicas' gradient reduction. Checkpoints are written at once
    (the groups' background writes are not wired); the trace keeps the driver's clock."""

    restartable = True
    background_saves = False
    per_rank_clocks = False

    def __init__(self, *, address: str | None = None, placement: str | None = None) -> None:
        require_torchft()  # a driver that builds the engine without the CLI hears it here too
        self._address, self._placement = address, placement
        self.participants_per_step: list[int] = []
        self.recoveries: list[dict] = []
        self.groups: list[ReplicaGroup] = []
        self._lighthouse = None

    def start(self, engine: EngineSide, *, fail_at: tuple | None, rehearse: bool) -> None:
        """Start one rank group per replica and the Lighthouse (`rehearse` is not taken: the
        replicas' rehearsal is `fail_at`)."""
        self.engine = engine
        # Replica groups run on cpu (torchft's gloo group): the launch layer decides so whatever the node has.
        engine.decide(gpus=0)
        pipe, train = engine.run_cfg.pipeline, engine.run_cfg.train
        # The rank groups first: under Ray the first one joins (or starts) the Ray instance, whose
        # address for the driver's node the Lighthouse is advertised at.
        for d in range(pipe.data_parallel):
            self.groups.append(ReplicaGroup(d, self._rank_group(d), FtStageWorker, []))
        lighthouse = train.lighthouse or self._start_lighthouse(train.min_replicas)
        engine.static_extras.update(fault_tolerance="replicas", lighthouse=lighthouse, min_replicas=train.min_replicas)
        data_path = resolve_data_path(train.data)
        for group in self.groups:
            group.kwargs = [engine.rank_kwargs(replica_rank(group.replica, index, self.group_size), fail_at,
                                               data_path=data_path, lighthouse=lighthouse,
                                               fail_in_allreduce=fail_at is not None and fail_at[2:] == ("allreduce",))
                            for index in range(self.group_size)]
            group.ranks.start(FtStageWorker, group.kwargs, device="cpu")
        described = self.groups[0].ranks.setup_results
        engine.backend = described[0]["backend"]
        engine.rank_descriptions = described
        engine.static_extras["params_per_rank"] = [r["params"] for r in described]

    def _rank_group(self, replica: int) -> RankGroup:
        """Replica `replica`'s P x T ranks on the launcher's rank group (the first group's Ray
        instance, when it starts one, has a CPU for every rank of the run)."""
        pipe = self.engine.run_cfg.pipeline
        return make_rank_group(pipe, self.group_size, name=f"attnres-pp-replica{replica}", address=self._address,
                               placement=self._placement, cpus=pipe.world_size)

    def _start_lighthouse(self, min_replicas: int) -> str:
        self._lighthouse, address = ft_lighthouse.start_lighthouse(min_replicas)
        if self.engine.run_cfg.pipeline.launcher != "ray":
            return address
        # Ranks on other nodes may not resolve this host's name (or resolve it to their loopback):
        # they are given the driver's node address, as the Ray cluster knows it.
        return ft_lighthouse.at_host(address, self.groups[0].ranks.driver_address())

    @property
    def group_size(self) -> int:
        """A replica group's ranks: P stages x T tensor-parallel ranks."""
        pipe = self.engine.run_cfg.pipeline
        return pipe.stages * pipe.tensor_parallel

    # ---- groups: loss, restart in the background, join ----
    def _lose(self, group: ReplicaGroup, lost: WorkerLost, step: int) -> None:
        group.lose(lost, step, self.group_size)

    def _poll_restarts(self) -> None:
        for group in self.groups:
            if group.poll_restart():
                self.recoveries.append(public(group.lost))

    def _send_steps(self, want_events: bool, states: tuple[str, ...] = ("live", "joining"),
                    answered: Container[int] = ()) -> None:
        """`ft_step` to every group in `states` without a step in flight, joining groups first: the
        Lighthouse forms a fast quorum of the last quorum's members once they are all there, so the
        live groups are sent theirs only once the joining groups' requests are at the Lighthouse.

        `answered`: the replicas whose reply to this attempt is collected but not yet judged. A
        joining group stays "joining" until its commit is judged; sent again in between, it would
        train the next step alone, its request waiting at the Lighthouse for groups that are done,
        and its late reply would be read as the answer to the engine's next call."""
        self._poll_restarts()
        joined = 0
        for wanted in ("joining", "live"):
            if wanted == "live" and joined and any(g.state == "live" and not g.in_flight for g in self.groups):
                self._await_quorum_requests(joined)
            for group in self.groups:
                if (group.state == wanted and wanted in states and not group.in_flight
                        and group.replica not in answered):
                    group.ranks.send("ft_step", [(want_events,)] * self.group_size)
                    group.in_flight = True
                    joined += wanted == "joining"

    def _await_quorum_requests(self, count: int) -> None:
        """Until the Lighthouse holds `count` quorum requests (its status page says how many), at most
        JOIN_WAIT_S; JOIN_LEAD_S where the page does not say."""
        deadline = time.monotonic() + ft_lighthouse.JOIN_WAIT_S
        while time.monotonic() < deadline:
            waiting = ft_lighthouse.lighthouse_requests(self.engine.static_extras["lighthouse"])
            if waiting is None:
                time.sleep(ft_lighthouse.JOIN_LEAD_S)
                return
            if waiting >= count:
                return
            time.sleep(_POLL_S)

    def _await_restarts(self) -> None:
        """Wait (up to the timeout) for the groups restarting, so that the run's last step heals them
        and every group ends with the trained state."""
        for group in self.groups:
            if group.state == "restarting":
                group.thread.join(timeout=self.engine.run_cfg.pipeline.timeout_s + 30)
        self._poll_restarts()

    def _collect(self, group: ReplicaGroup, step: int, results: dict) -> None:
        """`group`'s replies into `results` (a lost rank: the group restarts)."""
        group.in_flight = False
        try:
            results[group.replica] = group.ranks.gather(f"step {step + 1} of replica group {group.replica}")
        except WorkerLost as lost:
            self._lose(group, lost, step)
        except RuntimeError as error:  # a rank's step raised with its group alive: no quorum in --timeout
            self._stop_all()
            raise RunFailed(f"replica group {group.replica} failed at step {step + 1}: "
                            f"{(str(error).strip().splitlines() or [''])[-1]}") from error

    # ---- one step ----
    def step(self, step: int, lr: float, want_events: bool, batches: list[RankBatch | None] | None) -> StepOutcome:
        """Step `step` as the committing groups trained it (`lr`: the loop's, which every rank computes
        from the Manager's step alike). Driver-fed batches are not taken: each group reads its share."""
        if batches is not None:
            raise ValueError("a fault-tolerant run's groups read their own batches: pass inputs_BT=None")
        pipe = self.engine.run_cfg.pipeline
        before = self._driver_bytes()
        deadline = time.monotonic() + 2 * pipe.timeout_s + 60
        if step == self.engine.run_cfg.train.steps - 1:
            self._await_restarts()
        while True:
            self._send_steps(want_events)
            results: dict[int, list] = {}
            while any(g.in_flight and g.state == "live" for g in self.groups):
                # A group restarted meanwhile joins this step's quorum (under --min-replicas the live
                # groups wait for it there).
                self._send_steps(want_events, states=("joining",), answered=results)
                for group in self.groups:
                    if group.in_flight and group.ranks.replied():
                        self._collect(group, step, results)
                self._check_deadline(deadline, step)
                time.sleep(_POLL_S)
            committed = self._committed(results, step)
            if committed:
                participants = next(iter(committed.values()))[0][2]
                # A joining group in this quorum commits this step too: wait for its replies.
                while len(committed) < participants and any(g.in_flight for g in self.groups):
                    for group in self.groups:
                        if group.in_flight and group.ranks.replied():
                            self._collect(group, step, results)
                    committed = self._committed(results, step)
                    self._check_deadline(deadline, step)
                    time.sleep(_POLL_S)
                if step == self.engine.run_cfg.train.steps - 1:
                    self._heal_behind(step, committed)
                return self._result(step, committed, self._driver_bytes() - before)
            if all(g.state == "out" for g in self.groups) or not any(g.state in ("live", "joining", "restarting")
                                                                       for g in self.groups):
                raise WorkerLost(-1, f"every replica group was lost at step {step + 1}")
            if not any(g.state == "live" for g in self.groups):
                # Every group is restarting or joining: their Managers are at step 0, the run's state is gone.
                self._stop_all()
                raise WorkerLost(-1, f"every replica group was lost at step {step + 1}: no live group to heal from")
            self._check_deadline(deadline, step)

    def _heal_behind(self, step: int, committed: dict[int, list]) -> None:
        """After the run's last step: a group that answered it without committing (its reduction with
        the others failed) is one step behind them, and no later step's quorum would heal it. One more
        quorum round, without training, heals it from a committing group (parameters, AdamW and RNG
        state); the committing groups only serve their state. Groups with a step still in flight are
        left out (they never reached the last quorum)."""
        behind = [g for g in self.groups
                  if g.replica not in committed and g.state in ("live", "joining") and not g.in_flight]
        if not behind or not committed:
            return
        ready = behind + [g for g in self.groups if g.replica in committed]
        for group in ready:
            group.ranks.send("ft_heal", [()] * self.group_size)
        steps = {g.replica: g.ranks.gather("the heal round after the last step") for g in ready}
        if len({s for replies in steps.values() for s in replies}) != 1:
            raise RuntimeError(f"the heal round after step {step + 1} left the groups at different steps: {steps}")
        for group in behind:
            if group.state == "joining":
                self._rejoined(group, step + 1)

    def _committed(self, results: dict[int, list], step: int) -> dict[int, list]:
        """The groups of `results` that committed, made live; a committed step other than `step` is a bug."""
        committed = {}
        for replica, replies in results.items():
            group = self.groups[replica]
            if not all(reply[1] for reply in replies):
                continue
            if replies[0][0] != step:
                raise RuntimeError(f"replica group {replica} committed step {replies[0][0] + 1}, the run is at "
                                   f"step {step + 1}")
            if group.state == "joining":
                self._rejoined(group, step)
            committed[replica] = replies
        return committed

    def _rejoined(self, group: ReplicaGroup, step: int) -> None:
        """A joining group holds the live groups' state from `step` on: live, its recovery record closed."""
        group.lost["rejoined_at_step"] = step
        group.lost["rejoin_s"] = time.monotonic() - group.lost["lost_s"]
        group.lost.setdefault("first_commit_s", group.lost["rejoin_s"])
        self.recoveries.append(public(group.lost))
        group.lost, group.state = None, "live"

    def _check_deadline(self, deadline: float, step: int) -> None:
        if time.monotonic() > deadline:
            raise RuntimeError(f"no replica group committed step {step + 1} within {deadline:.0f} s of its start")

    def _result(self, step: int, committed: dict[int, list], driver_bytes: int) -> StepOutcome:
        replicas = sorted(committed)
        return StepOutcome([reply[3] for replica in replicas for reply in committed[replica]], len(replicas),
                           driver_bytes, replicas)

    def step_extras(self, step: int, outcome: StepOutcome, metrics: dict) -> dict:
        """The step's participants (metrics.jsonl), and summary.json's participants per step, recoveries,
        restarts, the groups' nodes and, at the last step, whether the replicas are equal."""
        replicas = outcome.committed
        for group in self.groups:  # since a group's loss: the first step committed, and without it
            if group.lost is None:
                continue
            group.lost.setdefault("first_commit_s", time.monotonic() - group.lost["lost_s"])
            if "shrunk_commit_s" not in group.lost and group.replica not in replicas:
                group.lost["shrunk_commit_s"] = time.monotonic() - group.lost["lost_s"]
        self.participants_per_step = [*self.participants_per_step[:step], len(replicas)]
        metrics.update(participants=len(replicas), replica_groups=replicas)
        extras = {"participants_per_step": list(self.participants_per_step), "recoveries": list(self.recoveries),
                  "replica_restarts": [g.restarts for g in self.groups]}
        if self.groups[0].ranks.spans_nodes:  # where each group's ranks run now, and each rank lost with its node
            extras["replica_node_addresses"] = [[ip for _node, ip in g.ranks.rank_nodes] for g in self.groups]
            lost = [{"replica": g.replica, **n} for g in self.groups for n in g.ranks.lost_nodes]
            if lost:
                extras["lost_nodes"] = lost
        if step == self.engine.run_cfg.train.steps - 1:
            extras["replicas_equal"] = self.replicas_equal()
        return extras

    def replicas_equal(self) -> bool:
        """Whether every one of the D groups is live and holds bitwise the same parameters."""
        if any(g.state != "live" or g.in_flight for g in self.groups):
            return False  # a group still in flight never reached the last quorum
        digests = {tuple(g.ranks.call_all("param_digest", what="the parameter digest")) for g in self.groups}
        return len(digests) == 1

    def _driver_bytes(self) -> int:
        return sum(g.ranks.bytes_exchanged for g in self.groups)

    # ---- calls: every group, every live group, or one live group for all (their parameters are equal) ----
    def call_every(self, method: str, *args, what: str) -> list:
        return [answer for g in self.groups for answer in g.ranks.call_all(method, *args, what=what)]

    def call_live(self, method: str, *args, what: str) -> list:
        """Every live group's answers (evaluation: each group reads its replica's rows)."""
        answers = []
        for group in self.groups:
            if group.state == "live" and not group.in_flight:
                try:
                    answers += group.ranks.call_all(method, *args, what=what)
                except WorkerLost as lost:
                    self._lose(group, lost, len(self.participants_per_step))
        if not answers:
            raise WorkerLost(-1, f"no live replica group for {what}")
        return answers

    def call_holder(self, method: str, *args, what: str) -> list:
        """One live group's P x T ranks (every group holds the same state)."""
        for group in self.groups:
            if group.state == "live" and not group.in_flight:
                try:
                    return group.ranks.call_all(method, *args, what=what)
                except WorkerLost as lost:
                    self._lose(group, lost, len(self.participants_per_step))
        raise WorkerLost(-1, f"no live replica group for {what}")

    def call_ranks(self, method: str, per_rank_args: list[tuple], what: str) -> list:
        raise ValueError(f"a fault-tolerant run's groups read their own batches: {what} of a driver-fed batch "
                         "needs --fault-tolerance off")

    def load(self, step_dir: str) -> None:
        """Every group loads the shards, and its Managers continue at the checkpoint's step."""
        meta = read_meta(Path(step_dir))
        steps_done = int(meta["steps_done"])
        extras = meta.get("extras", {})
        self.participants_per_step = list(extras.get("participants_per_step", []))[:steps_done]
        self.recoveries = [r for r in extras.get("recoveries", []) if r.get("lost_at_step", 0) < steps_done]
        for group in self.groups:
            group.ranks.call_all("load_shard", step_dir, what="checkpoint load")
            group.ranks.call_all("set_step", steps_done, what="checkpoint load")

    def restart(self) -> None:
        """Every group started again (the loop then loads the last checkpoint into them)."""
        self._stop_all()
        for group in self.groups:
            group.state, group.in_flight, group.lost = "live", False, None
            group.ranks.start(FtStageWorker, [{**k, "fail_at_step": None} for k in group.kwargs], device="cpu")

    def _stop_all(self, *, instance: bool = False) -> None:
        """Stop every group's ranks; `instance`: also a Ray instance the first group started (last)."""
        for group in reversed(self.groups):
            if group.thread is not None:
                group.thread.join(timeout=self.engine.run_cfg.pipeline.timeout_s + 30)
            if instance:
                group.ranks.stop(graceful=not group.in_flight)
            else:
                group.ranks.stop_ranks()
            group.in_flight = False

    def close(self) -> None:
        """Stop every group and the Lighthouse this policy started. Safe to call twice."""
        self._stop_all(instance=True)
        if self._lighthouse is not None:
            self._lighthouse.shutdown()
            self._lighthouse = None

