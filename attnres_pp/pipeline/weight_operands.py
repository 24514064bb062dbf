"""The weight edges whose operands the W store keeps (`weight_store`), and W's product for each.

A weight edge k = 1 of a matrix product whose other operand is an activation, and whose branch is
one parameter seen through a transpose, autocast's cast and at most one expert's slice:
- `linear`: out = x @ w.t() (an MmBackward0): w a linear layer's weight, its bf16 cast under
  autocast, or expert e's rows of a stacked expert weight (`model.moe.grouped_matmul_loop`, the
  grouped matmul's twin); W forms dw = g.t() @ x;
- `grouped`: out = torch._grouped_mm(x, w.transpose(1, 2), offs) (a GroupedMmBackward0: the routed
  experts, `model.moe.grouped_matmul`); W forms dw[e] = g_e.t() @ x_e for every expert at once.
The product runs in the operands' dtype, in the layout B's engine computes it (so its bits are B's),
then goes where the branch takes it: cast to the parameter's dtype (the cast's backward: fp32
master weights under bf16) and added to its `.grad`, or to expert e's slice of it.

Seeing through the cast is what lets the split split under bf16: the cast is a node between the
product and the parameter, so without it I's engine call would compute the weight-sized gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.autograd.graph import Node

_WRAP = 2**64  # a negative dimension saved by a node reads back as its unsigned 64-bit value


@dataclass(frozen=True)
class WeightRoute:
    """How the flow along one weight edge reaches its parameter: `kind` "linear" or "grouped",
    `param` the leaf, `expert` the slice of a stacked parameter it fills (None: all of it)."""

    kind: str
    param: torch.Tensor
    expert: int | None = None


def weight_route(owner: Node, k: int, target: Node, weight_ids: set[int] | None) -> WeightRoute | None:
    """The route of edge k of `owner` into `target`, if it is one the store keeps operands for and
    its parameter is a W parameter (`weight_ids`, None: any); None otherwise."""
    if k != 1:
        return None
    name, target_name = owner.name(), target.name()
    if name == "MmBackward0" and target_name == "TBackward0":
        kind = "linear"
    elif name == "GroupedMmBackward0" and target_name == "TransposeBackward0" and _swaps_last_two(target):
        kind = "grouped"
    else:
        return None
    node, expert = _only_child(target), None
    if kind == "linear" and node is not None and node.name() == "SelectBackward0" and node._saved_dim == 0:
        node, expert = _only_child(node), int(node._saved_index)
    if node is not None and node.name() == "ToCopyBackward0":
        node = _only_child(node)
    param = getattr(node, "variable", None)
    if param is None or (weight_ids is not None and id(param) not in weight_ids):
        return None
    return WeightRoute(kind, param, expert)


def _only_child(node: Node) -> Node | None:
    live = [f for f, _nr in node.next_functions if f is not None]
    return live[0] if len(live) == 1 else None


def _swaps_last_two(node: Node) -> bool:
    dims = {(d - _WRAP if d >= _WRAP // 2 else d) % 3 for d in (node._saved_dim0, node._saved_dim1)}
    return dims == {1, 2}


def operand_names(kind: str) -> tuple[str, ...]:
    """The owner's saved tensors W's product needs besides the gradient the owner receives."""
    return ("_saved_self",) if kind == "linear" else ("_saved_self", "_saved_offs")


@torch.no_grad()
def accumulate_weight(route: WeightRoute, grad_MN: torch.Tensor, operands: tuple[torch.Tensor, ...]) -> None:
    """Add the weight gradient of `route` from the owner's received gradient `grad_MN` and its
    `operands` (`operand_names`) to the parameter's `.grad`."""
    param, x_MK = route.param, operands[0]
    if route.kind == "grouped":
        flow = torch._grouped_mm(grad_MN.t(), x_MK, offs=operands[1])  # [E, N, K]: w's own layout
    elif route.expert is None and x_MK.dtype == param.dtype:
        # fp32 linear: straight into .grad in W's layout (one matmul, no transposed copy)
        if param.grad is None:
            param.grad = grad_MN.t().mm(x_MK)
        else:
            param.grad.addmm_(grad_MN.t(), x_MK)
        return
    else:
        flow = grad_MN.t().mm(x_MK)  # [N, K]: w's (or expert e's) layout
    flow = flow.to(param.dtype)
    if route.expert is None:
        if param.grad is None:
            param.grad = flow  # a fresh product, never a view of a message
        else:
            param.grad += flow
        return
    if param.grad is None:
        param.grad = torch.zeros_like(param, memory_format=torch.contiguous_format)
    param.grad[route.expert] += flow
