"""The split backward's FLOPs, counted (`bench.split_flops`): W computes the weight gradients in bf16
as in fp32. Under bf16 autocast the weights enter through their casts; the W store sees through
them (`pipeline.weight_operands`), so W's share of the backward's matrix-product FLOPs is fp32's
(within 5%; here to the FLOP), for dense layers and for mixtures of experts (the routed experts'
grouped matmul, the shared experts and the router); I + W is exactly B (nothing computed twice)."""

from __future__ import annotations

import pytest

from attnres_pp.bench.split_flops import chunk_backward_flops, w_share

from .parity_cases import RECIPES
from .test_split_backward import P, V, _chunk_graph


def _rows(variant: str, precision: str, recipe: str) -> list[dict]:
    rows = []
    for c in range(P * V):
        model, *_ = _chunk_graph(variant, c, precision=precision, **RECIPES[recipe])

        def run(c=c):
            return _chunk_graph(variant, c, precision=precision, **RECIPES[recipe])[1:]

        rows.append({"chunk": c, **chunk_backward_flops(run, model, c)})
    return rows


@pytest.mark.parametrize("recipe", ["default", "moe"])
@pytest.mark.parametrize("variant", ["standard", "block", "msar"])
def test_w_share_of_backward_flops_under_bf16_equals_fp32(variant, recipe):
    shares = {}
    for precision in ("fp32", "bf16"):
        rows = _rows(variant, precision, recipe)
        for row in rows:
            assert row["I"] + row["W"] == row["B"] > 0, (precision, row)
        assert rows[0]["I"] == 0  # chunk 0 has no inputs: its whole backward is W
        for row in rows[1:]:
            # W forms every linear (and expert) weight's gradient: as many FLOPs as the input
            # gradients of those products, which I forms beside the attention's and depth reads'.
            assert row["W_ops"]["mm"] <= row["I_ops"]["mm"], row
            if recipe == "moe":  # the routed experts: dX in I, dW in W, the same FLOPs each
                assert row["W_ops"]["_grouped_mm"] == row["I_ops"]["_grouped_mm"] > 0, row
        shares[precision] = w_share(rows)
    assert shares["fp32"] > 0.3, shares
    assert abs(shares["bf16"] - shares["fp32"]) <= 0.05 * shares["fp32"], shares
