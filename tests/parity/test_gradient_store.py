"""The gradient store (`pipeline.weight_store` under activation checkpointing: I keeps the linear
layers' output gradients and the layers' checkpoint inputs, W recomputes the operands): a pipelined
step under every split schedule equals the single-process model (fp32 1e-5, float64 1e-10) for the
standard residual, Block AttnRes with the cache, MSAR and an MoE recipe, and the store was the
gradient store; selective checkpointing, where the rule picks the operand store, forced onto the
gradient store (W's recomputation served from the policy's kept outputs); and the rule itself."""

from __future__ import annotations

import pytest
import torch

from attnres_pp.model.weight_store_rule import GRADIENTS, OPERANDS, weight_store_bytes, weight_store_kind
from attnres_pp.pipeline import weight_store
from tests.pipeline_helpers import assert_step_matches, batch, loopback_step, reference_step

from .parity_cases import BF16_SPLIT_CASES, ParityCase, _case

CASES = [
    _case(("zbv", 2, 2, 3, 4, None), "standard", policy="full"),
    _case(("interleaved_zb", 2, 2, 3, 4, 2), "block", policy="full"),
    _case(("zb_h1", 2, 1, 2, 4, 2), "msar", policy="full"),
    _case(("v_half", 2, 2, 4, 4, 2), "block", policy="full", recipe="moe"),
    _case(("v_min", 2, 2, 4, 4, 2), "msar", policy="full"),
    _case(("zbv", 2, 2, 3, 4, 2), "block", policy="full", dtype="float64"),
    _case(("zbv", 2, 2, 3, 4, None), "standard", policy="full", recipe="moe", dtype="float64"),
    _case(("v_min", 2, 2, 4, 4, 2), "block", policy="selective"),
    _case(("zb_h1", 2, 1, 2, 4, None), "standard", policy="selective", recipe="moe", dtype="float64"),
]


def _spied_kinds(monkeypatch, force: bool) -> list[str]:
    """The kinds the chunks' I chose; `force`: the gradient store wherever a chunk is checkpointed."""
    kinds: list[str] = []
    rule = weight_store.weight_store_kind

    def spy(operand_bytes, checkpoint_bytes):
        kind = GRADIENTS if force and checkpoint_bytes is not None else rule(operand_bytes, checkpoint_bytes)
        kinds.append(kind)
        return kind

    monkeypatch.setattr(weight_store, "weight_store_kind", spy)
    return kinds


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_the_gradient_store_step_equals_single_process(case: ParityCase, monkeypatch):
    kinds = _spied_kinds(monkeypatch, force=case.policy == "selective")
    cfg, m = case.config(), case.n_microbatches
    loss, grads, _ = loopback_step(cfg, case.schedule, case.n_stages, case.n_virtual, m, case.cache, case.policy,
                                   dtype=case.torch_dtype)
    assert GRADIENTS in kinds  # every chunk with inputs chose (or was given) the gradient store
    assert set(kinds) == {GRADIENTS}
    want_loss, want_grads = reference_step(cfg, *batch(m), m, dtype=case.torch_dtype)
    assert_step_matches(case.dtype, loss, grads, want_loss, want_grads)


@pytest.mark.parametrize("case", [c for c in BF16_SPLIT_CASES if c.policy == "full"], ids=lambda case: case.id)
def test_under_bf16_the_gradient_store_gives_the_fused_backwards_weight_gradients(case: ParityCase, monkeypatch):
    """bf16 autocast: W recomputes the layers under the forward's autocast state, so the products'
    operands are the bf16 casts B's engine used, and the weights' gradients are B's to the bit."""
    from .test_split_bf16 import WEIGHTS, _pipelined

    kinds = _spied_kinds(monkeypatch, force=False)
    loss, grads = _pipelined(case)
    assert GRADIENTS in kinds
    fused_loss, fused = _pipelined(case, fused=True)
    assert loss == fused_loss
    for name, want in fused.items():
        if name.endswith(WEIGHTS):
            assert torch.equal(grads[name], want), name
        else:
            assert (grads[name] - want).abs().max().item() <= 1e-5 * want.abs().max().item() + 1e-12, name


