"""`--fault-tolerance replicas` (docs/ray.md, "Fault tolerance across replicas"): D = 2 replica
groups of P = 2 local rank processes, each a torchft replica group. A fault-free run trains as the
plain D = 2 run (the same losses); a rank of group 1 lost mid-step restarts group 1 alone while
group 0 commits every step, group 1 heals from group 0 and every group ends bitwise equal; under
`--min-replicas 2` group 0 waits for group 1 instead (again the plain run's losses), so too with
groups of T = 2 tensor-parallel ranks (their healing state as local shards, exact); the wait is
bounded by `--timeout`; without torchft the option is one error line. Under the Ray launcher only
the lost group's actors restart: test_ray.py, on its shared instance."""

from __future__ import annotations

import math
import os
import re
import shutil
import sys
import time

import pytest

from attnres_lab.chaos_probe import fork_server_pid, restart_fork_server
from attnres_pp.cli import main
from tests.run_helpers import metrics, summary

STEPS = 8
ARGS = ["train", "--launcher", "local", "--layers", "2", "--d-model", "32", "--heads", "2", "--seq-len", "16",
        "--batch-size", "8", "--stages", "2", "--data-parallel", "2", "--steps", str(STEPS), "--quiet",
        "--no-final-checkpoint"]
FT = ["--fault-tolerance", "replicas"]
# One worker holds the module's reference run: under --dist loadgroup its tests would otherwise be
# handed to both workers, each training `plain` again.
pytestmark = pytest.mark.xdist_group("ft-plain-run")


def skipped_share_tolerance(free_losses: list[float], participants: list[int], replicas: int) -> float:
    """docs/ray.md's tolerance for the final loss of a run whose steps had `participants` groups of
    `replicas`: the skipped share of the batches, s = sum(1 - p / D) steps, counted as whole steps not
    taken, i.e. what the fault-free run's loss fell over its last ceil(s) steps (plus float noise)."""
    skipped = math.ceil(sum(1 - p / replicas for p in participants))
    return free_losses[-1 - skipped] - free_losses[-1] + 1e-6 * abs(free_losses[-1])


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("ft") / "tiny.txt"
    path.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    return path


@pytest.fixture(scope="module")
def rank_log(tmp_path_factory):
    """(a file, a pid): the local launcher's fork server, started here with the file as its stdout and
    stderr (its ranks write there), serves the module, then stops: one start (~3 CPU-s) where
    `output_to` around each logged run starts one for it and one for the runs after it."""
    from multiprocessing import forkserver

    from attnres_pp.launch.process_rank_group import rank_context

    log = tmp_path_factory.mktemp("ranks") / "ranks.log"
    restart_fork_server()
    rank_context("attnres_pp.train.ft_worker")  # the preload list of the server the ranks would start
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    saved, log_fd = (os.dup(1), os.dup(2)), os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(log_fd, 1), os.dup2(log_fd, 2)
        forkserver.ensure_running()
    finally:
        os.dup2(saved[0], 1), os.dup2(saved[1], 2)
        for fd in (*saved, log_fd):
            os.close(fd)
    yield log, fork_server_pid()
    restart_fork_server()


def printed(capfd, rank_log, start: int) -> str:
    """What the driver (this process's descriptors 1 and 2) and its ranks printed since `start`."""
    out, err = capfd.readouterr()
    assert fork_server_pid() == rank_log[1]  # the ranks came from the server that writes to the file
    return out + err + rank_log[0].read_bytes()[start:].decode(errors="replace")


@pytest.fixture(scope="module")
def plain(corpus, tmp_path_factory):
    """Today's D = 2 run, without fault tolerance: the reference losses. On thread ranks (the in-process
    launcher starts no process; its losses and validation loss are the local rank processes' bitwise
    here, so every comparison below holds the fault-tolerant local runs to the same numbers)."""
    run = tmp_path_factory.mktemp("ft") / "plain"
    assert main([*ARGS, "--launcher", "inprocess", "--data", str(corpus), "--out", str(run)]) == 0
    return summary(run)


