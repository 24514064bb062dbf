"""A chunk's backward split in two (SPEC section 5): `backward_input` (I) computes the gradients of
the chunk's inputs (what goes back over the hop and into cache deposits), `backward_weight` (W)
later computes the parameters' gradients, without running any part of the input-gradient chain again.

How the autograd graph is cut. Call N_in the nodes from which an input leaf can be reached (the
input-gradient chain). Every path from a root to a parameter leaves N_in at most once, over an edge
x -> f with x in N_in and f not (a weight branch never re-enters N_in: it would reach an input).
- I runs the engine once, on the chunk's inputs and the "I parameters": those a node of N_in uses
  directly (norm gains, pseudo-queries: cheap) or through a node that more than one edge enters
  (its flow cannot be taken apart). A pre-hook on every node x with a weight edge x -> f keeps the
  gradient x received (retain_graph keeps the graph for W).
- W first recomputes, per such x, only the flow along its weight edges: the engine is asked for the
  gradient entering f, and since f has no other way in, nothing else of x's subgraph runs (the
  matmul that makes a weight's gradient, not the one that makes the input's). Then one engine call
  carries those flows (and the roots outside N_in, e.g. all of chunk 0) to the other parameters.
Parameters are found as the graph's leaves that are not inputs, so tied parameters (MSAR stream
convolutions) and custom autograd functions need no special case. `fused_backward` is the one-call
twin (the `B` action); parity tests hold the split to it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node


@dataclass
class WeightWork:
    """What I leaves for W: the owners of weight edges with the gradients they received in I, the
    roots outside N_in with their gradients, and the parameters W accumulates into."""

    owners: list[tuple[Node, list[tuple[int, Node, int]]]] = field(default_factory=list)
    kept: dict[Node, tuple] = field(default_factory=dict)
    outside_roots: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    params: list[torch.Tensor] | None = field(default_factory=list)  # None: every leaf of the graph


def fused_backward(roots: list[torch.Tensor], root_grads: list[torch.Tensor]) -> None:
    """B: input and parameter gradients in one engine call (they accumulate in `.grad`)."""
    if roots:
        torch.autograd.backward(roots, root_grads)


def backward_input(roots: list[torch.Tensor], root_grads: list[torch.Tensor],
                   inputs: list[torch.Tensor]) -> WeightWork:
    """I: accumulate the gradients of `inputs` (leaves) in their `.grad`; return the work W does.

    The I parameters (see the module docstring) get their gradients here too.
    """
    pairs = [(r, g) for r, g in zip(roots, root_grads, strict=True) if r.grad_fn is not None]
    if not pairs:
        return WeightWork()
    if not any(t.requires_grad for t in inputs):  # chunk 0: nothing goes back, all of it is W
        return WeightWork(outside_roots=pairs, params=None)
    cut = _cut([r.grad_fn for r, _ in pairs], inputs)
    work = WeightWork(owners=cut.owners, params=cut.weight_params,
                      outside_roots=[(r, g) for r, g in pairs if r.grad_fn in cut.outside_roots])
    kept = work.kept
    handles = [owner.register_prehook(_keeper(kept, owner)) for owner, _ in cut.owners]
    try:
        wanted = [t for t in inputs if t.requires_grad] + cut.input_params
        if wanted:
            torch.autograd.backward([r for r, _ in pairs], [g for _, g in pairs], retain_graph=True,
                                    inputs=wanted)
    finally:
        for handle in handles:
            handle.remove()
    return work


@torch.no_grad()  # the saved operands are activations with a graph: build none on them
def backward_weight(work: WeightWork, *, known_flows: bool = True) -> None:
    """W: the parameters' gradients left by `backward_input`, accumulated in their `.grad`.

    known_flows=False takes the engine for every owner (the slow twin of the matrix-product paths).
    """
    edges, flows = [], []
    for owner, weight_edges in work.owners:
        kept = work.kept.pop(owner, None)
        if kept is None or all(g is None for g in kept):  # no gradient reached the owner in I
            continue
        if known_flows and owner.name() in _PRODUCTS and kept[0] is not None:
            for k, f, nr in weight_edges:
                if not _accumulate_linear_weight(owner, kept[0], k, f):
                    edges.append(GradientEdge(f, nr))
                    flows.append(_product_flow(owner, kept[0], k))
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


def _engine_flows(owner: Node, kept: tuple, weight_edges: list[tuple[int, Node, int]]):
    """The flows along `owner`'s weight edges, by the engine. Each edge's target has no other way
    in, so only `owner` runs; but the engine walks the whole graph below it first."""
    slots = [i for i, g in enumerate(kept) if g is not None]
    targets = [GradientEdge(f, nr) for _k, f, nr in weight_edges]
    grads = torch.autograd.grad([GradientEdge(owner, i) for i in slots], targets,
                                grad_outputs=[kept[i] for i in slots], allow_unused=True)
    pairs = [(t, g) for t, g in zip(targets, grads, strict=True) if g is not None]
    return [t for t, _ in pairs], [g for _, g in pairs]


_PRODUCTS = frozenset({"MmBackward0", "MvBackward0", "BmmBackward0"})


def _product_flow(owner: Node, grad: torch.Tensor, k: int) -> torch.Tensor:
    """The flow along edge k of a matrix product (out = self @ other), from its saved operands."""
    name = owner.name()
    if name == "MvBackward0":
        return torch.outer(grad, owner._saved_vec) if k == 0 else owner._saved_self.t().mv(grad)
    if name == "MmBackward0":
        return grad.mm(owner._saved_mat2.t()) if k == 0 else owner._saved_self.t().mm(grad)
    return (grad.bmm(owner._saved_mat2.transpose(1, 2)) if k == 0
            else owner._saved_self.transpose(1, 2).bmm(grad))


def _accumulate_linear_weight(owner: Node, grad_2d: torch.Tensor, k: int, target: Node) -> bool:
    """A linear layer's weight W, out = x @ W.t(): add grad.t() @ x to W.grad in W's own layout
    (one matmul, no transposed copy). False if edge k is not that pattern."""
    if k != 1 or owner.name() != "MmBackward0" or target.name() != "TBackward0":
        return False
    ((leaf, _nr),) = target.next_functions
    weight = getattr(leaf, "variable", None)
    if weight is None:
        return False
    x_2d = owner._saved_self
    if weight.grad is None:
        weight.grad = grad_2d.t().mm(x_2d)
    else:
        weight.grad.addmm_(grad_2d.t(), x_2d)
    return True


def _keeper(kept: dict, owner: Node):
    def hook(grad_outputs):
        kept[owner] = tuple(grad_outputs)

    return hook


@dataclass
class _Cut:
    owners: list[tuple[Node, list[tuple[int, Node, int]]]]
    input_params: list[torch.Tensor]
    weight_params: list[torch.Tensor]
    outside_roots: set[Node]


def _cut(root_nodes: list[Node], inputs: list[torch.Tensor]) -> _Cut:
    """Where the graph under `root_nodes` is cut between I and W (see the module docstring)."""
    # One pass: each node's next functions and its parents, one entry per edge; a root's own
    # gradient counts as one more way in (the None entry).
    nexts: dict[Node, tuple] = {}
    parents: dict[Node, list] = {}
    order = []
    for node in root_nodes:
        if node not in parents:
            parents[node] = []
            order.append(node)
        parents[node].append(None)
    leaves = []
    i = 0
    while i < len(order):
        node = order[i]
        i += 1
        functions = node.next_functions
        nexts[node] = functions
        if not functions:
            leaves.append(node)
        for f, _nr in functions:
            if f is None:
                continue
            known = parents.get(f)
            if known is None:
                parents[f] = [node]
                order.append(f)
            else:
                known.append(node)
    input_ids = {id(t) for t in inputs}
    input_leaves, param_leaves = [], []
    for leaf in leaves:
        variable = getattr(leaf, "variable", None)
        if variable is not None:
            (input_leaves if id(variable) in input_ids else param_leaves).append(leaf)

    on_input_path = _ancestors(input_leaves, parents, None)
    # I parameters: used directly by N_in, or below a node entered by N_in and by another edge.
    input_param_leaves: set[Node] = set()
    for node in on_input_path:
        for f, _nr in nexts[node]:
            if f is None or f in on_input_path:
                continue
            if not nexts[f]:
                input_param_leaves.add(f)
            elif len(parents[f]) > 1:
                input_param_leaves.update(_descendant_leaves(f, nexts))
    weight_leaves = [leaf for leaf in param_leaves if leaf not in input_param_leaves]
    reaches_weights = _ancestors(weight_leaves, parents, on_input_path)
    owners = []
    for node in on_input_path:
        edges = [(k, f, nr) for k, (f, nr) in enumerate(nexts[node]) if f in reaches_weights]
        if edges:
            owners.append((node, edges))
    return _Cut(owners=owners,
                input_params=[leaf.variable for leaf in param_leaves if leaf in input_param_leaves],
                weight_params=[leaf.variable for leaf in weight_leaves],
                outside_roots={node for node in root_nodes if node in reaches_weights})


def _ancestors(starts: list[Node], parents: dict[Node, list], avoid: set[Node] | None) -> set[Node]:
    """`starts` and every node above them (through `parents`), not entering `avoid`."""
    found = set(starts)
    queue = list(starts)
    while queue:
        for parent in parents[queue.pop()]:
            if parent is not None and parent not in found and (avoid is None or parent not in avoid):
                found.add(parent)
                queue.append(parent)
    return found


def _descendant_leaves(start: Node, nexts: dict[Node, tuple]) -> set[Node]:
    seen, queue, leaves = {start}, [start], set()
    while queue:
        node = queue.pop()
        if not nexts[node]:
            leaves.add(node)
        for f, _nr in nexts[node]:
            if f is not None and f not in seen:
                seen.add(f)
                queue.append(f)
    return leaves
