"""`--fsdp-reshard-after-forward always` in the memory model (`simulate memory`, `simulate plan`): a
chunk's FSDP2 units are all-gathered by the first action that finds them sharded and resharded at
the end of each F, so its gathered copy is held from its backward to its next F (and inside each F),
not all step as under never."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math

import pytest

from attnres_pp.cli import main
from attnres_pp.comm.partition import make_partition
from attnres_pp.model.config import ModelConfig
from attnres_pp.pipeline.config import RESHARD_AFTER_FORWARD as PIPELINE_RESHARD
from attnres_pp.schedule.ir import Action
from attnres_pp.schedule.schedules import build_schedule, schedule_placement
from attnres_pp.simulator.memory import (
    RESHARD_AFTER_FORWARD,
    ChunkActivation,
    MemorySetup,
    chunk_gathered_bytes,
    predict_memory,
    rank_parameter_shapes,
    tied_parameter_shapes,
    walk_rank,
    walk_rank_gathered,
)
from attnres_pp.simulator.plan import Candidate, Planner, PlanRequest

CFG = ModelConfig(vocab_size=256, n_layers=8, d_model=64, n_heads=4, seq_len=64, residual="attnres", block_size=2)


def _actions(*texts: str) -> list[Action]:
    return [Action.parse(t) for t in texts]


def test_the_choices_are_trains():
    assert RESHARD_AFTER_FORWARD == PIPELINE_RESHARD


def test_walk_holds_a_chunk_gathered_from_its_backward_to_its_next_forward():
    chunks = [ChunkActivation(saved=10), ChunkActivation(saved=10)]
    order = _actions("F0.0", "F1.0", "F0.1", "B1.0", "B0.0", "F1.1", "B1.1", "B0.1")
    saved_params, whole = [100, 1000], [200, 2000]
    never = walk_rank(order, saved_by_chunk=chunks, plan=None, tensor_bytes=1, resident_by_chunk=saved_params)
    always = walk_rank_gathered(order, saved_by_chunk=chunks, plan=None, tensor_bytes=1,
                                resident_by_chunk=saved_params, gathered_by_chunk=whole)
    # Never: both chunks' saved parameters from the first F to the last backward (1130 after F0.1),
    # and the whole copy (2200) is the caller's, all step: 30 + 2200.
    assert never == (1130, 0, 30, "F0.1")
    # Always: F1.0 reshards chunk 1, so at F0.1 only chunk 0 is gathered (30 + 200); from B0.0 on
    # both are (a backward leaves its chunk unsharded): 20 + 2200 at B0.0. The saved parameters count
    # while their chunk is gathered and a graph of it lives: 20 + 100 + 1000 after F1.1.
    assert always == (1120, 0, 2220, "B0.0", 2200)
    assert always[2] < never[2] + sum(whole)


def test_split_backward_keeps_the_chunk_gathered_until_w():
    chunks = [ChunkActivation(saved=10, stored=0), ChunkActivation(saved=10, stored=4)]
    order = _actions("F1.0", "I1.0", "F1.1", "W1.0", "I1.1", "W1.1")
    got = walk_rank_gathered(order, saved_by_chunk=chunks, plan=None, tensor_bytes=1, resident_by_chunk=[0, 50],
                             gathered_by_chunk=[0, 500])
    # F1.1 runs gathered (I1.0 left it so), then reshards; W1.0 gathers again with 4 + 10 alive.
    assert got[2] == 4 + 10 + 500 and got[4] == 500
    # The graph of microbatch 0 lives until W1.0: its saved parameters count inside I1.0 and W1.0.
    assert got[0] == 4 + 10 + 50


def _setup(reshard: str, **overrides) -> MemorySetup:
    values = dict(schedule="interleaved_1f1b", n_stages=2, n_virtual=2, n_microbatches=4, tokens=256, dtype="fp32",
                  data_parallel=2, dp_shard="fsdp", reshard_after_forward=reshard)
    values.update(overrides)
    return MemorySetup(**values)


@pytest.mark.parametrize("overrides", [{}, {"schedule": "gpipe", "n_virtual": 1},
                                       {"schedule": "zbv", "activation_checkpoint": "full"},
                                       {"schedule": "interleaved_zb", "dtype": "bf16"}])
def test_always_never_holds_more_than_never(overrides):
    never, always = predict_memory(CFG, _setup("never", **overrides)), predict_memory(CFG, _setup("always",
                                                                                                   **overrides))
    schedule = overrides.get("schedule", "interleaved_1f1b")
    partition = make_partition(CFG.n_layers, 2, overrides.get("n_virtual", 2), placement=schedule_placement(schedule))
    element = 4 if overrides.get("dtype", "fp32") == "fp32" else 2
    for rank, (n, a) in enumerate(zip(never, always, strict=True)):
        for key in ("param_bytes", "grad_bytes", "optimizer_bytes", "cache_peak_bytes"):
            assert a.terms[key] == n.terms[key]
        assert a.terms["activation_peak_bytes"] <= n.terms["activation_peak_bytes"]
        assert a.peak_bytes <= n.peak_bytes
        # Never holds the rank's whole copy; always the chunks gathered at its peak, at most all of them.
        pp = rank % 2
        shapes = rank_parameter_shapes(CFG, partition, pp)
        assert n.gathered_bytes == sum(math.prod(s) for s in shapes) * element
        mine = [chunk_gathered_bytes(CFG, partition, c, dtype=overrides.get("dtype", "fp32"))
                for c in partition.chunks_of(pp)]
        assert sum(mine) == n.gathered_bytes - sum(math.prod(s) for s in tied_parameter_shapes(CFG)) * element
        assert a.gathered_bytes in {sum(x for x, keep in zip(mine, mask, strict=True) if keep)
                                    for mask in itertools.product((0, 1), repeat=len(mine))}


def test_interleaved_rank_0_peaks_lower_where_a_chunk_is_resharded():
    """Interleaved 1F1B, P = 2, V = 2: never peaks on rank 0 in F2.2, the warm-up's last forward,
    where under always chunk 0 (its last action an F) is resharded; always peaks later (F0.3 or F2.3,
    as the units weigh the chunks' activations), with both chunks gathered (each after a backward
    of the other chunk) and fewer activations."""
    never, always = predict_memory(CFG, _setup("never")), predict_memory(CFG, _setup("always"))
    partition = make_partition(CFG.n_layers, 2, 2)
    whole = [chunk_gathered_bytes(CFG, partition, c, dtype="fp32") for c in partition.chunks_of(0)]
    order = [str(a) for a in build_schedule("interleaved_1f1b", 2, 2, 4).rank_actions[0]]
    assert never[0].peak_action == "F2.2" and always[0].peak_action in ("F0.3", "F2.3")
    assert order.index(always[0].peak_action) > max(order.index("F2.2"), order.index("B2.0"))
    assert never[0].gathered_bytes == always[0].gathered_bytes == sum(whole)
    assert always[0].peak_bytes < never[0].peak_bytes
    # The walk at F2.2 under always holds chunk 2's copy only: never's peak less chunk 0's copy.
    at_f22 = never[0].peak_bytes - whole[0]
    assert always[0].peak_bytes >= at_f22


def test_cli_flag_and_json(capsys):
    argv = ["simulate", "memory", "--schedule", "interleaved_1f1b", "--stages", "2", "--virtual", "2",
            "--microbatches", "4", "--layers", "8", "--block-size", "2", "--tokens", "256", "--dtype", "fp32",
            "--data-parallel", "2", "--dp-shard", "fsdp", "--json"]
    peaks = {}
    for reshard in RESHARD_AFTER_FORWARD:
        assert main([*argv, "--fsdp-reshard-after-forward", reshard]) == 0
        peaks[reshard] = json.loads(capsys.readouterr().out)["peak_bytes_per_rank"]
    assert main(argv) == 0  # left out: never, as in train
    assert json.loads(capsys.readouterr().out)["peak_bytes_per_rank"] == peaks["never"]
    assert peaks["always"][0] < peaks["never"][0]
    assert main([*argv[:-1], "--fsdp-reshard-after-forward", "always"]) == 0
    assert "reshard after forward always" in capsys.readouterr().out


def _request() -> PlanRequest:
    cfg = ModelConfig(vocab_size=32000, n_layers=8, d_model=1024, n_heads=8, seq_len=2048, block_size=1)
    return PlanRequest(model=cfg, global_batch=16, gpus=4, gpu_memory_gib=12.0, top=8)


def test_plan_prices_always_with_its_own_memory_and_why_sums():
    planner = Planner(_request())
    # V = 4: four chunks a rank, so resharding after each F leaves some of them sharded at the peak
    base = Candidate(schedule="interleaved_1f1b", n_stages=2, n_virtual=4, n_microbatches=4, data_parallel=2,
                     block_size=4, dp_shard="fsdp", activation_checkpoint="none")
    never = planner.evaluate(base)
    always_candidate = dataclasses.replace(base, reshard_after_forward="always")
    always = planner.evaluate(always_candidate)
    assert always["peak_memory_bytes"] < never["peak_memory_bytes"]
    assert always["step_time_s"] > never["step_time_s"]  # the extra all-gathers
    terms = planner.explain(always_candidate)
    memory = dict(terms["memory"])
    assert sum(memory.values()) == always["peak_memory_bytes"]
    assert 0 < memory["gathered parameters (fsdp)"] <= dict(planner.explain(base)["memory"])[
        "gathered parameters (fsdp)"]
    assert memory["counted twice (peaks apart, fsdp saved)"] <= 0