@pytest.mark.distributed
def test_fault_free_replica_groups_train_as_the_plain_run(corpus, plain, rank_log, tmp_path, capfd):
    """Also its checkpoint (written by one group's ranks) resumes into both groups with the same losses."""
    run = tmp_path / "ft"
    assert main([*ARGS, *FT, "--data", str(corpus), "--checkpoint-every", "4", "--out", str(run)]) == 0
    got = summary(run)
    assert got["losses"] == plain["losses"]  # the same sums, divided by the same D: bitwise
    assert got["val_loss"] == plain["val_loss"]
    assert got["participants_per_step"] == [2] * STEPS
    assert got["replicas_equal"] is True and got["restarts"] == 0 and got["recoveries"] == []
    assert got["lighthouse"].startswith("http://")
    assert [r["participants"] for r in metrics(run)] == [2] * STEPS
    again = tmp_path / "again"  # as a crash after step 5 would have left it
    shutil.copytree(run / "checkpoints" / "step_4", again / "checkpoints" / "step_4")
    (again / "metrics.jsonl").write_text("".join((run / "metrics.jsonl").read_text().splitlines(True)[:5]))
    capfd.readouterr()
    start = rank_log[0].stat().st_size
    assert main(["train", "--resume", str(again), "--quiet"]) == 0
    # Each group finds the RNG stream of its layers (the writing group's: every group holds its state).
    assert printed(capfd, rank_log, start) == ""
    resumed = summary(again)
    assert resumed["losses"] == plain["losses"] and resumed["participants_per_step"] == [2] * STEPS
    assert resumed["replicas_equal"] is True


@pytest.mark.distributed
def test_a_lost_rank_restarts_only_its_group_which_heals_from_the_live_one(corpus, plain, rank_log, tmp_path, capfd):
    """Global rank 3 (group 1, pp rank 1) exits mid-step 3: group 0 commits every step once, in order;
    group 1 is restarted alone (no job restart), heals and commits again; all end bitwise equal."""
    run = tmp_path / "hit"
    capfd.readouterr()
    start = rank_log[0].stat().st_size
    assert main([*ARGS, *FT, "--data", str(corpus), "--inject-failure", "3:3", "--out", str(run)]) == 0
    check_recovered_alone(run, plain)
    # A recovery that succeeds is silent: torchft's tracebacks of the failed reduction, its checkpoint
    # server's access log and torch's buffer warning are held back (they go with a failure's error).
    assert printed(capfd, rank_log, start) == ""


@pytest.mark.distributed
def test_a_rank_lost_inside_the_replicas_all_reduce_recovers_the_same_way(corpus, plain, tmp_path):
    """Global rank 3 exits at step 3 as it would join the gradient all-reduce that group 0's pp rank 1
    has entered: group 0's collective fails, that step does not commit there, and the run recovers as
    from a rank lost mid-pipeline (group 0 commits every step once, group 1 heals, all end equal)."""
    run = tmp_path / "in_allreduce"
    assert main([*ARGS, *FT, "--data", str(corpus), "--inject-failure", "3:3:allreduce", "--out", str(run)]) == 0
    check_recovered_alone(run, plain)


def check_recovered_alone(run, plain, rank: int = 3) -> dict:
    """What a run that lost global rank `rank` (of group 1) at step 3 and recovered it alone must show;
    its summary."""
    got = summary(run)
    steps = metrics(run)
    assert [r["step"] for r in steps] == list(range(STEPS))
    assert all(0 in r["replica_groups"] for r in steps)  # group 0 never lost or repeated a step
    assert got["restarts"] == 0 and got["replica_restarts"] == [0, 1]
    [recovery] = got["recoveries"]
    assert recovery["replica"] == 1 and recovery["lost_at_step"] == 2 and f"global rank {rank}:" in recovery["cause"]
    assert recovery["rejoined_at_step"] >= 2 and steps[-1]["replica_groups"] == [0, 1]
    assert all(r["replica_groups"] == [0, 1] for r in steps[recovery["rejoined_at_step"]:])
    assert got["participants_per_step"] == [len(r["replica_groups"]) for r in steps]
    assert got["replicas_equal"] is True
    tolerance = skipped_share_tolerance(plain["losses"], got["participants_per_step"], 2)
    assert abs(got["losses"][-1] - plain["losses"][-1]) <= tolerance
    return got


