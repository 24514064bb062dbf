"""The shared-memory transport between two spawned ranks (gloo for the setup and for messages it
has no slot for): payloads arrive intact, as views of the message's slot (no copy), in any order,
step after step; an unknown message goes over gloo; a peer that exits ends a wait at once; with
ATTNRES_PP_SHM=0, or an emulated slow link (whose delay DistTransport applies), the ranks agree on
plain DistTransport."""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback

import pytest
import torch

pytestmark = pytest.mark.distributed

SHAPES = (torch.Size((2, 3, 4)), torch.Size((2, 3, 4)))
MESSAGES = [(0, 1, 5, SHAPES), (0, 1, 7, SHAPES[:1]), (1, 0, 6, SHAPES)]


def _rank(pp_rank: int, init_method: str, scenario: str, results) -> None:
    import torch.distributed as dist

    from attnres_pp.comm.link import LinkModel
    from attnres_pp.comm.shm_transport import SharedMemoryTransport, connect_transport
    from attnres_pp.comm.transport import TransportTimeout

    try:
        if scenario == "gloo":
            os.environ["ATTNRES_PP_SHM"] = "0"
        dist.init_process_group("gloo", init_method=init_method, rank=pp_rank, world_size=2)
        link = LinkModel(gbps=100.0) if scenario == "link" else None
        transport = connect_transport(pp_rank, 2, torch.device("cpu"), 30.0, MESSAGES, torch.float32, link=link)
        out = {"shm": isinstance(transport, SharedMemoryTransport), "link": transport.link_clock is not None}
        if scenario == "peer_exits":
            if pp_rank == 0:
                os._exit(0)  # leaves without sending message 5
            try:
                transport.recv(list(SHAPES), torch.float32, 0, 5)
            except TransportTimeout as error:
                out["error"] = str(error)
            results.put((pp_rank, out))
            return
        for step in range(3):
            if pp_rank == 0:
                a, b = torch.full(SHAPES[0], float(step)), torch.arange(24.0).view(SHAPES[1]) + step
                transport.send([a, b], 1, 5, ("fwd", 0, 0))
                transport.send([a * 2], 1, 7, ("fwd", 0, 1))
                transport.send([a, a, b], 1, 99, ("fwd", 0, 2))  # no slot: over gloo
                back = transport.recv(list(SHAPES), torch.float32, 1, 6)
                out[f"back {step}"] = [t.numpy().copy() for t in back]  # numpy: no shared tensors in a Queue
            else:
                transport.prepost_recv([SHAPES[0]] * 2 + [SHAPES[1]], torch.float32, 0, 99)
                late = transport.recv([SHAPES[0]], torch.float32, 0, 7)  # out of send order
                first = transport.recv(list(SHAPES), torch.float32, 0, 5)
                extra = transport.recv([SHAPES[0]] * 2 + [SHAPES[1]], torch.float32, 0, 99)
                out[f"got {step}"] = [t.numpy().copy() for t in (*first, *late, *extra)]
                out[f"ptr {step}"] = [t.data_ptr() for t in first]
                transport.send([first[1], first[0]], 0, 6, ("bwd", 0, 0))
            transport.flush()
            dist.barrier()  # the step boundary: a slot is written again only in the next step
        out["ledger"] = list(transport.ledger.records)
        if hasattr(transport, "close"):
            transport.close()
        dist.destroy_process_group()
        results.put((pp_rank, out))
    except Exception:
        results.put((pp_rank, traceback.format_exc()))


def _run(scenario: str, tmp_path, ranks: int = 2) -> dict:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, f"file://{tmp_path}/rendezvous", scenario, results), daemon=True)
             for r in range(2)]
    for proc in procs:
        proc.start()
    try:
        out = dict(results.get(timeout=120) for _ in range(ranks))
    finally:
        for proc in procs:
            proc.join(timeout=20)
            if proc.is_alive():
                proc.terminate()
    for rank, value in out.items():
        assert not isinstance(value, str), f"rank {rank} failed:\n{value}"
    return out


@pytest.mark.parametrize("scenario", ["shm", "gloo", "link"])
def test_messages_arrive_intact_step_after_step(tmp_path, scenario):
    out = _run(scenario, tmp_path)
    assert out[0]["shm"] == out[1]["shm"] == (scenario == "shm")
    assert out[0]["link"] == out[1]["link"] == (scenario == "link")
    for step in range(3):
        a, b = torch.full(SHAPES[0], float(step)), torch.arange(24.0).view(SHAPES[1]) + step
        got = [torch.from_numpy(x) for x in out[1][f"got {step}"]]
        for tensor, want in zip(got, (a, b, a * 2, a, a, b), strict=True):
            assert torch.equal(tensor, want)
        back = [torch.from_numpy(x) for x in out[0][f"back {step}"]]
        assert torch.equal(back[0], b) and torch.equal(back[1], a)
    if scenario == "shm":  # the receiver's tensors are the slot itself, the same memory every step
        assert out[1]["ptr 0"] == out[1]["ptr 1"] == out[1]["ptr 2"]
    # The ledger counts every payload, whatever carried it.
    assert sorted(r[4] for r in out[0]["ledger"]) == sorted([2 * 96, 96, 3 * 96] * 3)


def test_a_peer_that_exits_ends_the_wait(tmp_path):
    out = _run("peer_exits", tmp_path, ranks=1)
    assert out[1]["shm"] and "rank 0 closed its end before sending message 5" in out[1]["error"]
    assert not [name for name in os.listdir("/dev/shm") if name.startswith("attnres-pp-")]
