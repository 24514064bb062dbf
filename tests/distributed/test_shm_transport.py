"""The shared-memory transport between two spawned ranks (gloo for the setup and for messages it
has no slot for): payloads arrive intact, as views of the message's slot (no copy), in any order,
step after step; an unknown message goes over gloo; a peer that exits ends a wait at once; with
ATTNRES_PP_SHM=0, or an emulated slow link (whose delay DistTransport applies), the ranks agree on
plain DistTransport."""

from __future__ import annotations

import os
import shutil
import traceback

import pytest
import torch

from tests.spawn_helpers import spawn_ranks

pytestmark = pytest.mark.distributed

SHAPES = (torch.Size((2, 3, 4)), torch.Size((2, 3, 4)))
MESSAGES = [(0, 1, 5, SHAPES), (0, 1, 7, SHAPES[:1]), (1, 0, 6, SHAPES)]


def _rank(pp_rank: int, init_method: str, scenario: str, directory: str, results) -> None:
    import torch.distributed as dist

    from attnres_pp.comm.link import LinkModel
    from attnres_pp.comm.shm_transport import SharedMemoryTransport, connect_transport
    from attnres_pp.comm.transport import TransportTimeout

    try:
        if scenario == "gloo":
            os.environ["ATTNRES_PP_SHM"] = "0"
        dist.init_process_group("gloo", init_method=init_method, rank=pp_rank, world_size=2)
        link = LinkModel(gbps=100.0) if scenario == "link" else None
        transport = connect_transport(pp_rank, 2, torch.device("cpu"), 30.0, MESSAGES, torch.float32, link=link,
                                      directory=directory)
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


def _run(scenario: str, tmp_path, ranks: int = 2, directory: str = "/dev/shm") -> dict:
    return dict(spawn_ranks(_rank, 2, tmp_path, scenario, directory, replies=ranks))


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
    import tempfile

    # A directory of its own in /dev/shm: other tests' ranks (the other xdist worker) use /dev/shm too.
    directory = tempfile.mkdtemp(prefix="attnres-pp-test-", dir="/dev/shm")
    try:
        out = _run("peer_exits", tmp_path, ranks=1, directory=directory)
        assert out[1]["shm"] and "rank 0 closed its end before sending message 5" in out[1]["error"]
        assert os.listdir(directory) == []
    finally:
        shutil.rmtree(directory, ignore_errors=True)


# ---- guards, in this process: a hand-made pair (counters, one slot, a pipe) ----

def _pair(n_messages: int = 1):
    from attnres_pp.comm.shm_transport import SlotPair

    read_fd, write_fd = os.pipe()
    os.set_blocking(read_fd, False)
    os.set_blocking(write_fd, False)
    views = {5 + i: (torch.zeros(4),) for i in range(n_messages)}
    return SlotPair(views, {tag: i for i, tag in enumerate(views)}, torch.zeros(n_messages + 1, dtype=torch.int64),
                 read_fd), read_fd, write_fd


def test_a_receive_refuses_a_counter_other_than_the_one_it_expects():
    from attnres_pp.comm.shm_transport import MessageOutOfStep, SharedMemoryTransport

    pair, read_fd, write_fd = _pair()
    transport = SharedMemoryTransport(1, 1.0, {0: pair}, {})
    try:
        pair.counters[0] = 1  # the first send: read as it should be
        assert transport.recv([torch.Size((4,))], torch.float32, 0, 5)[0].shape == (4,)
        pair.counters[0] = 3  # the sender is one send ahead: the slot holds send 3, this is receive 2
        with pytest.raises(MessageOutOfStep, match="rank 1: message 5 from rank 0 has been sent 3 times, but this "
                                                   "rank has received it 1 times: rank 0 is 1 send"):
            transport.recv([torch.Size((4,))], torch.float32, 0, 5)
    finally:
        os.close(write_fd)
        transport.close()