# Tensor parallelism in the replica groups: D = 2 groups of P = 1 stage x T = 2 tp ranks (4 local
# processes), each group a process group of its 2 ranks whose Managers pair group rank pp x T + tp
# with the same group rank of the other group. One stage: what a tp rank heals (its shards and their
# moments) and the group restart do not depend on P; the pairing's arithmetic at P > 1 is
# test_a_ranks_place_in_its_replica_group's, and P = 2 groups heal in the runs above.
TP = ["--stages", "1", "--tensor-parallel", "2"]


@pytest.fixture(scope="module")
def plain_tp(corpus, tmp_path_factory):
    """The D = 2 x P = 1 x T = 2 run without fault tolerance: the reference losses, on thread ranks as
    `plain` (losses, validation loss and tp bytes the local rank processes' bitwise)."""
    run = tmp_path_factory.mktemp("ft") / "plain_tp"
    assert main([*ARGS, *TP, "--launcher", "inprocess", "--data", str(corpus), "--out", str(run)]) == 0
    return summary(run)


@pytest.mark.distributed
def test_a_lost_tensor_parallel_rank_restarts_its_group_of_p_x_t_ranks_which_heals(corpus, plain_tp, tmp_path):
    """Global rank 3 (group 1, pp 0, tp 1) exits mid-step 3 under `--min-replicas 2`: group 0 waits at
    the quorum while group 1's 2 ranks restart together and heal, each from the same (pp, tp) rank of
    group 0 (its weight shards and their AdamW moments as local tensors), and both train the step it
    was lost in. Each rank averages its local gradient shards with the same group rank of the other
    group, the sequence-parallel partial gradients summed over tp first, so every step's loss is the
    plain run's, bitwise: the healing is exact, shard for shard, and the replicas' reduction fault-free
    before and after it. One run for both: a fault-free run has these steps without the restart, and
    the live group's steps alone (`--min-replicas 1`) are a group's commit with one participant,
    whatever T (the runs at T = 1 above)."""
    run = tmp_path / "hit_tp"
    assert main([*ARGS, *TP, *FT, "--min-replicas", "2", "--data", str(corpus), "--inject-failure", "3:3",
                 "--out", str(run)]) == 0
    got = summary(run)
    assert got["losses"] == plain_tp["losses"] and got["val_loss"] == plain_tp["val_loss"]
    assert got["participants_per_step"] == [2] * STEPS
    assert [r["replica_groups"] for r in metrics(run)] == [[0, 1]] * STEPS
    assert got["replicas_equal"] is True and got["restarts"] == 0 and got["replica_restarts"] == [0, 1]
    assert got["tp_bytes_per_step"] == plain_tp["tp_bytes_per_step"] > 0  # the replicas' reduction is not tp's
    [recovery] = got["recoveries"]
    assert recovery["replica"] == 1 and recovery["rejoined_at_step"] == recovery["lost_at_step"] == 2
    # its index in the group: pp 0 x T + tp 1 (its exit, or its end of the pipe reset before the exit shows)
    assert "global rank 3:" in recovery["cause"], got["recoveries"]
    assert re.search(r"\brank 1 (exited|closed its pipe)", recovery["cause"]), got["recoveries"]


def test_a_ranks_place_in_its_replica_group():
    """Group rank = pp x T + tp (tp innermost, as the mesh lays ranks out) = the global rank less its
    group's first; the same group rank in every group holds the same (pp, tp) coordinates, so the
    Managers pair ranks that hold the same shards; the group's process group is a one-replica mesh."""
    from attnres_pp.pipeline.mesh import RankCoords
    from attnres_pp.train.ft_groups import replica_rank
    from attnres_pp.train.ft_worker import group_coords, group_rank

    d, p, t = 3, 2, 2
    for rank in range(d * p * t):
        coords = RankCoords(rank, d, p, t)
        index = group_rank(coords)
        assert index == rank % (p * t) and replica_rank(coords.dp_rank, index, p * t) == rank
        inside = group_coords(coords)
        assert (inside.dp_rank, inside.pp_rank, inside.tp_rank) == (0, coords.pp_rank, coords.tp_rank)
        assert [group_rank(RankCoords(peer, d, p, t)) for peer in coords.axis_members("pp")] == \
            [q * t + coords.tp_rank for q in range(p)]  # `pipeline_peers`: this tp rank's stages
        for other in range(d):
            twin = RankCoords(replica_rank(other, index, p * t), d, p, t)
            assert (twin.dp_rank, twin.pp_rank, twin.tp_rank) == (other, coords.pp_rank, coords.tp_rank)
    assert group_rank(RankCoords(3, 2, 2)) == 1  # T = 1: the pp rank, as before


