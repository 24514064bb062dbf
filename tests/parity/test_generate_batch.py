"""Batches of sequences (`generate.loop.generate_batch`): prompts of different lengths run as one
ragged batch and each greedy output equals that prompt's output generated alone, in one process and
pipelined (P = 2, V = 2, prefill in pieces); a stop string ends its sequence and is left out, the
others going on with the finished sequences dropped from the caches; each sequence's seeded
samples are those it draws alone."""

from __future__ import annotations

import pytest

from attnres_pp.generate.config import GenerationConfig
from attnres_pp.generate.engines import SingleProcessGenerator, make_generator
from attnres_pp.generate.loop import generate, generate_batch
from attnres_pp.pipeline.config import PipelineConfig
from tests.pipeline_helpers import build_model, model_config

SEQ_LEN = 24
PROMPTS = [[3, 1, 4, 1, 5, 9, 2], [7], [2, 7, 1, 8], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]]  # lengths 7, 1, 4, 10
GREEDY = GenerationConfig(max_new_tokens=SEQ_LEN - 10 + 1, prefill_chunk=3, temperature=0)


def _setup(variant: str):
    cfg = model_config(variant, n_layers=4, seq_len=SEQ_LEN)
    return cfg, {name: p.detach().clone() for name, p in build_model(cfg).named_parameters()}


def _alone(cfg, named, gen_cfg):
    return [generate(SingleProcessGenerator(cfg, named), ids, gen_cfg).tokens for ids in PROMPTS]


@pytest.mark.parametrize("variant", ["standard", "full", "lr_sliced", "msar"])
def test_each_greedy_output_equals_its_prompt_alone(variant):
    cfg, named = _setup(variant)
    want = _alone(cfg, named, GREEDY)
    assert len({tuple(t) for t in want}) == len(PROMPTS)  # distinct outputs: a mix-up of rows would show
    single = generate_batch(SingleProcessGenerator(cfg, named), PROMPTS, GREEDY)
    assert [r.tokens for r in single] == want
    pipe = PipelineConfig(stages=2, virtual=2, launcher="inprocess", timeout_s=60.0)
    piped = generate_batch(make_generator(cfg, pipe, named), PROMPTS, GREEDY)
    assert [r.tokens for r in piped] == want
    assert all(r.prefill_s > 0 and len(r.decode_s) == GREEDY.max_new_tokens - 1 for r in piped)


def test_a_batch_of_one_is_the_single_sequence_loop():
    cfg, named = _setup("block")
    one = generate_batch(SingleProcessGenerator(cfg, named), PROMPTS[:1], GREEDY)
    assert len(one) == 1 and one[0].tokens == generate(SingleProcessGenerator(cfg, named), PROMPTS[0], GREEDY).tokens


class CountingGenerator:
    """A generator that records the batch size of every pass."""

    def __init__(self, inner) -> None:
        self.inner, self.cfg, self.batch_sizes = inner, inner.cfg, []

    def reset(self) -> None:
        self.inner.reset()

    def keep_rows(self, rows: list[int]) -> None:
        self.inner.keep_rows(rows)

    def forward(self, pieces, tokens_BT):
        self.batch_sizes.append(tokens_BT.shape[0])
        return self.inner.forward(pieces, tokens_BT)


@pytest.mark.parametrize("launcher", ["single", "inprocess"])
def test_a_stop_string_ends_its_sequence_and_is_left_out(launcher):
    cfg, named = _setup("msar")
    want = _alone(cfg, named, GREEDY)
    target = 2  # stop the third prompt at two tokens from the middle of its output
    stop = bytes(want[target][5:7])
    cut = next(i for i in range(len(want[target])) if bytes(want[target][i:i + len(stop)]) == stop)
    stopped = GenerationConfig(max_new_tokens=GREEDY.max_new_tokens, prefill_chunk=3, temperature=0, stop=(stop,))
    pipe = PipelineConfig(stages=2, virtual=2, launcher="inprocess", timeout_s=60.0)
    generator = CountingGenerator(SingleProcessGenerator(cfg, named) if launcher == "single"
                                  else make_generator(cfg, pipe, named))
    results = generate_batch(generator, PROMPTS, stopped)
    assert results[target].tokens == want[target][:cut] and results[target].stopped_at == stop
    assert generator.batch_sizes[0] == len(PROMPTS) and generator.batch_sizes[-1] < len(PROMPTS)  # it left
    assert len(results[target].decode_s) == cut + len(stop) - 1  # it ended where the stop string ended
    for row, result in enumerate(results):
        if row != target and result.stopped_at is None:  # another row may contain the string too
            assert result.tokens == want[row]
        elif row != target:
            assert bytes(want[row]).startswith(bytes(result.tokens) + stop)


def test_seeded_samples_do_not_depend_on_the_batch():
    cfg, named = _setup("block")
    sampled = GenerationConfig(max_new_tokens=10, temperature=0.8, top_k=5, seed=7)
    want = _alone(cfg, named, sampled)
    got = generate_batch(SingleProcessGenerator(cfg, named), PROMPTS, sampled)
    assert [r.tokens for r in got] == want
    reseeded = GenerationConfig(max_new_tokens=10, temperature=0.8, top_k=5, seed=8)
    assert [r.tokens for r in generate_batch(SingleProcessGenerator(cfg, named), PROMPTS, reseeded)] != want


def test_a_batch_too_long_for_the_context_is_refused():
    """Learned positions end at seq_len (rotary ones go on: tests/parity/test_generate_window.py)."""
    cfg = model_config("standard", n_layers=4, seq_len=SEQ_LEN, positions="learned")
    named = {name: p.detach().clone() for name, p in build_model(cfg).named_parameters()}
    too_long = GenerationConfig(max_new_tokens=SEQ_LEN - 10 + 2, temperature=0)
    with pytest.raises(ValueError, match="seq_len=24"):
        generate_batch(SingleProcessGenerator(cfg, named), PROMPTS, too_long)
