"""Tensor and sequence parallelism (docs/spec.md section 10), in this process: the run config's T and
SP, and the (dp, pp, tp) rank layout. The multi-process parity of the layer split is
tests/distributed/test_tensor_parallel_gloo.py."""

from __future__ import annotations

import pytest

from attnres_pp.model.config import ModelConfig
from attnres_pp.pipeline.config import PipelineConfig
from attnres_pp.train.config import RunConfig


def test_tensor_parallel_multiplies_the_ranks_and_turns_sequence_parallelism_on():
    pipe = PipelineConfig(stages=2, data_parallel=3, tensor_parallel=2, launcher="local")
    assert pipe.world_size == 12 and pipe.sp and not pipe.is_single_process
    assert not PipelineConfig(tensor_parallel=2, sequence_parallel=False).sp
    assert not PipelineConfig(sequence_parallel=True).sp  # nothing to split at T = 1
    assert PipelineConfig().world_size == 1 and PipelineConfig().is_single_process


def test_tensor_parallel_round_trips_through_the_pipeline_table():
    pipe = PipelineConfig(tensor_parallel=4, sequence_parallel=False)
    assert PipelineConfig.from_dict(pipe.to_dict()) == pipe
    # A table written before the keys existed reads as T = 1.
    table = {k: v for k, v in PipelineConfig().to_dict().items() if k not in ("tensor_parallel", "sequence_parallel")}
    assert PipelineConfig.from_dict(table) == PipelineConfig()


@pytest.mark.parametrize(("model", "pipe", "needle"), [
    (ModelConfig(n_heads=4, d_model=64), PipelineConfig(tensor_parallel=8), "does not divide the 4 heads"),
    (ModelConfig(n_heads=4, d_model=64, d_ff=66), PipelineConfig(tensor_parallel=4), "does not divide d_ff = 66"),
    (ModelConfig(seq_len=18), PipelineConfig(tensor_parallel=4), "does not divide --seq-len 18"),
    (ModelConfig(residual="msar", stream_kernels=(2, 9), seq_len=16), PipelineConfig(tensor_parallel=4),
     "shards of 4 tokens, fewer than the 8"),
])
def test_a_split_the_layer_cannot_take_is_refused_naming_the_rule(model, pipe, needle):
    with pytest.raises(ValueError, match=needle):
        RunConfig(model=model, pipeline=pipe)


def test_without_sequence_parallelism_the_sequence_need_not_divide():
    RunConfig(model=ModelConfig(seq_len=18), pipeline=PipelineConfig(tensor_parallel=4, sequence_parallel=False))


def test_a_tp_group_must_fit_on_one_node():
    pipe = PipelineConfig(tensor_parallel=4)
    pipe.check_tensor_parallel_fits_node(8, "GPUs")
    with pytest.raises(ValueError, match="larger than a node's 2 ranks"):
        pipe.check_tensor_parallel_fits_node(2, "GPUs")


def test_rank_coords_put_tp_innermost():
    from attnres_pp.pipeline.mesh import RankCoords

    # (D, P, T) = (2, 3, 2): rank = (dp * 3 + pp) * 2 + tp
    coords = RankCoords(9, data_parallel=2, stages=3, tensor_parallel=2)
    assert (coords.dp_rank, coords.pp_rank, coords.tp_rank) == (1, 1, 1)
    assert coords.axis_members("tp") == [8, 9]
    assert coords.axis_members("pp") == [7, 9, 11]  # a hop pairs (d, p, t) with (d, p + 1, t)
    assert coords.axis_members("dp") == [3, 9]
    assert coords.axis_members("world") == list(range(12))
    every = {(c.dp_rank, c.pp_rank, c.tp_rank) for c in (RankCoords(r, 2, 3, 2) for r in range(12))}
    assert len(every) == 12
    # T = 1 is the (dp, pp) layout, axis by axis.
    flat, plain = RankCoords(5, 2, 3, 1), RankCoords(5, 2, 3)
    assert flat == plain and plain.axis_members("tp") == [5] and plain.axis_members("dp") == [2, 5]
    with pytest.raises(ValueError, match="x tensor_parallel 2"):
        RankCoords(12, 2, 3, 2)


def test_thread_collectives_sum_over_the_tp_group_only():
    import threading

    import torch

    from attnres_pp.pipeline.mesh import thread_collectives

    collectives = thread_collectives(1, 2, timeout_s=10.0, tensor_parallel=2)  # ranks (pp, tp): 0 0, 0 1, 1 0, 1 1
    results = {}

    def run(rank):
        tensor = torch.tensor([float(rank + 1)])
        collectives[rank].all_reduce(tensor, "tp")
        results[rank] = tensor.item()

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10.0)
    assert results == {0: 3.0, 1: 3.0, 2: 7.0, 3: 7.0}


def test_the_layer_split_refuses_what_it_cannot_split():
    from attnres_pp.pipeline.tensor_parallel import sequence_shard

    msar = ModelConfig(residual="msar", stream_kernels=(2, 9), seq_len=16)
    msar.check_tensor_split(2, sequence_parallel=True)  # shards of 8 tokens hold the halo of 8
    msar.check_tensor_split(4, sequence_parallel=False)
    with pytest.raises(ValueError, match="fewer than the 8 that MSAR"):
        msar.check_tensor_split(4, sequence_parallel=True)
    with pytest.raises(ValueError, match="does not divide the 4 heads"):
        ModelConfig().check_tensor_split(8, sequence_parallel=False)
    assert [sequence_shard(16, t, 4) for t in range(4)] == [slice(0, 4), slice(4, 8), slice(8, 12), slice(12, 16)]


def test_ray_actor_labels_carry_the_tp_coordinate():
    from types import SimpleNamespace

    from attnres_pp.launch.ray_checks import actor_label
    from attnres_pp.pipeline.mesh import RankCoords

    label = actor_label("StageActor", SimpleNamespace(coords=RankCoords(7, 2, 2, 2)))
    assert label == "StageActor rank=7 (dp 1, pp 1, tp 1)"
    assert actor_label("StageActor", SimpleNamespace(coords=RankCoords(3, 2, 2))) == "StageActor rank=3 (dp 1, pp 1)"
    assert actor_label("GenerationActor", SimpleNamespace(pp_rank=1)) == "GenerationActor rank=1"
