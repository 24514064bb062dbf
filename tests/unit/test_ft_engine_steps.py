"""The torchft replica policy's step loop (`FtReplicaGroups.step`) against scripted replica groups
(no process, no torchft): the order in which groups answer is chosen here, so the interleavings
that a loaded machine produces only now and then are run every time.

The case that matters: a group rejoining after a restart ("joining") answers before the live group
does. Its reply is collected while the loop still waits for the live group; it must not be sent the
step again then (it would train the next step alone, wait at the Lighthouse for groups that are
done, and its late reply would be read as the answer to the engine's next call). At the last step a
group left one step behind is healed by one more quorum round."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from attnres_pp.train import ft_lighthouse, ft_replicas
from attnres_pp.train.ft_groups import ReplicaGroup
from attnres_pp.train.ft_replicas import FtReplicaGroups

STAGES = 2


class ScriptedRanks:
    """A group's ranks: each `send` takes the next scripted (method, polls, reply), which `replied`
    reports after `polls` polls and `gather` returns from every rank; ft_step's reply is
    (step, committed, participants)."""

    def __init__(self, script: list[tuple]) -> None:
        self.script = list(script)
        self.sent: list[str] = []
        self.pending: list | None = None
        self.bytes_exchanged = 0
        self.spans_nodes = False

    def send(self, method: str, per_rank_args: list[tuple]) -> None:
        assert self.pending is None, f"{method} sent to a group that has a call in flight"
        if not self.script:
            raise AssertionError(f"{method} sent after the script ended (sent: {self.sent})")
        want, polls, reply = self.script.pop(0)
        assert method == want, f"{method} sent where the script has {want} (sent: {self.sent})"
        self.sent.append(method)
        self.pending = [polls, reply]

    def replied(self) -> bool:
        if self.pending is None:
            return False
        self.pending[0] -= 1
        return self.pending[0] <= 0

    def gather(self, what: str) -> list:
        reply, self.pending = self.pending[1], None
        if isinstance(reply, tuple):  # ft_step: and the rank's StepReply
            return [(*reply, f"reply of pp rank {p}") for p in range(STAGES)]
        return [reply] * STAGES

    def call_all(self, method: str, *args, what: str | None = None) -> list:
        self.send(method, [args] * STAGES)
        return self.gather(what or method)


def step_reply(polls: int, step: int, committed: bool, participants: int) -> tuple:
    return ("ft_step", polls, (step, committed, participants))


def _engine(monkeypatch, groups: list[ReplicaGroup], steps: int = 8) -> FtReplicaGroups:
    engine = FtReplicaGroups.__new__(FtReplicaGroups)  # the step loop only: no ranks, no Lighthouse
    run_cfg = SimpleNamespace(pipeline=SimpleNamespace(stages=STAGES, tensor_parallel=1, timeout_s=10.0),
                              train=SimpleNamespace(steps=steps))
    engine.engine = SimpleNamespace(run_cfg=run_cfg, static_extras={"lighthouse": "http://lighthouse.invalid:1"})
    engine.groups = groups
    engine.participants_per_step, engine.recoveries = [], []
    monkeypatch.setattr(ft_replicas, "_POLL_S", 0.0)
    # Every joining group's request is at the Lighthouse as soon as it is sent.
    monkeypatch.setattr(ft_lighthouse, "lighthouse_requests", lambda address: 99)
    monkeypatch.setattr(FtReplicaGroups, "_result", lambda self, step, committed, driver_bytes: sorted(committed))
    return engine


def _joining(replica: int, ranks: ScriptedRanks) -> ReplicaGroup:
    group = ReplicaGroup(replica, ranks, object, [], state="joining", restarts=1)
    group.lost = {"replica": replica, "lost_at_step": 1, "cause": "scripted", "lost_s": time.monotonic()}
    return group


@pytest.mark.parametrize("joining_first", [True, False], ids=["joining-answers-first", "live-answers-first"])
def test_a_rejoining_group_is_sent_its_step_once_whichever_group_answers_first(monkeypatch, joining_first):
    live = ScriptedRanks([step_reply(40 if joining_first else 1, 3, True, 2)])
    joining = ScriptedRanks([step_reply(1 if joining_first else 40, 3, True, 2)])
    groups = [ReplicaGroup(0, live, object, []), _joining(1, joining)]
    engine = _engine(monkeypatch, groups)
    assert engine.step(3, 1e-3, False, None) == [0, 1]
    assert live.sent == ["ft_step"] and joining.sent == ["ft_step"]
    assert [g.state for g in groups] == ["live", "live"] and not any(g.in_flight for g in groups)
    assert engine.recoveries[0]["rejoined_at_step"] == 3


def test_a_group_whose_attempt_did_not_commit_waits_for_the_next_quorum(monkeypatch):
    """The live group's attempt does not commit (its reduction with the rejoining group failed)
    while the rejoining group commits: the step is the rejoining group's, and the live group is not
    sent it again (behind by one step, it heals from the other at the next quorum)."""
    live = ScriptedRanks([step_reply(3, 3, False, 2)])
    joining = ScriptedRanks([step_reply(1, 3, True, 2)])
    groups = [ReplicaGroup(0, live, object, []), _joining(1, joining)]
    engine = _engine(monkeypatch, groups)
    assert engine.step(3, 1e-3, False, None) == [1]
    assert live.sent == ["ft_step"] and joining.sent == ["ft_step"]
    assert not any(g.in_flight for g in groups)


def test_a_group_behind_after_the_last_step_is_healed_by_one_more_quorum_round(monkeypatch):
    """The same at the run's last step, where no later quorum would heal the live group: every
    group joins one more quorum round without training (the behind group heals from the committed
    one), and all end at the same step."""
    live = ScriptedRanks([step_reply(3, 7, False, 2), ("ft_heal", 1, 8)])
    joining = ScriptedRanks([step_reply(1, 7, True, 2), ("ft_heal", 1, 8)])
    groups = [ReplicaGroup(0, live, object, []), _joining(1, joining)]
    engine = _engine(monkeypatch, groups, steps=8)
    assert engine.step(7, 1e-3, False, None) == [1]
    assert live.sent == ["ft_step", "ft_heal"] and joining.sent == ["ft_step", "ft_heal"]
    assert [g.state for g in groups] == ["live", "live"] and not any(g.in_flight for g in groups)


def test_the_last_step_committed_by_all_needs_no_heal_round(monkeypatch):
    live, other = ScriptedRanks([step_reply(2, 7, True, 2)]), ScriptedRanks([step_reply(1, 7, True, 2)])
    engine = _engine(monkeypatch, [ReplicaGroup(0, live, object, []), ReplicaGroup(1, other, object, [])])
    assert engine.step(7, 1e-3, False, None) == [0, 1]
    assert live.sent == other.sent == ["ft_step"]


def test_a_group_with_a_step_in_flight_is_not_called_and_not_equal(monkeypatch):
    """A group whose step is still in flight at the end never reached the last quorum: the replicas
    are not equal, and no call is sent to it (its reply would be read as the call's answer)."""
    groups = [ReplicaGroup(0, ScriptedRanks([]), object, []), ReplicaGroup(1, ScriptedRanks([]), object, [])]
    groups[1].in_flight = True
    engine = _engine(monkeypatch, groups)
    assert engine.replicas_equal() is False
    assert groups[0].ranks.sent == [] and groups[1].ranks.sent == []


def test_equal_digests_make_equal_replicas(monkeypatch):
    same = [ReplicaGroup(d, ScriptedRanks([("param_digest", 1, "ab")]), object, []) for d in range(2)]
    assert _engine(monkeypatch, same).replicas_equal() is True
    other = [ReplicaGroup(d, ScriptedRanks([("param_digest", 1, digest)]), object, [])
             for d, digest in enumerate(("ab", "cd"))]
    assert _engine(monkeypatch, other).replicas_equal() is False
