"""A chunk's backward split in two (docs/spec.md section 5): `backward_input` (I) computes the gradients of
the chunk's inputs (what goes back over the hop and into cache deposits), `backward_weight` (W)
later computes the parameters' gradients, without running any part of the input-gradient chain again.

`graph_cut` finds where weight branches leave the input-gradient chain N_in. Then:
- I runs the engine once, for the inputs, the I parameters, and the gradient each owner x of a
  weight edge x -> f receives (captured by the engine as an extra output; retain_graph keeps the
  graph for W);
- W computes the flow along every weight edge from x's gradient: for matrix products from their
  saved operands (a linear layer's weight gradient goes straight into its .grad in its own layout);
  for any other node by the engine, which then runs x alone, for its weight outputs only (f has no
  other way in). One more engine call carries those flows, and the roots outside N_in (all of
  chunk 0), to the W parameters.
torch.distributed.pipelining's stage_backward_weight groups parameters by the nodes they share and
restarts the engine from those nodes, which reruns the chain between a block's pseudo-queries
(I + W was twice B on this model); this split never does. `fused_backward` is B, the one-call twin.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node

from attnres_pp.pipeline.graph_cut import CutCache


@dataclass
class WeightWork:
    """What I leaves for W: the owners of weight edges with the gradients they received in I, the
    roots outside N_in with their gradients, and the parameters W accumulates into."""

    owners: list[tuple[Node, list[tuple[int, Node, int]], tuple]] = field(default_factory=list)
    outside_roots: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    params: list[torch.Tensor] | None = field(default_factory=list)  # None: every leaf of the graph


def fused_backward(roots: list[torch.Tensor], root_grads: list[torch.Tensor]) -> None:
    """B: input and parameter gradients in one engine call (they accumulate in `.grad`)."""
    if roots:
        torch.autograd.backward(roots, root_grads)


def backward_input(roots: list[torch.Tensor], root_grads: list[torch.Tensor], inputs: list[torch.Tensor],
                   cuts: CutCache | None = None, key: object = None) -> WeightWork:
    """I: accumulate the gradients of `inputs` (leaves that require grad) and of the I parameters in
    their `.grad`; return the work W does. `cuts` keeps the graph analysis of each `key` (a chunk)."""
    pairs = [(r, g) for r, g in zip(roots, root_grads, strict=True) if r.grad_fn is not None]
    if not pairs:
        return WeightWork()
    if not inputs:  # chunk 0: nothing goes back, all of it is W
        return WeightWork(outside_roots=pairs, params=None)
    cut = (cuts or CutCache()).cut(key, [r.grad_fn for r, _ in pairs], inputs)
    slots = [GradientEdge(owner, i) for owner, _edges, n_out in cut.owners for i in range(n_out)]
    wanted = list(inputs) + cut.input_params
    grads = torch.autograd.grad([r for r, _ in pairs], wanted + slots,
                                grad_outputs=[g for _, g in pairs], retain_graph=True, allow_unused=True)
    # grads holds the wanted tensors' gradients, then the owners' slots (read below).
    accumulate_leaf_grads(wanted, grads[:len(wanted)], len(inputs))
    owners, first = [], len(wanted)
    for owner, edges, n_out in cut.owners:
        owners.append((owner, edges, grads[first:first + n_out]))
        first += n_out
    return WeightWork(owners=owners, outside_roots=[pairs[r] for r in cut.outside_roots], params=cut.weight_params)


@torch.no_grad()  # the saved operands are activations with a graph: build none on them
def backward_weight(work: WeightWork, *, known_flows: bool = True) -> None:
    """W: the parameters' gradients left by `backward_input`, accumulated in their `.grad`.

    known_flows=False takes the engine for every owner (the slow twin of the matrix-product paths).
    """
    edges, flows = [], []
    weight_ids = None if work.params is None else {id(p) for p in work.params}
    for owner, weight_edges, kept in work.owners:
        if all(g is None for g in kept):  # no gradient reached the owner in I
            continue
        if known_flows and owner.name() in PRODUCTS and kept[0] is not None:
            for k, f, nr in weight_edges:
                if _accumulate_linear_weight(owner, kept[0], k, f):
                    continue
                flow = _product_flow(owner, kept[0], k)
                if not accumulate_along(f, flow, weight_ids):
                    edges.append(GradientEdge(f, nr))
                    flows.append(flow)
            continue
        edges_out, flows_out = _engine_flows(owner, kept, weight_edges)
        edges += edges_out
        flows += flows_out
    for root, grad in work.outside_roots:
        edges.append(root)
        flows.append(grad)
    if edges and (work.params is None or work.params):
        torch.autograd.backward(edges, flows, inputs=work.params)
    work.owners.clear()
    work.outside_roots.clear()


def accumulate_leaf_grads(tensors: list[torch.Tensor], grads, n_inputs: int) -> None:
    """Add `grads` to the `.grad` of `tensors`: the first `n_inputs` are the chunk's inputs, the rest
    parameters."""
    for position, (tensor, grad) in enumerate(zip(tensors, grads, strict=True)):
        if grad is None:
            continue
        if tensor.grad is not None:
            tensor.grad += grad
        elif position >= n_inputs and grad._base is not None:
            # A parameter's .grad is added to in place later: never let it be a view of another
            # tensor (a gradient passed through unchanged could be a received message's slot).
            tensor.grad = grad.clone()
        else:
            tensor.grad = grad


def _engine_flows(owner: Node, kept: tuple, weight_edges: list[tuple[int, Node, int]]):
    """The flows along `owner`'s weight edges, by the engine. Each edge's target has no other way
    in, so only `owner` runs; but the engine walks the whole graph below it first."""
    slots = [i for i, g in enumerate(kept) if g is not None]
    targets = [GradientEdge(f, nr) for _k, f, nr in weight_edges]
    grads = torch.autograd.grad([GradientEdge(owner, i) for i in slots], targets,
                                grad_outputs=[kept[i] for i in slots], allow_unused=True)
    pairs = [(t, g) for t, g in zip(targets, grads, strict=True) if g is not None]
    return [t for t, _ in pairs], [g for _, g in pairs]


PRODUCTS = frozenset({"MmBackward0", "MvBackward0", "BmmBackward0"})


# The saved operand each edge's flow needs, per matrix product (out = self @ other).
PRODUCT_OPERANDS = {"MvBackward0": ("_saved_vec", "_saved_self"), "MmBackward0": ("_saved_mat2", "_saved_self"),
                    "BmmBackward0": ("_saved_mat2", "_saved_self")}


def _product_flow(owner: Node, grad: torch.Tensor, k: int) -> torch.Tensor:
    """The flow along edge k of a matrix product (out = self @ other), from its saved operands."""
    name = owner.name()
    return product_flow(name, grad, getattr(owner, PRODUCT_OPERANDS[name][k]), k)


def product_flow(name: str, grad: torch.Tensor, operand: torch.Tensor, k: int) -> torch.Tensor:
    """The flow along edge k of the matrix product `name`, from the operand `PRODUCT_OPERANDS` names."""
    if name == "MvBackward0":
        return torch.outer(grad, operand) if k == 0 else operand.t().mv(grad)
    if name == "MmBackward0":
        return grad.mm(operand.t()) if k == 0 else operand.t().mm(grad)
    return grad.bmm(operand.transpose(1, 2)) if k == 0 else operand.transpose(1, 2).bmm(grad)


def accumulate_along(node: Node, flow: torch.Tensor, weight_ids: set[int] | None) -> bool:
    """Carry `flow`, entering `node`, down transposes, stacks and multiplications by a scalar that
    needs no gradient (pseudo-queries stacked for a batched read, times the logit scale) to the
    parameters at the ends, and add it to their .grad (not to I parameters: I has their gradients).
    False, having changed nothing, for any other subgraph: the engine takes it."""
    reached = _flows_to_leaves(node, flow)
    if reached is None:
        return False
    for variable, grad in reached:
        if weight_ids is not None and id(variable) not in weight_ids:
            continue
        if variable.grad is None:
            variable.grad = grad.contiguous()
        else:
            variable.grad += grad
    return True


def _flows_to_leaves(node: Node, flow: torch.Tensor, depth: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    variable = getattr(node, "variable", None)
    if variable is not None:
        return [(variable, flow)] if flow.shape == variable.shape else None
    name = node.name()
    functions = node.next_functions
    if name == "StackBackward0" and depth < 4:
        pieces = flow.unbind(node._saved_dim)
        if len(pieces) != len(functions):
            return None
        reached = []
        for (child, _nr), piece in zip(functions, pieces, strict=True):
            if child is not None:
                below = _flows_to_leaves(child, piece, depth + 1)
                if below is None:
                    return None
                reached += below
        return reached
    live = [(i, f) for i, (f, _nr) in enumerate(functions) if f is not None]
    if len(live) != 1 or depth >= 4:
        return None
    (i, child), = live
    if name == "TBackward0":
        return _flows_to_leaves(child, flow.t(), depth + 1)
    if name == "MulBackward0":
        factor = node._saved_other if i == 0 else node._saved_self
        if factor is None or factor.dim() != 0 or factor.requires_grad:
            return None
        return _flows_to_leaves(child, flow * factor, depth + 1)
    return None


def _accumulate_linear_weight(owner: Node, grad_2d: torch.Tensor, k: int, target: Node) -> bool:
    """A linear layer's weight W, out = x @ W.t(): add grad.t() @ x to W.grad in W's own layout
    (one matmul, no transposed copy). False if edge k is not that pattern."""
    if k != 1 or owner.name() != "MmBackward0":
        return False
    return accumulate_linear_weight(grad_2d, owner._saved_self, target)


def accumulate_linear_weight(grad_2d: torch.Tensor, x_2d: torch.Tensor, target: Node) -> bool:
    """Edge 1 of out = x @ W.t() (an MmBackward0) entering `target`: if `target` is the transpose of a
    leaf W, add grad.t() @ x to W.grad and return True; False, having changed nothing, otherwise."""
    if target.name() != "TBackward0":
        return False
    ((leaf, _nr),) = target.next_functions
    weight = getattr(leaf, "variable", None)
    if weight is None:
        return False
    if weight.grad is None:
        weight.grad = grad_2d.t().mm(x_2d)
    else:
        weight.grad.addmm_(grad_2d.t(), x_2d)
    return True
