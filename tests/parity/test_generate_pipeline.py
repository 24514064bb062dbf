"""Pipelined generation reproduces the single process: greedy tokens identical, token for token,
for every variant, P = 2 and V = 2, over the loopback transport (every variant) and over gloo
between spawned rank processes; the logits of a pass agree; each hop carries what the plan says."""

from __future__ import annotations

import pytest
import torch

from attnres_pp.comm.plan import plan_for_model
from attnres_pp.generate.config import GenerationConfig
from attnres_pp.generate.engines import SingleProcessGenerator, make_generator
from attnres_pp.generate.loop import generate
from attnres_pp.generate.worker import pipeline_partition
from attnres_pp.pipeline.config import PipelineConfig
from attnres_pp.schedule.forward_schedule import generation_schedule
from attnres_pp.schedule.ir import Action, Schedule
from attnres_pp.schedule.validate import ScheduleError, validate_forward_only
from tests.pipeline_helpers import build_model, model_config
from tests.reference_model import VARIANTS

SEQ_LEN = 24
PROMPT = [3, 1, 4, 1, 5, 9, 2]
GREEDY = GenerationConfig(max_new_tokens=SEQ_LEN - len(PROMPT) + 1, prefill_chunk=3, temperature=0)


MOE = dict(moe_experts=4, moe_top_k=2, moe_shared_experts=1, moe_d_ff=8, moe_dense_layers=1)


def _setup(variant: str, **overrides):
    cfg = model_config(variant, n_layers=4, seq_len=SEQ_LEN, **overrides)
    named = {name: p.detach().clone() for name, p in build_model(cfg).named_parameters()}
    return cfg, named


def _pipe(launcher: str, stages: int = 2, virtual: int = 2) -> PipelineConfig:
    return PipelineConfig(stages=stages, virtual=virtual, launcher=launcher, timeout_s=60.0)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_greedy_tokens_are_identical_in_process(variant):
    cfg, named = _setup(variant)
    want = generate(SingleProcessGenerator(cfg, named), PROMPT, GREEDY).tokens
    got = generate(make_generator(cfg, _pipe("inprocess"), named), PROMPT, GREEDY).tokens
    assert got == want
    assert len(want) == GREEDY.max_new_tokens and len(set(want)) > 1  # a real sequence, not one token repeated


@pytest.mark.parametrize("variant", ["block", "lr_projected"])
def test_moe_greedy_tokens_are_identical_in_process(variant):
    cfg, named = _setup(variant, **MOE)
    assert "layers.1.mlp.experts.gate_up" in named and "layers.1.mlp.expert_bias" in named
    want = generate(SingleProcessGenerator(cfg, named), PROMPT, GREEDY).tokens
    got = generate(make_generator(cfg, _pipe("inprocess"), named), PROMPT, GREEDY).tokens
    assert got == want and len(set(want)) > 1


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_pass_logits_and_hops_match(variant):
    """Prefill in pieces then a decode pass: every position's logits within fp32 rounding of the
    single process; the transport counted exactly the plan's tensors on every wire hop."""
    cfg, named = _setup(variant)
    single, piped = SingleProcessGenerator(cfg, named), make_generator(cfg, _pipe("inprocess"), named)
    tokens_BT = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3))
    passes = [([(0, 4), (4, 4)], tokens_BT[:, :8]), ([(8, 1)], tokens_BT[:, 8:])]
    plan = plan_for_model(cfg, pipeline_partition(cfg, _pipe("inprocess")), cache=True)
    for pieces, tokens in passes:
        piped.ledger.clear()
        want = single.forward(pieces, tokens, all_logits=True)
        got = piped.forward(pieces, tokens, all_logits=True)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        width = cfg.d_model if cfg.residual == "standard" else cfg.source_width
        piece_ids = sorted({record[2] for record in piped.ledger.records})
        assert len(piece_ids) == len(pieces)
        for piece_id, (_start, n) in zip(piece_ids, pieces, strict=True):
            counted = piped.ledger.tensors_per_hop("fwd", piece_id)
            assert [counted.get(c, 0) for c in range(len(plan.hops))] == plan.fwd_hop_tensors
            for _direction, _hop, mb, n_tensors, n_bytes in piped.ledger.records:
                if mb == piece_id:
                    assert n_bytes == n_tensors * tokens.shape[0] * n * width * 4

def test_p1_with_virtual_stages_runs_every_hop_in_memory():
    cfg, named = _setup("block")
    want = generate(SingleProcessGenerator(cfg, named), PROMPT, GREEDY).tokens
    piped = make_generator(cfg, _pipe("inprocess", stages=1, virtual=4), named)
    assert generate(piped, PROMPT, GREEDY).tokens == want
    assert piped.ledger.records == []


def test_sampling_is_seeded_and_launcher_independent():
    cfg, named = _setup("msar")
    sampled = GenerationConfig(max_new_tokens=12, temperature=0.8, top_k=5, seed=7)
    want = generate(SingleProcessGenerator(cfg, named), PROMPT, sampled).tokens
    assert generate(make_generator(cfg, _pipe("inprocess"), named), PROMPT, sampled).tokens == want
    other = generate(SingleProcessGenerator(cfg, named), PROMPT, GenerationConfig(
        max_new_tokens=12, temperature=0.8, top_k=5, seed=8)).tokens
    assert other != want


def test_generation_schedule_is_forward_only_and_pipelined():
    schedule = generation_schedule(2, 2, 3)
    assert str(schedule).splitlines()[1] == (
        "rank 0: F0.0 SF0.0 F0.1 SF0.1 F0.2 SF0.2 RF2.0 F2.0 SF2.0 RF2.1 F2.1 SF2.1 RF2.2 F2.2 SF2.2")
    broken = Schedule(name="x", n_stages=1, n_virtual=2, n_microbatches=2,
                      rank_actions=((Action.parse("F0.1"), Action.parse("F0.0"), Action.parse("F1.0"),
                                     Action.parse("F1.1")),))
    with pytest.raises(ScheduleError, match="in order"):
        validate_forward_only(broken)


# MSAR's hops over gloo between rank processes: P = 2, V = 2 in test_generate_nccl.py's
# test_nccl_order_over_gloo_rank_processes (the same tensors, batched), and P = 2 x T = 2 through
# `generate` in tests/unit/test_cli_generate.py::test_generate_over_local_rank_processes.
@pytest.mark.distributed
@pytest.mark.parametrize("variant", ["standard", "lr_projected"])
def test_greedy_tokens_are_identical_over_gloo(variant):
    cfg, named = _setup(variant)
    want = generate(SingleProcessGenerator(cfg, named), PROMPT, GREEDY).tokens
    generator = make_generator(cfg, _pipe("local"), named)
    try:
        assert generate(generator, PROMPT, GREEDY).tokens == want
        assert generate(generator, PROMPT[:3], GREEDY).tokens == generate(  # reset: a second sequence
            SingleProcessGenerator(cfg, named), PROMPT[:3], GREEDY).tokens
    finally:
        generator.close()
