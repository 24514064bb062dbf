"""`--launcher ray` for generation: one actor per rank, the same greedy tokens as one process, for
one sequence and for a ragged batch."""

from __future__ import annotations

import os

import pytest

from attnres_pp.generate.config import GenerationConfig
from attnres_pp.generate.engines import SingleProcessGenerator, make_generator
from attnres_pp.generate.loop import generate, generate_batch
from attnres_pp.pipeline.config import PipelineConfig
from tests.pipeline_helpers import build_model, model_config

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.ray


def test_ray_actors_generate_the_single_process_tokens():
    if os.environ.get("RAY_ADDRESS"):
        pytest.skip("RAY_ADDRESS is set: this test starts its own private Ray instance")
    cfg = model_config("msar", n_layers=4, seq_len=16)
    named = {name: p.detach().clone() for name, p in build_model(cfg).named_parameters()}
    greedy = GenerationConfig(max_new_tokens=8, prefill_chunk=2, temperature=0)
    want = generate(SingleProcessGenerator(cfg, named), [1, 2, 3, 4, 5], greedy).tokens
    generator = make_generator(cfg, PipelineConfig(stages=2, virtual=2, launcher="ray", timeout_s=60.0), named)
    try:
        assert generator.ranks.started_ray
        assert generate(generator, [1, 2, 3, 4, 5], greedy).tokens == want
        batch = [[1, 2], [1, 2, 3, 4, 5]]  # ragged: the first finishes first and leaves the batch
        alone = [generate(SingleProcessGenerator(cfg, named), ids, greedy).tokens for ids in batch]
        assert [r.tokens for r in generate_batch(generator, batch, greedy)] == alone
    finally:
        generator.close()
    assert not ray.is_initialized()
