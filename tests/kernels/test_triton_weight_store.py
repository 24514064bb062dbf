"""The Triton depth-attention kernels under the split backward's weight-gradient store (I frees the
graph, W drains the stash): a pipelined step with `backend="triton"` (interpreted on CPU without a
GPU) gives the single-process torch model's loss and every gradient, for each variant family, a
split schedule with and without the cache, and activation checkpointing none and full. The kernels'
autograd Functions own weight edges (the pseudo-queries, the key projections' products, MSAR's
taps) that the store leaves to I's engine call; this checks that those flows reach W intact."""

import os

import torch

if not torch.cuda.is_available():  # before any kernel module is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from attnres_pp.kernels import dispatch  # noqa: E402
from tests.pipeline_helpers import (  # noqa: E402
    TORCH_TWINS,
    assert_grads_match,
    batch,
    loopback_step,
    model_config,
    reference_step,
)


def _refuse(name):
    def refused(*args, **kwargs):
        raise AssertionError(f"{name} ran: the torch twin, not the Triton kernel")
    return refused


# Checkpointing "none" stores operands for W, "full" stores gradients: each store kind runs the kernels'
# weight edges. The block variant under "none" is not a case of its own: its ops (phase 1 and 2 with the
# pseudo-query edge) are lr_sliced's, which runs them through the operand store, and its schedule and
# cache are block-zbv-cached-full's.
CASES = [  # (variant, schedule, P, V, m, cache, activation checkpointing)
    ("block", "zbv", 2, 2, 2, True, "full"),
    ("lr_projected", "interleaved_zb", 2, 2, 2, True, "full"),
    ("lr_sliced", "zb_h1", 2, 1, 2, False, "none"),
    ("msar", "zbv", 2, 2, 2, False, "full"),
]


# One conv stream (two streams) instead of the variant's two: the taps' weight edge is one tensor
# whatever the stream count, and the interpreter's cost grows with it (test_triton_msar_streams.py
# checks m = 3 and 4 streams against the float64 reference).
OVERRIDES = {"msar": dict(stream_kernels=(2,))}


def _case_id(case) -> str:
    return "-".join((case[0], case[1], "cached" if case[5] else "naive", case[6]))


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_triton_kernels_under_the_weight_store_equal_single_process(case, kernel_device, monkeypatch):
    variant, schedule_name, P, V, m, cache, policy = case
    cfg = model_config(variant, 4, **OVERRIDES.get(variant, {}))
    for name in TORCH_TWINS:  # the step runs Triton only
        monkeypatch.setattr(dispatch, name, _refuse(name))
    loss, grads, _ = loopback_step(cfg, schedule_name, P, V, m, cache, policy, backend="triton")
    monkeypatch.undo()
    want_loss, want_grads = reference_step(cfg, *batch(m), m)
    assert abs(loss - want_loss) <= 1e-5 * abs(want_loss), (loss, want_loss)
    assert_grads_match(grads, want_grads, rtol=1e-4)
