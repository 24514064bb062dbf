"""Generation under NCCL's point-to-point rules (docs/spec.md section 5): every pass's schedule is proven to
finish when issued in `lockstep_plan`'s groups, the post-everything order (every receive of a pass posted up
front) is rejected by the same NCCL model, and the in-process pipeline under the enforcing loopback
(`NcclLoopbackTransport`) gives the single process's greedy tokens, and deadlocks when made to
issue the post-everything order."""

from __future__ import annotations

import pytest
import torch

from attnres_pp.generate.config import GenerationConfig
from attnres_pp.generate.engines import SingleProcessGenerator, make_generator
from attnres_pp.generate.loop import generate, generate_batch
from attnres_pp.pipeline.config import PipelineConfig
from attnres_pp.pipeline.loopback_nccl import NcclLoopbackTransport
from attnres_pp.schedule.forward_schedule import generation_schedule
from attnres_pp.schedule.validate_nccl import NcclDeadlock, check_nccl, lockstep_plan
from tests.pipeline_helpers import build_model, model_config

SEQ_LEN = 24
PROMPT = [3, 1, 4, 1, 5, 9, 2]
GREEDY = GenerationConfig(max_new_tokens=10, prefill_chunk=3, temperature=0)


def post_everything_plan(schedule):
    """The post-everything issue order (enough under gloo): every wire receive of the pass posted alone before the first
    action, every send alone where it stands."""
    plan = [[[] for _ in range(len(actions) + 1)] for actions in schedule.rank_actions]
    for rank, actions in enumerate(schedule.rank_actions):
        for index, action in enumerate(actions):
            if not action.is_compute and schedule.peer(action) != rank:
                plan[rank][0 if action.is_recv else index].append([action])
    return plan


def _setup(variant: str):
    cfg = model_config(variant, n_layers=4, seq_len=SEQ_LEN)
    return cfg, {name: p.detach().clone() for name, p in build_model(cfg).named_parameters()}


def _nccl_pipe(stages: int = 2, virtual: int = 2, launcher: str = "inprocess") -> PipelineConfig:
    return PipelineConfig(stages=stages, virtual=virtual, launcher=launcher, p2p_semantics="nccl", timeout_s=60.0)


@pytest.mark.parametrize(("stages", "virtual", "pieces"), [(2, 2, 1), (2, 2, 3), (3, 2, 2), (2, 3, 4), (4, 1, 3)])
def test_every_pass_is_proven_under_nccl_in_lockstep_groups(stages, virtual, pieces):
    schedule = generation_schedule(stages, virtual, pieces)
    check_nccl(schedule)  # generation_schedule checks it too; the plan the runtime issues is this one
    assert any(group for rank_plan in lockstep_plan(schedule) for groups in rank_plan for group in groups)


@pytest.mark.parametrize("pieces", [1, 3])
def test_posting_every_receive_up_front_deadlocks_under_nccl_at_v2(pieces):
    schedule = generation_schedule(2, 2, pieces)
    with pytest.raises(NcclDeadlock, match="deadlocks under NCCL"):
        check_nccl(schedule, post_everything_plan(schedule))


@pytest.mark.parametrize("variant", ["standard", "block", "lr_projected", "msar"])
def test_nccl_loopback_gives_the_single_process_tokens(variant):
    cfg, named = _setup(variant)
    want = generate(SingleProcessGenerator(cfg, named), PROMPT, GREEDY).tokens
    piped = make_generator(cfg, _nccl_pipe(), named)
    # the rules are enforced
    assert all(isinstance(w.runtime.transport, NcclLoopbackTransport) for w in piped.ranks.workers)
    assert generate(piped, PROMPT, GREEDY).tokens == want
    assert piped.ledger.records  # messages crossed between the ranks
    batch = [PROMPT, PROMPT[:2], PROMPT[:5]]  # a ragged batch under NCCL's rules too
    alone = [generate(SingleProcessGenerator(cfg, named), ids, GREEDY).tokens for ids in batch]
    assert [r.tokens for r in generate_batch(piped, batch, GREEDY)] == alone


def test_bf16_under_the_nccl_loopback_gives_the_single_process_bf16_tokens():
    """bf16 autocast: hops carry bf16 (2 bytes a number), and the tokens are the single process's."""
    cfg, named = _setup("msar")
    want = generate(SingleProcessGenerator(cfg, named, precision="bf16"), PROMPT, GREEDY).tokens
    piped = make_generator(cfg, _nccl_pipe(), named, precision="bf16")
    assert generate(piped, PROMPT, GREEDY).tokens == want
    piped.reset()
    piped.ledger.clear()
    piped.forward([(0, len(PROMPT))], torch.tensor([PROMPT]))  # one prefill pass of one sequence
    assert piped.ledger.records
    assert all(n_bytes == n_tensors * len(PROMPT) * cfg.source_width * 2
               for *_, n_tensors, n_bytes in piped.ledger.records)


def test_the_nccl_loopback_rejects_the_post_everything_order(monkeypatch):
    """The enforcing loopback catches a runtime issuing the post-everything order (so the parity
    above means something): the same pass, its executor's plan swapped for post_everything_plan, cannot finish."""
    from attnres_pp.pipeline import executor

    cfg, named = _setup("block")
    monkeypatch.setattr(executor, "lockstep_plan", post_everything_plan)
    piped = make_generator(cfg, _nccl_pipe(), named)
    with pytest.raises(RuntimeError, match="generation pass is stuck"):
        generate(piped, PROMPT, GREEDY)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_the_nccl_loopback_gives_the_single_process_tokens():
    cfg, named = _setup("msar")
    want = generate(SingleProcessGenerator(cfg, named, device="cuda", precision="bf16"), PROMPT, GREEDY).tokens
    piped = make_generator(cfg, _nccl_pipe(), named, device="cuda", precision="bf16")
    assert generate(piped, PROMPT, GREEDY).tokens == want


@pytest.mark.distributed
def test_nccl_order_over_gloo_rank_processes():
    """BatchedDistTransport (one batch_isend_irecv per planned group) between spawned ranks."""
    cfg, named = _setup("msar")
    want = generate(SingleProcessGenerator(cfg, named), PROMPT, GREEDY).tokens
    batch = [PROMPT[:2], PROMPT]
    alone = [generate(SingleProcessGenerator(cfg, named), ids, GREEDY).tokens for ids in batch]
    generator = make_generator(cfg, _nccl_pipe(launcher="local"), named)
    try:
        assert generate(generator, PROMPT, GREEDY).tokens == want
        assert [r.tokens for r in generate_batch(generator, batch, GREEDY)] == alone  # keep_rows on the ranks
    finally:
        generator.close()
