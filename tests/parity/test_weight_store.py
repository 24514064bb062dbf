"""The split backward's weight-gradient store (`pipeline.weight_store`: I frees the graph, W drains
the stashed operands) against its slow twin (I keeps the graph, `split_backward`): a whole step,
and bit for bit per chunk, fp32 and bf16. Also: what I leaves alive is the store alone (the
recomputed layers die with I), and the store lowers the counted peak of the checkpointed split
schedules. Its parity with the single-process model (every variant, split schedule, cache mode and
checkpointing policy, float64) is in tests/parity/test_parity.py's curated case list."""

from __future__ import annotations

import pytest
import torch

from attnres_pp.comm.plan import plan_for_model
from attnres_pp.model.weight_store_rule import GRADIENTS, OPERANDS
from attnres_pp.pipeline.chunk import build_rank_chunks
from attnres_pp.pipeline.memory_meter import ActivationMeter
from attnres_pp.pipeline.split_backward import backward_input, backward_weight
from attnres_pp.pipeline.weight_store import _Regen, drain_weight_store, stash_backward_input
from tests.pipeline_helpers import (
    MICRO,
    SEQ,
    assert_grads_match,
    build_model,
    loopback_step,
    model_config,
)
from tests.reference_model import VARIANTS

from .test_split_backward import P, V, _chunk_graph, _grads

SPLIT_SCHEDULES = [("zb_h1", 2, 1, 2), ("interleaved_zb", 2, 2, 2), ("zbv", 2, 2, 2)]


