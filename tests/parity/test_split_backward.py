"""The backward split in I and W (`pipeline.split_backward`) against the fused backward B, per chunk
of every variant: the inputs' gradients after I alone, and every parameter's after W, in fp32 and
under bf16 autocast (bf16 hops, fp32 master weights); W runs no node of the input-gradient chain;
the matrix-product paths equal the engine twin."""

from __future__ import annotations

import pytest
import torch

from attnres_pp.comm.partition import make_partition
from attnres_pp.comm.plan import plan_for_model
from attnres_pp.model import Transformer
from attnres_pp.model.precision import activation_dtype
from attnres_pp.pipeline.chunk import build_rank_chunks
from attnres_pp.pipeline.split_backward import backward_input, backward_weight, fused_backward
from tests.pipeline_helpers import MICRO, SEQ, build_model, model_config
from tests.reference_model import VARIANTS, randomize_depth_params

P, V, N_LAYERS = 2, 2, 4  # four chunks of one layer: first (embedding), two middle, last (loss)


def _chunk_graph(variant: str, chunk_index: int, seed: int = 0, precision: str = "fp32", **recipe):
    """A fresh model, one forward of `chunk_index` on random inputs: (model, roots, root grads, input
    leaves). Under bf16 the chunk computes under autocast and its inputs are bf16, as hops carry them.
    `recipe`: ModelConfig fields beside the variant's (an MoE recipe of tests/parity/parity_cases.py)."""
    overrides = {} if variant in ("standard", "full") else {"block_size": 3}
    cfg = model_config(variant, N_LAYERS, **overrides, **recipe)
    if precision == "fp32":
        model = build_model(cfg)
    else:
        torch.manual_seed(0)
        model = Transformer(cfg, backend="torch", precision=precision)
        randomize_depth_params(model, torch.Generator().manual_seed(1))
    hop_dtype = activation_dtype(precision)
    partition = make_partition(N_LAYERS, P, V)
    plan = plan_for_model(cfg, partition, cache=True)
    chunk = build_rank_chunks(model, partition, partition.rank_of(chunk_index))[chunk_index]
    io = plan.chunks[chunk_index]
    g = torch.Generator().manual_seed(seed)
    width = cfg.d_model if cfg.residual == "standard" else cfg.source_width
    inputs = {s: torch.randn(MICRO, SEQ, width, generator=g).to(hop_dtype).requires_grad_(True)
              for s in io.received + io.cache_reads}
    idx = torch.randint(0, cfg.vocab_size, (MICRO, SEQ), generator=g)
    produced, loss = chunk(inputs, idx, idx)
    if loss is not None:
        return model, [loss], [torch.ones_like(loss)], list(inputs.values())
    roots = list(produced.values())
    return model, roots, [torch.randn(r.shape, generator=g).to(r.dtype) for r in roots], list(inputs.values())


def _grads(model, inputs) -> dict[str, torch.Tensor | None]:
    out = {name: p.grad for name, p in model.named_parameters()}
    out.update({f"input {i}": t.grad for i, t in enumerate(inputs)})
    return out


