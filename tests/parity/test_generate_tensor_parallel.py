"""Generation with tensor parallelism: each stage's layers split over T = 2 rank processes (gloo) or
rank threads (the in-process launcher, over torch's threaded process group), the prefill and the
decode passes without sequence sharding, gives the single process's greedy tokens and its logits to
fp32 rounding; what it does not run is refused before any rank starts."""

from __future__ import annotations

import pytest
import torch

from attnres_pp.generate.config import GenerationConfig
from attnres_pp.generate.engines import SingleProcessGenerator, check_tensor_parallel_generation, make_generator
from attnres_pp.generate.loop import generate, generate_batch
from attnres_pp.pipeline.config import PipelineConfig
from tests.pipeline_helpers import build_model, model_config

SEQ_LEN = 24
PROMPT = [3, 1, 4, 1, 5, 9, 2]
GREEDY = GenerationConfig(max_new_tokens=SEQ_LEN - len(PROMPT) + 1, prefill_chunk=3, temperature=0)


def _setup(variant: str):
    cfg = model_config(variant, n_layers=4, seq_len=SEQ_LEN, n_heads=2)
    named = {name: p.detach().clone() for name, p in build_model(cfg).named_parameters()}
    return cfg, named


def _assert_generates_as_the_single_process(generator, single, want: list[int], vocab_size: int) -> None:
    """Greedy tokens of one prompt and of a batch, and the logits of a prefill in two pieces then a
    decode step, equal the single process's."""
    assert generate(generator, PROMPT, GREEDY).tokens == want
    short = GenerationConfig(max_new_tokens=6, temperature=0)
    prompts = [PROMPT[:2], PROMPT]
    assert [r.tokens for r in generate_batch(generator, prompts, short)] == \
        [r.tokens for r in generate_batch(single, prompts, short)]
    tokens_BT = torch.randint(0, vocab_size, (2, 9), generator=torch.Generator().manual_seed(3))
    single.reset()
    generator.reset()
    for pieces, tokens in (([(0, 4), (4, 4)], tokens_BT[:, :8]), ([(8, 1)], tokens_BT[:, 8:])):
        torch.testing.assert_close(generator.forward(pieces, tokens, all_logits=True),
                                   single.forward(pieces, tokens, all_logits=True), rtol=1e-5, atol=1e-5)


@pytest.mark.distributed
def test_tensor_parallel_generation_gives_the_single_process_tokens():
    """P = 1, T = 2 (two rank processes): one sequence, a reset and a second one, a ragged batch, and
    the logits of every position of a prefill in pieces and of a decode pass."""
    cfg, named = _setup("block")
    single = SingleProcessGenerator(cfg, named)
    want = generate(single, PROMPT, GREEDY).tokens
    assert len(set(want)) > 1  # a real sequence, not one token repeated
    generator = make_generator(cfg, PipelineConfig(stages=1, tensor_parallel=2, launcher="local", timeout_s=60.0),
                               named)
    try:
        assert generator.ranks.world_size == 2
        assert [r["tp_rank"] for r in generator.ranks.setup_results] == [0, 1]
        whole = sum(t.numel() for t in named.values())
        assert all(r["params"] < whole for r in generator.ranks.setup_results)  # each holds shards
        _assert_generates_as_the_single_process(generator, single, want, cfg.vocab_size)
    finally:
        generator.close()


@pytest.mark.parametrize("variant", ["block", "msar"])
def test_in_process_tensor_parallel_generation_gives_the_single_process_tokens(variant):
    """P = 2, T = 2: four rank threads, each stage's layers split over two of them; a sequence, a
    ragged batch, and the logits of a prefill in pieces and of a decode pass."""
    from torch.testing._internal.distributed.multi_threaded_pg import ThreadLocalWorld

    cfg, named = _setup(variant)
    single = SingleProcessGenerator(cfg, named)
    want = generate(single, PROMPT, GREEDY).tokens
    assert len(set(want)) > 1
    generator = make_generator(cfg, PipelineConfig(stages=2, tensor_parallel=2, launcher="inprocess",
                                                   timeout_s=60.0), named)
    try:
        assert [(r["pp_rank"], r["tp_rank"]) for r in generator.ranks.setup_results] == \
            [(0, 0), (0, 1), (1, 0), (1, 1)]
        whole = sum(t.numel() for t in named.values())
        assert sum(r["params"] for r in generator.ranks.setup_results) < 2 * whole  # each holds shards
        _assert_generates_as_the_single_process(generator, single, want, cfg.vocab_size)
    finally:
        generator.close()
    assert not isinstance(torch.distributed.distributed_c10d._world, ThreadLocalWorld)  # given back


@pytest.mark.parametrize(("pipe", "heads", "needle"), [
    (dict(launcher="inprocess"), 3, "does not divide the checkpoint's 3 heads"),
    (dict(launcher="local"), 3, "does not divide the checkpoint's 3 heads"),
])
def test_what_tensor_parallel_generation_does_not_run_is_refused(pipe, heads, needle):
    cfg = model_config("block", n_layers=4, seq_len=SEQ_LEN, n_heads=heads, d_model=24)
    with pytest.raises(ValueError, match=needle):
        check_tensor_parallel_generation(cfg, PipelineConfig(tensor_parallel=2, **pipe), "cpu")
    with pytest.raises(ValueError, match=needle):  # before any rank starts
        make_generator(cfg, PipelineConfig(stages=2, tensor_parallel=2, **pipe), None)