@pytest.mark.parametrize("policy", ["none", "full"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_store_equals_its_retained_graph_twin(variant, policy):
    """Linear weights: the same products in the same order, to the last bit; the small weights the
    store leaves to I (pseudo-queries, taps) add their flows in another order, to rounding."""
    cfg = model_config(variant, 4)
    _, stored, _ = loopback_step(cfg, "zbv", 2, 2, 2, True, policy)
    _, retained, _ = loopback_step(cfg, "zbv", 2, 2, 2, True, policy, retain=True)
    assert_grads_match(stored, retained, rtol=1e-6)
    linear = [n for n in retained if n.endswith(("qkv.weight", "proj.weight", "up.weight", "down.weight"))]
    assert linear and all(torch.equal(stored[n], retained[n]) for n in linear)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("chunk_index", range(P * V))
def test_stash_then_drain_equals_the_retained_split_per_chunk(variant, chunk_index, precision):
    model, roots, root_grads, inputs = _chunk_graph(variant, chunk_index, precision=precision)
    backward_weight(backward_input(roots, root_grads, inputs))
    want = {k: None if v is None else v.clone() for k, v in _grads(model, inputs).items()}

    model, roots, root_grads, inputs = _chunk_graph(variant, chunk_index, precision=precision)
    store = stash_backward_input(roots, root_grads, inputs)
    for i, t in enumerate(inputs):  # complete after I alone: they go back over the hop before W
        assert torch.equal(t.grad, want[f"input {i}"])
    untouched = [n for n, p in model.named_parameters() if n.endswith(("qkv.weight", "down.weight")) and
                 want[n] is not None]
    assert chunk_index == 0 or untouched
    assert all(model.get_parameter(n).grad is None for n in untouched)  # W's work
    drain_weight_store(store)
    got = _grads(model, inputs)
    assert got.keys() == want.keys()
    for name, w in want.items():
        assert (got[name] is None) == (w is None), name
        if w is not None:
            assert not got[name].requires_grad, name
            assert (got[name] - w).abs().max().item() <= 1e-5 * w.abs().max().item() + 1e-8, name
            if name.endswith(("qkv.weight", "proj.weight", "up.weight", "down.weight")):
                assert torch.equal(got[name], w), name  # the same product as the twin's


@pytest.mark.parametrize("policy", ["none", "full", "selective"])
@pytest.mark.parametrize("variant", ["block", "msar"])
def test_after_i_only_the_store_is_alive(variant, policy):
    """A middle chunk's forward, its I: the meter then counts the store's storages alone (the graph's
    saved tensors and every recomputed layer are gone); W leaves nothing."""
    from attnres_pp.comm.partition import make_partition as partition_of

    cfg = model_config(variant, 8)
    model = build_model(cfg)
    partition = partition_of(cfg.n_layers, 2, 1)
    plan = plan_for_model(cfg, partition, cache=True)
    chunk = build_rank_chunks(model, partition, 1, activation_checkpoint=policy)[1]
    g = torch.Generator().manual_seed(0)
    io = plan.chunks[1]
    chunk_inputs = {s: torch.randn(MICRO, SEQ, cfg.source_width, generator=g).requires_grad_(True)
                    for s in io.received + io.cache_reads}
    idx = torch.randint(0, cfg.vocab_size, (MICRO, SEQ), generator=g)
    meter = ActivationMeter()
    meter.set_excluded(model.parameters())
    produced, loss = chunk(chunk_inputs, idx, idx, meter=meter)
    after_forward = meter.live_bytes
    store = stash_backward_input([loss], [torch.ones_like(loss)], list(chunk_inputs.values()), meter=meter)
    del produced, loss
    held = {}
    for stash in store.products:
        for t in [stash.grad, *stash.operands]:
            # The gradient store's operands are recomputed in W: what it holds for them instead is
            # the layer frames' inputs (and, under selective, the kept outputs: never chosen here).
            for tensor in _frame_inputs(t, meter) if isinstance(t, _Regen) else [meter.unpack(t)]:
                held[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
    for flow in store.flows:
        tensor = meter.unpack(flow)
        held[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
    assert store.products and meter.live_bytes == sum(held.values())
    assert store.kind == (GRADIENTS if policy == "full" else OPERANDS)
    if policy == "none":
        assert meter.live_bytes < after_forward
    del t, flow, tensor  # the loops' last handles
    drain_weight_store(store)
    assert meter.live_bytes == 0


def _frame_inputs(regen, meter) -> list[torch.Tensor]:
    return [meter.unpack(h) for h in regen.frame.held_inputs]


@pytest.mark.parametrize("schedule_name", ["zb_h1", "interleaved_zb", "zbv"])
def test_the_store_lowers_the_checkpointed_split_peak(schedule_name):
    """Under full checkpointing the retained graph kept every recomputed layer until W; the store keeps
    only its operands, so the counted peak drops well below the twin's and below no checkpointing."""
    layout = next(s for s in SPLIT_SCHEDULES if s[0] == schedule_name)
    cfg = model_config("block", 8)
    peaks = {}
    for retain, policy in ((True, "full"), (False, "full"), (False, "none")):
        *_, records = loopback_step(cfg, *layout, True, policy, retain=retain)
        peaks[(retain, policy)] = max(r.activation_peak_bytes for r in records)
    assert peaks[(False, "full")] < 0.8 * peaks[(True, "full")], peaks
    assert peaks[(False, "full")] < peaks[(False, "none")], peaks


@pytest.mark.parametrize("path", ["grouped", "loop"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("chunk_index", [1, 3])
def test_expert_weight_gradients_are_ws_and_equal_the_fused_backward(chunk_index, precision, path, monkeypatch):
    """A chunk with an MoE layer (routed experts through torch's grouped matmul or its per-expert
    loop, a shared expert, the router): after I none of their weights has a gradient; after W each
    equals B's (fp32 to 1e-5; bf16 to the bit: the same bf16 products, cast as B's casts do)."""
    from attnres_pp.model import moe
    from attnres_pp.pipeline.split_backward import fused_backward
    from tests.parity.parity_cases import RECIPES

    if path == "loop":
        monkeypatch.setattr(moe, "_grouped_mm_fits", lambda *_: False)
    model, roots, root_grads, inputs = _chunk_graph("block", chunk_index, precision=precision, **RECIPES["moe"])
    fused_backward(roots, root_grads)
    want = {k: None if v is None else v.clone() for k, v in _grads(model, inputs).items()}

    model, roots, root_grads, inputs = _chunk_graph("block", chunk_index, precision=precision, **RECIPES["moe"])
    store = stash_backward_input(roots, root_grads, inputs)
    kinds = {(s.route.kind, s.route.expert is not None) for s in store.products}
    assert ("grouped", False) in kinds if path == "grouped" else ("linear", True) in kinds
    experts = [n for n in want if n.endswith(("experts.gate_up", "experts.down", "router.weight",
                                              "shared.gate_up.weight", "shared.down.weight")) and want[n] is not None]
    assert len(experts) == 5 and all(model.get_parameter(n).grad is None for n in experts)  # W's work
    del roots, root_grads
    drain_weight_store(store)
    got = _grads(model, inputs)
    for name, w in want.items():
        assert (got[name] is None) == (w is None), name
        if w is None:
            continue
        if precision == "bf16" and name in experts:
            assert torch.equal(got[name], w), name
        assert (got[name] - w).abs().max().item() <= 1e-5 * w.abs().max().item() + 1e-8, name


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("experts", [0, 8])
def test_the_store_after_i_is_the_simulators_count(experts, precision):
    """What I leaves (the meter's count of the store) is what the simulator prices for it
    (`simulator.memory_activation`, `simulator.moe`): each linear layer's and each grouped product's
    input and output gradient in the compute dtype, bf16 under autocast."""
    from attnres_pp.comm.partition import make_partition
    from attnres_pp.model import ModelConfig, Transformer
    from attnres_pp.model.precision import activation_dtype
    from attnres_pp.simulator.memory_activation import activation_bytes

    moe = {"moe_experts": experts, "moe_top_k": 2, "moe_shared_experts": 1, "moe_d_ff": 32} if experts else {}
    cfg = ModelConfig(n_layers=4, d_model=32, n_heads=2, seq_len=16, vocab_size=32, residual="standard", **moe)
    model = Transformer(cfg, precision=precision)
    partition = make_partition(cfg.n_layers, 2, 1)
    io = plan_for_model(cfg, partition, cache=True).chunks[1]
    chunk = build_rank_chunks(model, partition, 1)[1]
    g = torch.Generator().manual_seed(0)
    n_sequences = 4
    inputs = {s: torch.randn(n_sequences, cfg.seq_len, cfg.d_model, generator=g).to(activation_dtype(precision))
              .requires_grad_(True) for s in io.received + io.cache_reads}
    idx = torch.randint(0, cfg.vocab_size, (n_sequences, cfg.seq_len), generator=g)
    meter = ActivationMeter()
    meter.set_excluded(model.parameters())
    produced, loss = chunk(inputs, idx, idx, meter=meter)
    store = stash_backward_input([loss], [torch.ones_like(loss)], list(inputs.values()), meter=meter)
    del produced, loss
    predicted = activation_bytes(cfg, partition, 1, tokens=n_sequences * cfg.seq_len, dtype=precision)
    assert meter.live_bytes == predicted.stored > 0
    drain_weight_store(store)