def _assert_close(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name, w in want.items():
        g = got[name]
        assert (g is None) == (w is None), name
        if w is not None:
            assert (g - w).abs().max().item() <= 1e-5 * w.abs().max().item() + 1e-8, name


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("chunk_index", range(P * V))
@pytest.mark.parametrize("known_flows", [True, False], ids=["products", "engine"])
def test_i_then_w_equals_b(variant, chunk_index, known_flows):
    model, roots, root_grads, inputs = _chunk_graph(variant, chunk_index)
    fused_backward(roots, root_grads)
    want = {k: None if v is None else v.clone() for k, v in _grads(model, inputs).items()}

    model, roots, root_grads, inputs = _chunk_graph(variant, chunk_index)
    work = backward_input(roots, root_grads, inputs)
    # After I alone the inputs' gradients are complete: they go back over the hop before W runs.
    for i, t in enumerate(inputs):
        assert (t.grad - want[f"input {i}"]).abs().max().item() <= 1e-5 * want[f"input {i}"].abs().max().item()
    # ... and the linear layers' weights are still untouched: their gradients are W's work.
    untouched = [n for n, p in model.named_parameters() if n.endswith(("qkv.weight", "down.weight", "lm_head.weight"))
                 and want[n] is not None]
    assert untouched and all(model.get_parameter(n).grad is None for n in untouched)
    backward_weight(work, known_flows=known_flows)
    got = _grads(model, inputs)
    _assert_close(got, want)
    assert not any(g is not None and (g.requires_grad or g.grad_fn is not None) for g in got.values())


def _input_path(roots: list[torch.Tensor], inputs: list[torch.Tensor]) -> set:
    """Every autograd node under `roots` from which an input leaf can be reached (the I chain)."""
    input_ids = {id(t) for t in inputs}
    memo: dict = {}

    def reaches(node) -> bool:
        if node not in memo:
            memo[node] = False  # a DAG: no cycles, this only guards repeats
            variable = getattr(node, "variable", None)
            below = [reaches(f) for f, _ in node.next_functions if f is not None]  # visit every child
            memo[node] = (variable is not None and id(variable) in input_ids) or any(below)
        return memo[node]

    for root in roots:
        reaches(root.grad_fn)
    return {node for node, hit in memo.items() if hit}


@pytest.mark.parametrize("variant", ["block", "msar", "lr_projected"])
def test_w_runs_no_node_of_the_input_gradient_chain(variant):
    """Matrix products' weight flows come from their saved operands, so none of the chain runs; a
    node with no such formula (MSAR's causal convolution, `stream_conv.shifted_streams`) runs
    once, for its weight output alone."""
    model, roots, root_grads, inputs = _chunk_graph(variant, 2)
    chain = _input_path(roots, inputs)
    work = backward_input(roots, root_grads, inputs)
    ran = []
    handles = [node.register_prehook(lambda grads, node=node: ran.append(node)) for node in chain]
    try:
        backward_weight(work)
    finally:
        for handle in handles:
            handle.remove()
    assert len(chain) > 20
    assert {node.name() for node in ran} == ({"MulBackward0", "_ShiftedStreamsBackward"} if variant == "msar"
                                                else set())
    assert len(ran) == len(set(ran))


def _split_matches_fused(variant: str, chunk_index: int, seed: int, cuts, key) -> None:
    model, roots, root_grads, inputs = _chunk_graph(variant, chunk_index, seed)
    backward_weight(backward_input(roots, root_grads, inputs, cuts, key))
    reference, roots, root_grads, reference_inputs = _chunk_graph(variant, chunk_index, seed)
    fused_backward(roots, root_grads)
    _assert_close(_grads(model, inputs), _grads(reference, reference_inputs))


def test_cut_cache_reuses_one_analysis_per_chunk_and_redoes_a_changed_graph():
    from attnres_pp.pipeline.graph_cut import CutCache

    cuts = CutCache()
    for seed in range(3):  # three microbatches of chunk 1: one analysis
        _split_matches_fused("block", 1, seed, cuts, key=1)
    assert cuts.analyses == 1
    # Another graph under the same key (chunk 3's, with the loss) is analysed again, not misread.
    _split_matches_fused("block", 3, 0, cuts, key=1)
    assert cuts.analyses == 2


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("chunk_index", range(P * V))
@pytest.mark.parametrize("known_flows", [True, False], ids=["products", "engine"])
def test_i_then_w_equals_b_under_bf16(variant, chunk_index, known_flows):
    """Under bf16 autocast the split computes B's very numbers: the same bf16 products, accumulated
    in the same fp32 master gradients; the inputs' gradients (what goes back over a hop) are bf16."""
    model, roots, root_grads, inputs = _chunk_graph(variant, chunk_index, precision="bf16")
    assert chunk_index == P * V - 1 or {r.dtype for r in roots} == {torch.bfloat16}  # the loss is fp32
    fused_backward(roots, root_grads)
    want = {k: None if v is None else v.clone() for k, v in _grads(model, inputs).items()}

    model, roots, root_grads, inputs = _chunk_graph(variant, chunk_index, precision="bf16")
    work = backward_input(roots, root_grads, inputs)
    for i, t in enumerate(inputs):  # complete after I alone, in the hop dtype
        assert t.grad.dtype == torch.bfloat16 and torch.equal(t.grad, want[f"input {i}"])
    backward_weight(work, known_flows=known_flows)
    got = _grads(model, inputs)
    assert got.keys() == want.keys()
    for name, w in want.items():
        assert (got[name] is None) == (w is None), name
        if w is not None:
            assert got[name].dtype == w.dtype == (torch.bfloat16 if name.startswith("input") else torch.float32)
            assert torch.equal(got[name], w), (name, (got[name] - w).abs().max().item())
