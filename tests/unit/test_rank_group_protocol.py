"""The `RankGroup` protocol (launch/rank_group.py): every rank group has every method it declares, and
the thread group's send / replied / gather (what the replica-group engine steps groups with) behave
as `call` does, split in two: results in rank order, the first cause of a failure raised. Threads
of this process only: nothing is started but the group's rank threads."""

from __future__ import annotations

import ast
import threading
import typing
from pathlib import Path

import pytest

import attnres_pp
from attnres_pp.launch.process_rank_group import ProcessRankGroup
from attnres_pp.launch.rank_group import RankGroup
from attnres_pp.launch.ray_rank_group import RayRankGroup
from attnres_pp.launch.thread_rank_group import ThreadRankGroup
from attnres_pp.launch.torchrun_rank_group import TorchrunRankGroup


def _declared_methods() -> set[str]:
    return {name for name, value in vars(RankGroup).items() if callable(value) and not name.startswith("_")}


def test_the_protocol_declares_what_the_engines_call():
    assert {"start", "call", "call_all", "send", "replied", "gather", "stop_ranks", "restart", "stop", "gpus",
            "driver_address"} <= _declared_methods()


def _used_of_ranks(source: str) -> set[str]:
    """The attribute names read through any `<...>.ranks.<name>` in `source`."""
    return {node.attr for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
            and node.value.attr == "ranks"}


def test_the_protocol_declares_every_member_the_engines_replica_policies_use():
    """Every `ranks.<name>` of the one engine's two replica policies is declared, so a rank group
    written against the protocol serves the engine under either; the scan sees an undeclared one."""
    package = Path(attnres_pp.__file__).parent
    used = set().union(*(_used_of_ranks((package / "train" / name).read_text())
                         for name in ("replica_policy.py", "ft_replicas.py")))
    declared = _declared_methods() | set(typing.get_type_hints(RankGroup))
    assert {"call", "send", "gather", "replied", "stop_ranks", "start", "lost_nodes"} <= used  # the scan works
    assert used - declared == set()
    assert _used_of_ranks("def f(self):\n    self.ranks.teleport(1)\n") - declared == {"teleport"}


@pytest.mark.parametrize("group_cls", [ProcessRankGroup, ThreadRankGroup, RayRankGroup, TorchrunRankGroup])
def test_every_rank_group_has_every_declared_method(group_cls):
    missing = sorted(name for name in _declared_methods() if not callable(getattr(group_cls, name, None)))
    assert not missing, f"{group_cls.__name__} lacks {missing}"
    attributes = set(typing.get_type_hints(RankGroup)) - {"world_size", "setup_results", "bytes_exchanged",
                                                          "rank_nodes", "lost_nodes"}  # set per instance
    assert all(hasattr(group_cls, name) for name in attributes), attributes


class _Worker:
    """A thread rank that squares numbers, and on request fails: rank 1 at once (an error), rank 0
    later (a refusal), so the later, lower-ranked refusal is the cause to report."""

    def __init__(self, rank: int, release: threading.Event) -> None:
        self.rank, self.release = rank, release

    def join_threads(self, device, transport, collectives, peers, tp_mesh=None) -> dict:
        self.peers = peers
        return {"rank": self.rank}

    def square(self, x: int) -> int:
        assert self.release.wait(10.0)
        return x * x

    def fail(self) -> None:
        if self.rank == 1:
            raise RuntimeError("rank 1 gave up: its peer left")
        assert self.release.wait(10.0)
        raise ValueError("rank 0: no room for this run")


def _started(release: threading.Event) -> ThreadRankGroup:
    group = ThreadRankGroup(2, stages=2, timeout_s=20.0)
    assert group.start(_Worker, [{"rank": r, "release": release} for r in range(2)]) == [{"rank": 0}, {"rank": 1}]
    return group


def test_thread_group_send_then_gather_returns_results_in_rank_order():
    release = threading.Event()
    group = _started(release)
    try:
        group.send("square", [(2,), (3,)])
        assert not group.replied()  # both ranks wait for the release
        release.set()
        assert group.gather("squares") == [4, 9]
        assert group.call_all("square", 5) == [25, 25]  # the shared call, over send and gather
        assert group.bytes_exchanged > 0
    finally:
        group.stop(graceful=True)


def test_thread_group_gather_raises_the_lowest_ranks_refusal_over_an_earlier_error():
    release = threading.Event()
    group = _started(release)
    try:
        group.send("fail", [(), ()])
        for _ in range(200):  # rank 1's error comes first
            if group.replied():
                break
            threading.Event().wait(0.01)
        assert group.replied()
        release.set()
        with pytest.raises(ValueError, match="^rank 0: no room for this run$"):
            group.gather("the failing call")
    finally:
        group.stop(graceful=True)