def test_healing_state_travels_as_local_shards_and_loads_as_dtensors_again():
    """`local_state` holds plain tensors only (torchft's transport pickles it), and `load_local_state`
    into another rank's parameters and a fresh AdamW rebuilds every moment of a DTensor parameter as a
    DTensor with the parameter's placements (the fused qkv's strided shard included): the next AdamW
    step of the two is bitwise the same. One process, a fake 2-rank process group (no collectives)."""
    import pickle

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from attnres_pp.train.config import TrainConfig
    from attnres_pp.train.ft_worker import load_local_state, local_state
    from attnres_pp.train.optim import build_optimizer
    from attnres_pp.train.optim import local_shard as local

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))

        def as_param_like(p, tensor):  # `tensor` (a local shard) laid out as `p`
            if not isinstance(p, DTensor):
                return tensor
            return DTensor.from_local(tensor, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                      stride=p.stride())

        def params(seed: int) -> dict:
            generator = torch.Generator().manual_seed(seed)

            def held(shape, placement):
                whole = (shape[0] * (1 if placement.is_replicate() else 2), *shape[1:])
                return torch.nn.Parameter(DTensor.from_local(
                    torch.randn(shape, generator=generator), mesh, [placement], run_check=False,
                    shape=torch.Size(whole), stride=torch.empty(whole).stride()))

            return {"layers.0.attn.qkv.weight": held((6, 4), _StridedShard(0, split_factor=3)),
                    "layers.0.mlp.up.weight": held((8, 4), Shard(0)),
                    "layers.0.attn.norm.weight": held((4,), Replicate()),
                    "embed.weight": torch.nn.Parameter(torch.randn(10, 4, generator=generator))}

        def step(optimizer, grads: dict) -> None:
            for p, grad in grads.items():
                p.grad = as_param_like(p, grad.clone())
            optimizer.step()

        live = params(0)
        live_optimizer = build_optimizer(live.items(), TrainConfig())
        for seed in (1, 2):
            generator = torch.Generator().manual_seed(seed)
            step(live_optimizer, {p: torch.randn(local(p.detach()).shape, generator=generator)
                                  for p in live.values()})
        sent = local_state(live, live_optimizer)
        leaves = [*sent["params"].values(), *(v for entry in sent["optimizer"]["state"].values()
                                              for v in entry.values())]
        assert leaves and all(type(v) is torch.Tensor for v in leaves)  # no DTensor travels
        healed = params(3)
        healed_optimizer = build_optimizer(healed.items(), TrainConfig())
        load_local_state(healed, healed_optimizer, pickle.loads(pickle.dumps(sent)))
        for name in live:
            assert torch.equal(local(live[name].detach()), local(healed[name].detach()))
        want, got = live_optimizer.state_dict()["state"], healed_optimizer.state_dict()["state"]
        assert want.keys() == got.keys()
        for index, entry in want.items():
            for key, value in entry.items():
                assert type(got[index][key]) is type(value)
                if isinstance(value, DTensor):
                    assert got[index][key].placements == value.placements and got[index][key].shape == value.shape
                assert torch.equal(local(got[index][key]), local(value))
        generator = torch.Generator().manual_seed(4)
        grads = [torch.randn(local(p.detach()).shape, generator=generator) for p in live.values()]
        step(live_optimizer, dict(zip(live.values(), grads, strict=True)))
        step(healed_optimizer, dict(zip(healed.values(), grads, strict=True)))
        for name in live:
            assert torch.equal(local(live[name].detach()), local(healed[name].detach()))
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_min_replicas_2_makes_the_live_group_wait_for_the_lost_one(corpus, plain, tmp_path):
    """Every step commits with both groups: group 0 waits at the quorum while group 1 restarts and
    heals at the step it lost, so the run is the fault-free one, loss for loss."""
    run = tmp_path / "wait"
    assert main([*ARGS, *FT, "--min-replicas", "2", "--data", str(corpus), "--inject-failure", "3:3",
                 "--out", str(run)]) == 0
    got = summary(run)
    assert got["participants_per_step"] == [2] * STEPS
    assert got["losses"] == plain["losses"]
    [recovery] = got["recoveries"]
    assert recovery["rejoined_at_step"] == recovery["lost_at_step"] == 2
    assert got["replicas_equal"] is True and got["restarts"] == 0


