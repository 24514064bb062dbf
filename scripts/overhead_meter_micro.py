"""What one saved tensor costs under a saved-tensor hook, split into its parts: autograd's side of any
Python hook (an identity pack), then the meter's steps one by one (`.data` of a saved output, the
storage key, a tuple handle), then each tree's whole meter. A tiny graph (5 saves an iteration: two
inputs, one output saved twice, one more input) so the hooks, not the arithmetic, are what is timed;
thread CPU time, the best of 15 alternating rounds of 2,000 iterations, microseconds per saved tensor
over no hook at all.

Usage: PYTHONPATH=. python scripts/overhead_meter_micro.py TREE [TREE ...]
(each TREE a checkout whose attnres_pp/pipeline/memory_meter.py is loaded under its own name)
"""

from __future__ import annotations

import sys
import time

import torch

from scripts.overhead_meter_cost import load_meter

SAVES_PER_ITERATION = 5


def _identity(t):
    return t


def _data(t):
    return t if t.is_leaf else t.data


def _keyed(t):
    _key = ("cpu", t.untyped_storage().data_ptr())
    return t if t.is_leaf else t.data


def _tupled(t):
    return (t if t.is_leaf else t.data, ("cpu", t.untyped_storage().data_ptr()))


def _first(handle):
    return handle[0]


def _body(x: torch.Tensor, w: torch.Tensor, n: int) -> None:
    for _ in range(n):
        a = x * w  # saves x and w (inputs)
        b = a.exp()  # saves its output b
        (b * a).sum().backward()  # saves b again (one storage) and a


def main(trees: list[str]) -> None:
    torch.set_num_threads(1)
    meters = [load_meter(tree, i)() for i, tree in enumerate(trees)]
    modes = {"none": None, "identity": (_identity, _identity), "+.data": (_data, _identity),
             "+key": (_keyed, _identity), "+tuple": (_tupled, _first),
             **{tree: (m.pack, m.unpack) for tree, m in zip(trees, meters, strict=True)}}
    x, w = torch.randn(8, requires_grad=True), torch.randn(8, requires_grad=True)
    best = dict.fromkeys(modes, float("inf"))
    for r in range(15):
        for name, hooks in (list(modes.items()) if r % 2 else list(modes.items())[::-1]):
            started = time.thread_time()
            if hooks is None:
                _body(x, w, 2000)
            else:
                with torch.autograd.graph.saved_tensors_hooks(*hooks):
                    _body(x, w, 2000)
            best[name] = min(best[name], (time.thread_time() - started) / 2000 / SAVES_PER_ITERATION * 1e6)
    print("us per saved tensor over no hook: "
          + ", ".join(f"{k} {v - best['none']:.2f}" for k, v in best.items() if k != "none"))


if __name__ == "__main__":
    main(sys.argv[1:])
