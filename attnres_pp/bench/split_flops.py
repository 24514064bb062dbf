"""The split backward's FLOPs counted: per chunk, the matrix-product FLOPs of the fused backward B,
of I and of W (`torch.utils.flop_counter`), and W's share of I + W.

The split exists to move the weight gradients out of I: W's share is what the zero-bubble
schedules fill their bubbles with, and it must not depend on the precision (under bf16 autocast
the weights enter through their casts; `pipeline.weight_operands` sees through them). torch's
counter leaves out three products this model runs, so they are counted here by the same rule
(2 FLOPs a multiply-add): torch's grouped matmul (the routed experts), the in-place addmm W adds
a linear weight's gradient with, and the CPU's flash attention, forward and backward.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

aten = torch.ops.aten


def _grouped_mm_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """2 m k n summed over the groups: [m, k] x [E, k, n], [m, k] x [k, n] grouped along k (the
    weight gradient), [E, m, k] x [k, n] grouped along n, or [E, m, k] x [E, k, n]."""
    if len(a_shape) == 2:
        m, k = a_shape
        return 2 * m * k * b_shape[-1]
    groups, m, k = a_shape
    return 2 * m * k * b_shape[-1] * (groups if len(b_shape) == 3 else 1)


def _addmm_flops(self_shape, a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    return 2 * a_shape[0] * a_shape[1] * b_shape[1] + a_shape[0] * b_shape[1]


def _cpu_flash_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _cpu_flash_backward_flops(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None,
                              **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


EXTRA_FORMULAS = {
    aten._grouped_mm: _grouped_mm_flops,
    aten.addmm_: _addmm_flops,
    aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash_flops,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_flash_backward_flops,
}


def counted_flops(fn: Callable[..., object], *args) -> tuple[object, int, dict[str, int]]:
    """(fn(*args), its total FLOPs, FLOPs by operator name)."""
    with FlopCounterMode(display=False, custom_mapping=EXTRA_FORMULAS) as counter:
        result = fn(*args)
    by_op = {str(op).split(".")[-1]: n for op, n in counter.get_flop_counts().get("Global", {}).items()}
    return result, counter.get_total_flops(), by_op


def chunk_backward_flops(run: Callable[[], tuple[list, list, list]], model: torch.nn.Module, key: object,
                         cuts=None) -> dict:
    """One chunk's backward FLOPs: `run()` does a forward of `model`'s chunk `key` and returns
    (roots, root grads, input leaves); B on one forward, I and W (the weight store, as the runtime
    runs them) on another. Returns B, I, W and the FLOPs by operator in I and in W."""
    from attnres_pp.pipeline.graph_cut import CutCache
    from attnres_pp.pipeline.split_backward import fused_backward
    from attnres_pp.pipeline.weight_store import drain_weight_store, stash_backward_input

    cuts = cuts or CutCache()
    model.zero_grad(set_to_none=True)
    roots, grads, _inputs = run()
    _, flops_b, _ = counted_flops(fused_backward, roots, grads)
    model.zero_grad(set_to_none=True)
    roots, grads, inputs = run()
    store, flops_i, ops_i = counted_flops(stash_backward_input, roots, grads, inputs, cuts, key)
    del roots, grads  # as the runtime does: the store's I lets the rest of the graph go
    _, flops_w, ops_w = counted_flops(drain_weight_store, store)
    model.zero_grad(set_to_none=True)
    return {"B": flops_b, "I": flops_i, "W": flops_w, "I_ops": ops_i, "W_ops": ops_w}


def w_share(rows: list[dict]) -> float:
    """W's share of the split's backward FLOPs, summed over the chunks that have inputs (chunk 0's
    I has nothing to do: its whole backward is W in any precision)."""
    rest = [r for r in rows if r["chunk"] > 0]
    return sum(r["W"] for r in rest) / sum(r["I"] + r["W"] for r in rest)