@pytest.mark.distributed
def test_a_quorum_never_reached_ends_the_run_within_the_timeout(corpus, tmp_path, capsys):
    """A given Lighthouse that wants 3 groups never forms a quorum of these 2: each group's wait ends
    at --timeout with one error line."""
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=3)
    try:
        start = time.monotonic()
        code = main([*ARGS, *FT, "--steps", "1", "--timeout", "4", "--lighthouse", lighthouse.address(),
                     "--data", str(corpus), "--out", str(tmp_path / "never")])
        elapsed = time.monotonic() - start
    finally:
        lighthouse.shutdown()
    err = capsys.readouterr().err
    assert code == 1
    assert "error: replica group" in err and "no quorum of --min-replicas 1 replica groups within --timeout 4 s" in err
    assert elapsed < 4 + 30


def test_without_torchft_the_option_is_one_error_line(corpus, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "torchft", None)  # `import torchft` raises ImportError
    assert main([*ARGS, *FT, "--data", str(corpus), "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --fault-tolerance replicas needs torchft: pip install 'attnres-pp[ft]'"]


def test_the_lighthouse_status_counts_the_quorum_requests_it_holds():
    """The engine sends the live groups their step only once a joining group's request is at the
    Lighthouse (`ft_lighthouse.lighthouse_requests`, read from its /status page): 0, then 1 pending."""
    import threading
    from datetime import timedelta

    from torchft.coordination import LighthouseClient, LighthouseServer

    from attnres_pp.train.ft_lighthouse import lighthouse_requests

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2)
    try:
        assert lighthouse_requests(lighthouse.address()) == 0
        client = LighthouseClient(lighthouse.address(), connect_timeout=timedelta(seconds=5))
        asking = threading.Thread(target=lambda: _quorum_or_timeout(client), daemon=True)
        asking.start()
        deadline = time.monotonic() + 10
        while lighthouse_requests(lighthouse.address()) != 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert lighthouse_requests(lighthouse.address()) == 1
    finally:
        lighthouse.shutdown()
    assert lighthouse_requests("http://127.0.0.1:1") is None  # nothing listening: the engine falls back


def _quorum_or_timeout(client) -> None:
    from datetime import timedelta

    try:
        client.quorum(replica_id="r0", timeout=timedelta(seconds=3), address="a", store_address="s", step=0,
                      world_size=1)
    except Exception:  # the quorum of 2 never forms: torchft's timeout
        pass


MOE = ["--moe-experts", "4", "--moe-top-k", "2", "--moe-d-ff", "16", "--moe-bias-gamma", "0.5"]


@pytest.mark.distributed
def test_moe_replica_groups_move_the_aux_free_bias_as_the_plain_run(corpus, tmp_path):
    """The bias moves by the loads of every participating group's tokens (a large step, so that
    another sum would route otherwise): the fault-free groups' losses equal the plain D = 2 run's,
    and the groups end bitwise equal, the bias included."""
    plain_run, run = tmp_path / "plain", tmp_path / "ft"
    short = [a if a != str(STEPS) else "4" for a in ARGS]
    assert main([*short, *MOE, "--launcher", "inprocess", "--data", str(corpus), "--out", str(plain_run)]) == 0
    assert main([*short, *MOE, *FT, "--data", str(corpus), "--out", str(run)]) == 0
    got = summary(run)
    assert got["losses"] == summary(plain_run)["losses"] and got["replicas_equal"] is True
    assert got["moe_expert_loads"] == summary(plain_run)["moe_expert_loads"]