@pytest.mark.parametrize("flag_up", [False, True], ids=["receiver-left", "receiver-died-waiting"])
def test_a_doorbell_to_a_closed_receiver(flag_up):
    """A receiver that has seen its message (flag down) and closed its end is no error for the sender
    (under load its close can come before the sender's bell); one that died inside its wait is."""
    from attnres_pp.comm.shm_transport import PeerGone, SharedMemoryTransport

    pair, read_fd, write_fd = _pair()
    pair.fd = write_fd  # the sender's end
    os.close(read_fd)
    transport = SharedMemoryTransport(0, 1.0, {}, {1: pair})
    pair.counters[pair.waiting] = int(flag_up)
    try:
        if flag_up:
            with pytest.raises(PeerGone, match="rank 0: rank 1 exited while waiting for a message from this rank"):
                transport.send([torch.ones(4)], 1, 5, ("fwd", 0, 0))
            assert pair.counters[0] == 1 and torch.equal(pair.views[5][0], torch.ones(4))  # written before the bell
        else:
            transport._ring(pair, 1, 5)  # what send does once it has seen the flag up: no error
    finally:
        transport.close()


# ---- set-up failures, between spawned ranks: nothing of the run is left behind ----

def _setup_rank(pp_rank: int, init_method: str, scenario: str, directory: str, results) -> None:
    import datetime
    import shutil
    import signal

    import torch.distributed as dist

    from attnres_pp.comm.shm_transport import SharedMemoryTransport, connect_transport

    try:
        dist.init_process_group("gloo", init_method=init_method, rank=pp_rank, world_size=2,
                                timeout=datetime.timedelta(seconds=30))
        messages = MESSAGES
        if scenario.startswith("kill"):  # this rank dies after the first set-up barrier, before the second
            victim, calls, gather = int(scenario[-1]), [0], dist.all_gather_object

            def dying_gather(*args, **kwargs):
                calls[0] += 1
                if pp_rank == victim and calls[0] == 3:  # the host facts, the allocation, then the opening
                    os.kill(os.getpid(), signal.SIGKILL)
                return gather(*args, **kwargs)

            dist.all_gather_object = dying_gather
        if scenario == "full":  # the free-space check saw room that was gone by the allocation
            messages = [(0, 1, 5, (torch.Size((64, 1024)),)), (1, 0, 6, (torch.Size((8,)),))]
            usage = shutil.disk_usage(directory)
            shutil.disk_usage = lambda path: usage._replace(free=1 << 40)
        try:
            transport = connect_transport(pp_rank, 2, torch.device("cpu"), 30.0, messages, torch.float32,
                                          directory=directory)
        except Exception as error:
            results.put((pp_rank, {"error": f"{type(error).__name__}: {error}"}))
            return
        out = {"shm": isinstance(transport, SharedMemoryTransport)}
        if scenario == "fill":  # the tmpfs fills up once the slots exist: their pages are already theirs
            if pp_rank == 0:
                with open(os.path.join(directory, "filler"), "wb", buffering=0) as filler:
                    with pytest.raises(OSError, match="No space left"):
                        while True:
                            filler.write(b"\1" * 4096)
            dist.barrier()
            for step in range(2):
                if pp_rank == 0:
                    transport.send([torch.full(SHAPES[0], float(step))] * 2, 1, 5, ("fwd", 0, 0))
                    out[f"back {step}"] = transport.recv(list(SHAPES), torch.float32, 1, 6)[0].sum().item()
                else:
                    got = transport.recv(list(SHAPES), torch.float32, 0, 5)
                    out[f"got {step}"] = got[1].sum().item()
                    transport.send([got[0] + 1, got[1]], 0, 6, ("bwd", 0, 0))
                transport.flush()
                dist.barrier()
        transport.close()
        dist.destroy_process_group()
        results.put((pp_rank, out))
    except Exception:
        results.put((pp_rank, traceback.format_exc()))


