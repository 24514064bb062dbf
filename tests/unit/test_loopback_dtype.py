"""The in-process loopback transports refuse a message whose dtype is not the one its receiver
expects (naming the message and both dtypes) instead of casting it: over NCCL the same mismatch
would receive the bytes into a buffer of another size and hang."""

from __future__ import annotations

import pytest
import torch

from attnres_pp.comm.transport import LoopbackTransport
from attnres_pp.pipeline.loopback_nccl import NcclLoopbackTransport
from attnres_pp.schedule.validate_nccl import NcclP2P

SHAPES = [torch.Size((2, 3)), torch.Size((2, 3))]
LABEL = ("fwd", 0, 1)


def _payload(dtype: torch.dtype) -> list[torch.Tensor]:
    return [torch.arange(6.0).view(2, 3).to(dtype), torch.ones(2, 3, dtype=dtype)]


@pytest.mark.parametrize(("sent", "expected"), [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)])
def test_loopback_refuses_a_dtype_mismatch(sent, expected):
    mailbox: dict = {}
    sender, receiver = LoopbackTransport(0, mailbox), LoopbackTransport(1, mailbox)
    sender.send(_payload(sent), 1, 3, LABEL)
    with pytest.raises(TypeError, match=rf"rank 1: message with tag 3 from rank 0 carries {sent}, the receiver "
                                        rf"expects {expected}"):
        receiver.recv(SHAPES, expected, 0, 3)


def test_loopback_delivers_a_matching_dtype_unchanged():
    mailbox: dict = {}
    sender, receiver = LoopbackTransport(0, mailbox), LoopbackTransport(1, mailbox)
    sender.send(_payload(torch.bfloat16), 1, 3, LABEL)
    got = receiver.recv(SHAPES, torch.bfloat16, 0, 3)
    assert all(g.dtype == torch.bfloat16 and torch.equal(g, w) for g, w in zip(got, _payload(torch.bfloat16),
                                                                              strict=True))


@pytest.mark.parametrize("expected", [torch.bfloat16, torch.float32])
def test_nccl_loopback_refuses_a_dtype_mismatch_and_passes_a_match(expected):
    fabric = NcclP2P(2)
    sender, receiver = NcclLoopbackTransport(0, fabric), NcclLoopbackTransport(1, fabric)
    receiver.prepost_recv(SHAPES, expected, 0, 7)
    sender.send(_payload(torch.float32), 1, 7, LABEL)
    assert receiver.ready(0, 7)
    if expected == torch.float32:
        assert torch.equal(receiver.recv(SHAPES, expected, 0, 7)[0], _payload(torch.float32)[0])
        return
    with pytest.raises(TypeError, match=r"rank 1: message with tag 7 from rank 0 carries torch.float32, the "
                                        r"receiver expects torch.bfloat16"):
        receiver.recv(SHAPES, expected, 0, 7)
