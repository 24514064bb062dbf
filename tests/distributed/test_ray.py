"""The Ray launcher end to end (tensor-parallel groups placed as one bundle each, training under the
zero-bubble ZB-V schedule at T = 2 under PACK: tests/multihost/test_multihost.py, which needs root),
generation's greedy tokens at V = 2, a placement no
node can hold, a rank's set-up refusal, the fault-tolerant replica groups' recovery (only the lost
group's actors restart, four actors on the instance's 4 logical CPUs), and what a private local
instance is asked for (a CPU per rank, loopback; the restart limit, which no launcher changes:
tests/unit/test_checkpoint.py; a real private instance, its token authentication, where it listens
and Ctrl-C, on one run: test_ray_private_auth.py). On a real cluster (tests/multihost/test_multihost.py):
a job (a head started with `ray start`, token authentication on, a job submitted with `ray job
submit`, refused without the token) that is the D = 2 x P = 2 run with `--data`, and recovery from a
lost host that ends with the undisturbed losses (the single process's, tied embeddings held as a copy
on each of two actors at V = 2, the checkpoint holding the matrix once).

The runs share one local Ray instance of 4 logical CPUs (the Ray rank group joins an initialised Ray
and leaves it running), so Ray's start-up is paid once.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from attnres_pp.cli import main
from tests.run_helpers import assert_same_losses, losses

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.ray

REPO = Path(__file__).resolve().parents[2]
TINY = ["--layers", "4", "--d-model", "32", "--heads", "2", "--seq-len", "16", "--batch-size", "4",
        "--microbatches", "2", "--stages", "2", "--virtual", "2", "--eval-every", "3"]


# The tests on the shared instance run on one worker: under --dist loadgroup they would otherwise be
# handed to both, each starting an instance of its own.
SHARED_RAY = pytest.mark.xdist_group("ray-local-instance")


@pytest.fixture(scope="module")
def local_ray():
    if os.environ.get("RAY_ADDRESS"):
        pytest.skip("RAY_ADDRESS is set: these tests start their own private Ray instance")
    # 4 logical CPUs (on however many cores): room for two tensor-parallel groups of 2
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=True)
    yield
    ray.shutdown()


@SHARED_RAY
def test_under_fault_tolerance_only_the_lost_groups_actors_restart(local_ray, tmp_path):
    """`--fault-tolerance replicas` under the Ray launcher, on the shared instance: each replica group's
    actors in a placement group of their own, only group 1's killed and placed again when its rank 3
    is lost at step 3; group 0 commits every step and group 1 heals from it, as on local rank
    processes (tests/distributed/test_fault_tolerance.py, whose run and checks these are)."""
    from .test_fault_tolerance import ARGS, FT, check_recovered_alone

    corpus = tmp_path / "tiny.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    assert main([*ARGS, "--launcher", "inprocess", "--data", str(corpus), "--out", str(tmp_path / "plain")]) == 0
    plain = json.loads((tmp_path / "plain" / "summary.json").read_text())
    run = tmp_path / "ray"
    assert main([*ARGS, *FT, "--launcher", "ray", "--device", "cpu", "--data", str(corpus), "--inject-failure", "3:3",
                 "--out", str(run)]) == 0
    got = check_recovered_alone(run, plain)
    assert "stopped answering (its actor died)" in got["recoveries"][0]["cause"]


@SHARED_RAY
def test_fsdp_and_expert_parallel_through_ray_actors(local_ray, tmp_path):
    """`--dp-shard fsdp --expert-parallel 2` at D = 2 through the Ray launcher, with routed experts: the
    actors shard over their mesh's "dp" dimension and run their token all-to-alls over their gloo
    group; the run ends with the in-process EP = 1 replicated run's losses and holds the shard bytes
    `simulate memory` predicts for these flags, the prediction tests/distributed/test_sim_moe_fsdp_gathered.py
    holds local rank processes to at EP = 2, D = 2 and 4 (tests/distributed/test_expert_parallel_gloo.py:
    the local launcher, EP = 2 under replicate, checkpoints; tests/distributed/test_expert_fsdp_save.py:
    EP = 2 under fsdp on local rank processes, the replicated run's losses). One run for both: FSDP2 and
    the all-to-alls are the worker's, the same code under either launcher; the actors' process groups
    serve both."""
    from attnres_pp.model.config import ModelConfig
    from attnres_pp.simulator.memory import MemorySetup, predict_memory

    moe = ["--moe-experts", "4", "--moe-top-k", "2", "--moe-shared-experts", "1", "--moe-dense-layers", "1"]
    argv = ["train", *TINY, "--stages", "1", "--virtual", "1", "--batch-size", "8", "--data-parallel", "2",
            "--steps", "2", *moe, "--eval-every", "0", "--quiet"]
    assert main([*argv, "--expert-parallel", "2", "--dp-shard", "fsdp", "--out", str(tmp_path / "ray")]) == 0
    assert main([*argv, "--launcher", "inprocess", "--out", str(tmp_path / "inproc")]) == 0
    assert_same_losses(losses(tmp_path / "ray"), losses(tmp_path / "inproc"))
    got = json.loads((tmp_path / "ray" / "summary.json").read_text())
    pipeline = got["config"]["pipeline"]
    assert (pipeline["expert_parallel"], pipeline["dp_shard"], pipeline["launcher"]) == (2, "fsdp", "ray")
    setup = MemorySetup(schedule=pipeline["schedule"], n_stages=1, n_microbatches=2, tokens=2 * 16, dtype="fp32",
                        data_parallel=2, dp_shard="fsdp", expert_parallel=2)
    predicted = predict_memory(ModelConfig(**got["config"]["model"]), setup)
    assert len(got["memory_per_rank"]) == len(predicted) == 2
    whole_bytes = 4 * got["params"]  # fp32: what each replica would hold unsharded
    for entry, want in zip(got["memory_per_rank"], predicted, strict=True):
        for key in ("param_bytes", "grad_bytes", "optimizer_bytes"):
            assert entry[key] == want.terms[key], key
        # Half of every parameter: FSDP2 shards what EP does not split (padding dim 0 to a multiple of
        # D), EP halves the expert slices; the 0-dim scales and the selection bias whole.
        assert 0.5 * whole_bytes <= entry["param_bytes"] <= 0.52 * whole_bytes


@SHARED_RAY
def test_ray_actors_generate_the_single_process_tokens(local_ray):
    """`generate --launcher ray` at P = 2, V = 2 under PACK: two actors, each rank its bundle, join the
    running instance (they start none), give the single process's greedy tokens for one sequence and
    for a ragged batch, and leave no placement group behind. The V = 2 chunks and tensor parallelism
    each change what an actor builds, not how the driver reaches it: generation at T = 2 runs on rank
    processes and thread ranks (tests/parity/test_generate_tensor_parallel.py, the same generation
    worker), and T = 2 actors placed as one bundle per tp group under PACK train in
    tests/multihost/test_multihost.py's two-host T = 2 x P = 2 run (the same Ray rank group)."""
    from attnres_pp.generate.config import GenerationConfig
    from attnres_pp.generate.engines import SingleProcessGenerator, make_generator
    from attnres_pp.generate.loop import generate, generate_batch
    from attnres_pp.pipeline.config import PipelineConfig
    from tests.pipeline_helpers import build_model, model_config

    cfg = model_config("msar", n_layers=4, seq_len=16, n_heads=2)
    named = {name: p.detach().clone() for name, p in build_model(cfg).named_parameters()}
    greedy = GenerationConfig(max_new_tokens=8, prefill_chunk=2, temperature=0)
    want = generate(SingleProcessGenerator(cfg, named), [3, 1, 4, 1, 5], greedy).tokens
    assert len(set(want)) > 1  # a real sequence, not one token repeated
    pipe = PipelineConfig(stages=2, virtual=2, launcher="ray", placement="PACK", timeout_s=60.0)
    generator = make_generator(cfg, pipe, named, device="cpu")
    try:
        assert not generator.ranks.started_ray
        assert [(r["pp_rank"], r["tp_rank"]) for r in generator.ranks.setup_results] == [(0, 0), (1, 0)]
        assert generate(generator, [3, 1, 4, 1, 5], greedy).tokens == want
        batch = [[1, 2], [3, 1, 4, 1, 5]]  # ragged: the first finishes first and leaves the batch
        alone = [generate(SingleProcessGenerator(cfg, named), ids, greedy).tokens for ids in batch]
        assert [r.tokens for r in generate_batch(generator, batch, greedy)] == alone
    finally:
        generator.close()
    assert ray.is_initialized()  # the instance it joined is left running
    assert all(pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values())


@SHARED_RAY
def test_a_placement_no_node_can_hold_is_refused_at_once(local_ray, tmp_path, capsys):
    """local_ray has one node with 4 CPUs: STRICT_PACK of 5 one-CPU bundles is refused before the
    placement group is created, not after the whole --timeout."""
    argv = ["train", *TINY, "--stages", "5", "--virtual", "1", "--layers", "5", "--timeout", "60"]
    started = time.monotonic()
    assert main([*argv, "--out", str(tmp_path / "run"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --placement STRICT_PACK needs one node with 5 CPU for 5 bundles of {1 CPU}")
    assert "node 0: 4 CPU" in err and time.monotonic() - started < 30


@SHARED_RAY
def test_a_setup_refusal_through_ray_is_one_line_as_under_the_local_launcher(local_ray, tmp_path):
    """The Ray driver raises a rank's set-up refusal (a ValueError, carried through Ray's task error)
    as `rank R refused to start: ...`, one line that the CLI prints as `error:`, ahead of the other
    ranks' failures it caused, and not as a rendezvous failure or a traceback."""
    from attnres_pp.launch.ray_actor import join_results
    from attnres_pp.launch.ray_checks import RendezvousError

    from .ray_setup_rank import SetUpRank

    actors = [ray.remote(num_cpus=0)(SetUpRank).remote(rank, str(tmp_path / "refused")) for rank in range(2)]
    try:
        with pytest.raises(ValueError) as info:
            join_results([a.join_process_group.remote("tcp://10.0.0.1:1", 2) for a in actors], "tcp://10.0.0.1:1",
                         30.0, [("n0", "10.0.0.1"), ("n1", "10.0.0.2")])
    finally:
        for actor in actors:
            ray.kill(actor)
    assert not isinstance(info.value, RendezvousError)
    assert str(info.value) == ("rank 1 refused to start: rank 1: /dev/shm has no room for this run's shared-memory "
                               "hop slots (detail)")


def test_a_private_instance_offers_a_cpu_per_rank_on_loopback(monkeypatch):
    """Without an address the rank group starts a private instance of one logical CPU per rank on a
    machine with fewer cores (the ranks mostly wait on each other), its node on 127.0.0.1 with Ray's
    cluster switch off while it starts (so its servers bind loopback only) and back on after. Ray's
    own start is stubbed: what the group asks of it is the decision under test; test_ray_private_auth.py
    starts a real private instance and checks where it listens."""
    from ray._private import ray_constants

    from attnres_pp.launch import ray_rank_group

    asked: dict = {}

    def init(**kwargs):
        asked.update(kwargs, clusters=(os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"),
                                       ray_constants.ENABLE_RAY_CLUSTER))

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray_rank_group, "watch_private_instance", lambda _ray: None)
    monkeypatch.setattr(ray_rank_group.os, "cpu_count", lambda: 2)
    clusters_before = ray_constants.ENABLE_RAY_CLUSTER
    group = ray_rank_group.RayRankGroup(4, 60.0)
    assert group.started_ray
    assert (asked["address"], asked["num_cpus"], asked["_node_ip_address"]) == ("local", 4, "127.0.0.1")
    assert asked["clusters"] == ("0", False)
    assert ray_constants.ENABLE_RAY_CLUSTER == clusters_before


def test_multinode_example_config_loads():
    from attnres_pp.train.config import RunConfig

    example = RunConfig.from_toml(REPO / "configs" / "multinode_example.toml")
    assert example.pipeline.launcher == "ray" and example.pipeline.placement in ("PACK", "SPREAD")
    assert example.pipeline.data_parallel == 2 and example.pipeline.world_size == 16  # D x P actors
