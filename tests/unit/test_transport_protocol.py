"""Every transport class implements `comm.transport_protocol.Transport` (and its ledger `Ledger`):
each member the executor and the workers use is there, with the protocol's parameters, so callers
never probe a transport with getattr/hasattr."""

from __future__ import annotations

import inspect

import pytest
import torch

from attnres_pp.comm.nccl_transport import BatchedDistTransport
from attnres_pp.comm.pair_transport import PairLedger, PairTransport
from attnres_pp.comm.shm_transport import SharedMemoryTransport
from attnres_pp.comm.transport import ByteLedger, DistTransport, LoopbackTransport
from attnres_pp.comm.transport_protocol import Ledger, Transport
from attnres_pp.pipeline.loopback_nccl import NcclLoopbackTransport
from attnres_pp.schedule.validate_nccl import NcclP2P

CPU = torch.device("cpu")

# Each transport class, built without a process group (none of them talks to a peer at construction).
TRANSPORTS = {
    "loopback": lambda: LoopbackTransport(0, {}),
    "nccl_loopback": lambda: NcclLoopbackTransport(0, NcclP2P(2)),
    "dist": lambda: DistTransport(0, 1.0, CPU),
    "batched_nccl": lambda: BatchedDistTransport(0, 1.0, CPU),
    "shm": lambda: SharedMemoryTransport(0, 1.0, {}, {}),
    "pair_over_dist": lambda: PairTransport(DistTransport(0, 1.0, CPU)),
    "pair_over_shm": lambda: PairTransport(SharedMemoryTransport(0, 1.0, {}, {})),
}


def _members(protocol: type) -> list[str]:
    own = set(vars(protocol)) | set(getattr(protocol, "__annotations__", {}))
    return sorted(name for name in own if not name.startswith("_"))


def _parameters(function) -> list[str]:
    return [p for p in inspect.signature(function).parameters if p != "self"]


@pytest.mark.parametrize("name", sorted(TRANSPORTS))
def test_every_transport_satisfies_the_protocol(name):
    transport = TRANSPORTS[name]()
    assert isinstance(transport, Transport)
    assert isinstance(transport.ledger, Ledger)
    for member in _members(Transport):
        value = getattr(type(transport), member, None)
        protocol_value = vars(Transport).get(member)
        if callable(protocol_value):  # a method: the same parameters, by name and order
            assert callable(value), f"{name}: {member} is not a method"
            assert _parameters(value) == _parameters(protocol_value), f"{name}.{member}"
    assert transport.p2p_semantics in ("gloo", "nccl")
    assert isinstance(transport.can_prepost, bool) and transport.pp_rank == 0
    assert transport.ledger.bytes_by_transport() == {"gloo": 0} or set(transport.ledger.bytes_by_transport()) == {
        "shm", "gloo"}
    transport.close()


def test_the_protocol_names_what_the_executor_uses():
    # A transport that lacks any of these would fail at the first message of some run (or, for
    # message_slots, when the runtime sets up its activation meter).
    assert set(_members(Transport)) == {"pp_rank", "ledger", "can_prepost", "p2p_semantics", "send", "ready",
                                        "prepost_recv", "recv", "begin_group", "end_group", "flush", "close",
                                        "message_slots"}


def test_a_class_missing_a_method_is_not_a_transport():
    class Partial:
        pp_rank, ledger, can_prepost, p2p_semantics = 0, ByteLedger(), False, "gloo"

        def send(self, tensors, dst, tag, label):
            pass

    assert not isinstance(Partial(), Transport)


@pytest.mark.parametrize("ledger", [ByteLedger(), PairLedger()])
def test_every_ledger_counts_bytes_by_way(ledger):
    assert isinstance(ledger, Ledger)
    ledger.record("fwd", 0, 0, [torch.zeros(4)])
    assert ledger.total_bytes == 16
    assert ledger.bytes_by_transport()["gloo"] == 16  # a plain ledger, and a pair's default way
    ledger.clear()
    assert ledger.total_bytes == 0