def _run_setup(scenario: str, tmp_path, directory: str, ranks: int = 2) -> dict:
    return dict(spawn_ranks(_setup_rank, 2, tmp_path, scenario, directory, replies=ranks))


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 64 KiB tmpfs of its own (needs root), unmounted afterwards whatever the test did."""
    import subprocess

    mount_point = tmp_path / "tmpfs"
    mount_point.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount_point)],
                          capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {made.stderr.strip()}")
    try:
        yield str(mount_point)
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=True)


@pytest.mark.parametrize("victim", [0, 1])
def test_a_rank_killed_between_the_setup_barriers_leaves_nothing(tmp_path, victim):
    import tempfile

    directory = tempfile.mkdtemp(prefix="attnres-pp-test-", dir="/dev/shm")
    try:
        out = _run_setup(f"kill{victim}", tmp_path, directory, ranks=1)
        survivor = 1 - victim
        assert "PeerGone" in out[survivor]["error"], out
        assert "opening the peers' shared-memory slots failed: a peer exited" in out[survivor]["error"]
        assert os.listdir(directory) == []  # the victim's files too: the survivor removed them
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def test_a_full_tmpfs_is_an_error_at_setup_on_every_rank(tmp_path, small_tmpfs):
    out = _run_setup("full", tmp_path, small_tmpfs)
    for rank in (0, 1):  # both ranks raise the same error, naming the rank that had no room and the fixes
        error = out[rank]["error"]
        assert error.startswith("SharedMemoryFull: rank 1: ") and "has no room for this run's shared-memory" in error
        assert "ATTNRES_PP_SHM=0" in error and "No space left on device" in error
    assert os.listdir(small_tmpfs) == []


def test_slots_survive_a_tmpfs_that_fills_after_setup(tmp_path, small_tmpfs):
    out = _run_setup("fill", tmp_path, small_tmpfs)
    assert out[0]["shm"] and out[1]["shm"]
    for step in range(2):  # written into pages allocated at setup: no SIGBUS, the payloads intact
        assert out[1][f"got {step}"] == 24 * step and out[0][f"back {step}"] == 24 * (step + 1)


class _RefusingWorker:
    """A rank whose set-up finds no room in /dev/shm."""

    def __init__(self, rank: int) -> None:
        from attnres_pp.comm.shm_transport import SharedMemoryFull

        raise SharedMemoryFull(f"rank {rank}: /dev/shm has no room for this run's shared-memory hop slots\n(detail)")


def test_a_setup_refusal_reaches_the_driver_as_one_line():
    """The local launcher's driver raises a rank's SharedMemoryFull as a one-line ValueError, which
    the CLI prints as `error:` (exit 2), not as a traceback."""
    from attnres_pp.launch.process_rank_group import ProcessRankGroup

    with pytest.raises(ValueError) as info:
        ProcessRankGroup(2, 30.0, name="attnres-pp-test").start(_RefusingWorker, [{"rank": rank} for rank in range(2)])
    assert str(info.value) == ("rank 0 refused to start: rank 0: /dev/shm has no room for this run's shared-memory "
                               "hop slots (detail)")


class _LateRefusingWorker:
    """Rank 1 refuses at once (and its process exits, code 0); rank 0 refuses 0.5 s later."""

    def __init__(self, rank: int) -> None:
        import time

        from attnres_pp.comm.shm_transport import SharedMemoryFull

        if rank == 0:
            time.sleep(0.5)
        raise SharedMemoryFull(f"rank {rank}: /dev/shm has no room for this run's shared-memory hop slots")


def test_a_refusal_is_reported_not_the_exit_of_a_partner_that_refused_first():
    """The set-up race with real rank processes, made certain: the driver waits on rank 0 and sees rank
    1 exit first. Rank 1's exit follows its own refusal, so it is not a lost rank; both ranks refused,
    and the lowest rank's refusal is the line raised."""
    from attnres_pp.launch.process_rank_group import ProcessRankGroup
    from attnres_pp.pipeline.errors import WorkerLost

    with pytest.raises(ValueError) as info:
        ProcessRankGroup(2, 30.0, name="attnres-pp-test").start(_LateRefusingWorker,
                                                                [{"rank": rank} for rank in range(2)])
    assert not isinstance(info.value, WorkerLost)
    assert str(info.value) == ("rank 0 refused to start: rank 0: /dev/shm has no room for this run's shared-memory "
                               "hop slots")
