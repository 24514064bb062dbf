"""Tensor and sequence parallelism (docs/spec.md section 10), in this process: the run config's T and
SP, and the (dp, pp, tp) rank layout. The multi-process parity of the layer split is
tests/test_tensor_parallel_gloo.py."""

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