def test_selective_checkpointing_chooses_the_operand_store(monkeypatch):
    """The policy keeps the projections' outputs: keeping them until W costs more than the operands."""
    kinds = _spied_kinds(monkeypatch, force=False)
    case = _case(("zbv", 2, 2, 3, 4, 2), "block", policy="selective")
    loopback_step(case.config(), case.schedule, 2, 2, 3, True, "selective")
    assert kinds and set(kinds) == {OPERANDS}


@pytest.mark.parametrize("variant", ["standard", "block"])
def test_after_i_the_gradient_store_holds_less_than_the_operand_store(variant, monkeypatch):
    """A middle chunk of 4 checkpointed layers: the meter's count after I (what waits for W) under
    the gradient store is below the operand store's by at least the layers' operands less their
    checkpoint inputs; after W both leave nothing, with the same gradients."""
    import torch

    from attnres_pp.comm.partition import make_partition
    from attnres_pp.comm.plan import plan_for_model
    from attnres_pp.pipeline.chunk import build_rank_chunks
    from attnres_pp.pipeline.memory_meter import ActivationMeter
    from tests.pipeline_helpers import MICRO, SEQ, build_model, model_config

    cfg = model_config(variant, 8)
    counted, grads = {}, {}
    for force in (OPERANDS, GRADIENTS):
        monkeypatch.setattr(weight_store, "weight_store_kind", lambda _o, _c, force=force: force)
        model = build_model(cfg)
        partition = make_partition(cfg.n_layers, 2, 1)
        io = plan_for_model(cfg, partition, cache=True).chunks[1]
        chunk = build_rank_chunks(model, partition, 1, activation_checkpoint="full")[1]
        g = torch.Generator().manual_seed(0)
        width = cfg.d_model if cfg.residual == "standard" else cfg.source_width
        inputs = {s: torch.randn(MICRO, SEQ, width, generator=g).requires_grad_(True)
                  for s in io.received + io.cache_reads}
        idx = torch.randint(0, cfg.vocab_size, (MICRO, SEQ), generator=g)
        meter = ActivationMeter()
        meter.set_excluded(model.parameters())
        produced, loss = chunk(inputs, idx, idx, meter=meter)
        store = weight_store.stash_backward_input([loss], [torch.ones_like(loss)], list(inputs.values()),
                                                  meter=meter)
        del produced, loss
        counted[force] = meter.live_bytes
        assert store.kind == force
        weight_store.drain_weight_store(store)
        assert meter.live_bytes == 0
        grads[force] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    # Per layer and token the operands are at least 4 d (qkv's, proj's, gate/up's inputs and the
    # hidden units), the checkpoint inputs one d-wide residual or partial (blocks are shared).
    layers, tokens = 4, MICRO * SEQ
    assert counted[GRADIENTS] <= counted[OPERANDS] - layers * tokens * 2 * cfg.d_model * 4, counted
    assert grads[GRADIENTS].keys() == grads[OPERANDS].keys()
    assert all(torch.equal(grads[GRADIENTS][n], grads[OPERANDS][n]) for n in grads[OPERANDS])


def test_the_rule():
    assert weight_store_kind(100, None) == OPERANDS  # nothing checkpointed: nothing to recompute from
    assert weight_store_kind(100, 40) == GRADIENTS
    assert weight_store_kind(100, 100) == OPERANDS  # a tie costs W a forward for nothing
    assert weight_store_kind(100, 140) == OPERANDS
    assert weight_store_bytes(10, 100, 40) == 50
    assert weight_store_bytes(10, 100, 140) == 110
    assert weight_store_bytes(10, 100, None) == 110
