"""The split schedules under bf16 autocast (`--dtype bf16`): a pipelined step whose I and W run
through the weight store, which keeps the bf16 operands of the weights' casts
(`pipeline.weight_operands`), gives the loss and every gradient of the single-process bf16 model
(one fused backward per microbatch), and its gradients are those of the same schedule with each I a
fused backward B and no W (the fused bf16 backward: the linear and expert weights' to the bit), over
tests/parity/parity_cases.py's BF16_SPLIT_CASES."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from attnres_pp.comm.plan import plan_for_model
from attnres_pp.model import Transformer
from attnres_pp.model.moe import set_aux_scale
from attnres_pp.pipeline.chunk import build_rank_chunks
from attnres_pp.pipeline.loopback import make_loopback_runtimes, run_loopback_step
from attnres_pp.schedule.ir import Action, ActionKind, Schedule
from attnres_pp.schedule.passes import insert_comm
from attnres_pp.schedule.schedules import build_schedule
from attnres_pp.schedule.validate import validate
from tests.pipeline_helpers import MICRO, SEQ, batch
from tests.reference_model import randomize_depth_params

from .parity_cases import BF16_SPLIT_CASES, ParityCase

WEIGHTS = ("qkv.weight", "proj.weight", "gate_up.weight", "down.weight", "lm_head.weight", "experts.gate_up",
           "experts.down", "router.weight")


def _model(case: ParityCase) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(case.config(), backend="torch", precision=case.precision)
    randomize_depth_params(model, torch.Generator().manual_seed(1))
    return model


def _reference(case: ParityCase) -> tuple[float, dict]:
    model, m = _model(case), case.n_microbatches
    set_aux_scale(model, 1.0 / m)
    inputs, targets = batch(m)
    total = 0.0
    for i, t in zip(inputs.chunk(m), targets.chunk(m), strict=True):
        loss = model(i, t)
        (loss / m).backward()
        total += float(loss.detach())
    return total / m, {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def fused_twin(schedule: Schedule) -> Schedule:
    """The same order with each I a fused backward B and no W: the split schedule's fused backward."""
    return dataclasses.replace(schedule, rank_actions=tuple(
        tuple(Action(ActionKind.B, a.chunk_index, a.microbatch_index) if a.kind is ActionKind.I else a
              for a in actions if a.kind is not ActionKind.W) for actions in schedule.rank_actions))


def _pipelined(case: ParityCase, retain: bool = False, fused: bool = False) -> tuple[float, dict]:
    cfg, m, model = case.config(), case.n_microbatches, _model(case)
    partition = case.partition()
    rank_chunks = [build_rank_chunks(model, partition, r, activation_checkpoint=case.policy)
                   for r in range(case.n_stages)]
    schedule = build_schedule(case.schedule, case.n_stages, case.n_virtual, m)
    schedule = insert_comm(fused_twin(schedule) if fused else schedule)
    validate(schedule)
    runtimes = make_loopback_runtimes(cfg, rank_chunks, plan_for_model(cfg, partition, case.cache), schedule,
                                      (MICRO, SEQ), activation_dtype=torch.bfloat16)
    assert not any(r.split_retains_graph for r in runtimes)  # the weight store is the default
    for runtime in runtimes:
        runtime.split_retains_graph = retain
    inputs, targets = batch(m)
    records = run_loopback_step(runtimes, list(inputs.chunk(m)), list(targets.chunk(m)), 1.0 / m)
    losses = {mb: loss for r in records for mb, loss in r.losses.items()}
    assert sorted(losses) == list(range(m))
    return sum(losses.values()) / m, {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("case", BF16_SPLIT_CASES, ids=lambda case: case.id)
def test_bf16_split_step_equals_its_fused_backward(case: ParityCase):
    assert case.split and case.precision == "bf16"
    loss, grads = _pipelined(case)
    fused_loss, fused = _pipelined(case, fused=True)
    assert loss == fused_loss
    want_loss, _ = _reference(case)
    assert abs(loss - want_loss) <= 1e-5 * abs(want_loss), (loss, want_loss)  # bf16 computed as one process does
    assert grads.keys() == fused.keys()
    for name, want in fused.items():
        got = grads[name]
        assert got is not None and got.dtype == torch.float32, name
        # The weights' gradients are W's products, B's to the bit; the small weights whose flows I
        # computes (queries, taps) reach their fp32 .grad in another order, to fp32 rounding.
        if name.endswith(WEIGHTS):
            assert torch.equal(got, want), (name, (got - want).abs().max().item())
        else:
            assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item() + 1e-12, name
