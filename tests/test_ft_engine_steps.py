"""FtEngine's step loop against scripted replica groups (no process, no torchft): the order in which
groups answer is chosen here, so the interleavings that a loaded machine produces only now and
then are run every time.

The case that matters: a group rejoining after a restart ("joining") answers before the live group
does. Its reply is collected while the loop still waits for the live group; it must not be sent the
step again then (it would train the next step alone, wait at the Lighthouse for groups that are
done, and its late reply would be read as the answer to the engine's next call)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from attnres_pp.train import ft_engine
from attnres_pp.train.ft_engine import FtEngine
from attnres_pp.train.ft_groups import ReplicaGroup

STAGES = 2


class ScriptedRanks:
    """A group's ranks: each `send` of ft_step takes the next scripted reply, which `replied` reports
    after `polls` polls; `gather` returns it from every rank as (step, committed, participants, reply)."""

    def __init__(self, replies: list[tuple[int, int, bool, int]]) -> None:
        self.replies = list(replies)  # (polls, step, committed, participants), one per send
        self.sent: list[str] = []
        self.pending: list | None = None
        self.bytes_exchanged = 0
        self.spans_nodes = False

    def send(self, method: str, per_rank_args: list[tuple]) -> None:
        assert self.pending is None, "a step sent to a group that has one in flight"
        if not self.replies:
            raise AssertionError(f"{method} sent more often than scripted ({len(self.sent)} sends)")
        self.sent.append(method)
        polls, *reply = self.replies.pop(0)
        self.pending = [polls, tuple(reply)]

    def replied(self) -> bool:
        if self.pending is None:
            return False
        self.pending[0] -= 1
        return self.pending[0] <= 0

    def gather(self, what: str) -> list:
        reply, self.pending = self.pending[1], None
        return [(*reply, f"reply of pp rank {p}") for p in range(STAGES)]


def _engine(monkeypatch, groups: list[ReplicaGroup], steps: int = 8) -> FtEngine:
    engine = FtEngine.__new__(FtEngine)  # the step loop only: no ranks, no Lighthouse
    engine.run_cfg = SimpleNamespace(pipeline=SimpleNamespace(stages=STAGES, timeout_s=10.0),
                                     train=SimpleNamespace(steps=steps))
    engine.groups = groups
    engine.static_extras = {"lighthouse": "http://lighthouse.invalid:1"}
    engine.participants_per_step, engine.recoveries = [], []
    engine.record_timelines, engine.out_dir, engine._trace_step = False, None, 1
    monkeypatch.setattr(ft_engine, "_POLL_S", 0.0)
    # Every joining group's request is at the Lighthouse as soon as it is sent.
    monkeypatch.setattr(ft_engine, "lighthouse_requests", lambda address: 99)
    monkeypatch.setattr(FtEngine, "_result", lambda self, step, committed, driver_bytes: sorted(committed))
    return engine


def _joining(replica: int, ranks: ScriptedRanks) -> ReplicaGroup:
    group = ReplicaGroup(replica, ranks, object, [], state="joining", restarts=1)
    group.lost = {"replica": replica, "lost_at_step": 1, "cause": "scripted", "lost_s": time.monotonic()}
    return group


@pytest.mark.parametrize("joining_first", [True, False], ids=["joining-answers-first", "live-answers-first"])
def test_a_rejoining_group_is_sent_its_step_once_whichever_group_answers_first(monkeypatch, joining_first):
    live = ScriptedRanks([(40 if joining_first else 1, 3, True, 2)])
    joining = ScriptedRanks([(1 if joining_first else 40, 3, True, 2)])
    groups = [ReplicaGroup(0, live, object, []), _joining(1, joining)]
    engine = _engine(monkeypatch, groups)
    assert engine.train_step(3, None, None, 1e-3) == [0, 1]
    assert live.sent == ["ft_step"] and joining.sent == ["ft_step"]
    assert [g.state for g in groups] == ["live", "live"] and not any(g.in_flight for g in groups)
    assert engine.recoveries[0]["rejoined_at_step"] == 3


def test_a_group_whose_attempt_did_not_commit_waits_for_the_next_quorum(monkeypatch):
    """The live group's attempt does not commit (its reduction with the rejoining group failed)
    while the rejoining group commits: the step is the rejoining group's, and the live group is not
    sent it again (behind by one step, it heals from the other at the next quorum)."""
    live = ScriptedRanks([(3, 3, False, 2)])
    joining = ScriptedRanks([(1, 3, True, 2)])
    groups = [ReplicaGroup(0, live, object, []), _joining(1, joining)]
    engine = _engine(monkeypatch, groups)
    assert engine.train_step(3, None, None, 1e-3) == [1]
    assert live.sent == ["ft_step"] and joining.sent == ["ft_step"]
    assert not any(g.in_flight for g in groups)


def test_no_call_reaches_a_group_with_a_step_in_flight(monkeypatch):
    groups = [ReplicaGroup(0, ScriptedRanks([]), object, []), ReplicaGroup(1, ScriptedRanks([]), object, [])]
    groups[1].in_flight = True
    engine = _engine(monkeypatch, groups)
    with pytest.raises(RuntimeError, match="replica group 1 still has a step in flight: the parameter digest"):
        engine.replicas_equal()
