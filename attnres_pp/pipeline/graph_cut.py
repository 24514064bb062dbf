"""Where a chunk's autograd graph is cut between I (input gradients) and W (weight gradients); see
`split_backward` for how the two halves use the cut.

Call N_in the nodes from which an input leaf can be reached: the input-gradient chain. Every path
from a root to a parameter leaves N_in at most once, over an edge x -> f with x in N_in and f not
(a weight branch never re-enters N_in: it would then reach an input). The cut sorts parameters:
- "I parameters": used directly by a node of N_in (norm gains, pseudo-queries: cheap) or below a
  node f that more than one edge enters (the flow of one edge into f cannot be taken apart); I
  computes their gradients along with the inputs';
- "W parameters": the rest. Each edge x -> f into their branches is a *weight edge* of its owner x;
  f has no other way in, so W can compute the flow along it from x's gradient alone.
Parameters are the graph's leaves that are not inputs, so tied parameters (MSAR stream
convolutions) and custom autograd functions need no special case.

The analysis walks the graph in Python (a few hundred nodes per chunk here); every microbatch of a
chunk builds the same graph, so `CutCache` keeps one analysis per chunk, found again by the node
types in walk order, and maps it onto each new graph by position (nodes and parameters alike).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.autograd.graph import Node

from attnres_pp.pipeline.activation_checkpoint import FRAME_KEY


@dataclass(frozen=True)
class Cut:
    """owners: (node x, its weight edges as (edge index k, target f, f's input slot), the number of
    gradients x receives: its forward's outputs); roots outside N_in that reach W parameters go to W
    whole (chunk 0 has no inputs: all of it)."""

    owners: list[tuple[Node, list[tuple[int, Node, int]], int]]
    input_params: list[torch.Tensor]
    weight_params: list[torch.Tensor]
    outside_roots: list[int]  # positions in the roots list
    frames: list = ()  # the activation-checkpointing frames of the graph's layers (`FRAME_KEY`)


@dataclass(frozen=True)
class _Plan:
    """A cut by walk positions, valid for any graph with the same `signature`."""

    signature: tuple
    owners: tuple[tuple[int, tuple[int, ...], int], ...]  # (position, weight edge indices, outputs)
    input_params: tuple[int, ...]  # walk positions of the parameters' leaves
    weight_params: tuple[int, ...]
    outside_roots: tuple[int, ...]
    frame_nodes: tuple[int, ...] = ()  # walk positions of nodes naming checkpointing frames


class CutCache:
    """One cut plan per key (a chunk): the walk of a new graph is checked against it by signature."""

    def __init__(self) -> None:
        self._plans: dict[object, _Plan] = {}
        self.analyses = 0  # how many graphs were analysed in full (the others reused a plan)

    def cut(self, key: object, root_nodes: list[Node], inputs: list[torch.Tensor]) -> Cut:
        order, nexts, signature = _walk(root_nodes)
        plan = self._plans.get(key)
        if plan is None or plan.signature != signature:
            plan = _analyse(order, nexts, signature, root_nodes, inputs)
            self._plans[key] = plan
            self.analyses += 1
        owners = [(order[i], [(k, *nexts[i][k]) for k in edges], n_out) for i, edges, n_out in plan.owners]
        return Cut(owners=owners, input_params=[order[j].variable for j in plan.input_params],
                   weight_params=[order[j].variable for j in plan.weight_params],
                   outside_roots=list(plan.outside_roots),
                   frames=[f for j in plan.frame_nodes for f in order[j].metadata.get(FRAME_KEY, ())])


def cut_graph(root_nodes: list[Node], inputs: list[torch.Tensor]) -> Cut:
    """The cut of one graph, analysed afresh (no cache)."""
    return CutCache().cut(None, root_nodes, inputs)


def _walk(root_nodes: list[Node]) -> tuple[list[Node], list[tuple], tuple]:
    """Breadth-first from the roots: nodes in order, their next functions, and the signature
    (node types and child counts in order: equal for every microbatch of one chunk)."""
    order: list[Node] = []
    seen: set[Node] = set()
    for node in root_nodes:
        if node not in seen:
            seen.add(node)
            order.append(node)
    nexts: list[tuple] = []
    i = 0
    while i < len(order):
        functions = order[i].next_functions
        nexts.append(functions)
        for f, _nr in functions:
            if f is not None and f not in seen:
                seen.add(f)
                order.append(f)
        i += 1
    signature = (tuple(root_nodes.index(n) for n in root_nodes),
                 tuple(type(n) for n in order), tuple(len(f) for f in nexts))
    return order, nexts, signature


def _analyse(order: list[Node], nexts: list[tuple], signature: tuple, root_nodes: list[Node],
             inputs: list[torch.Tensor]) -> _Plan:
    position = {node: i for i, node in enumerate(order)}
    # parents[i]: one entry per edge into node i; a root's own gradient is one more way in (-1).
    parents: list[list[int]] = [[] for _ in order]
    for node in root_nodes:
        parents[position[node]].append(-1)
    for i, functions in enumerate(nexts):
        for f, _nr in functions:
            if f is not None:
                parents[position[f]].append(i)
    input_ids = {id(t) for t in inputs}
    input_leaves, param_leaves = [], []
    for i, node in enumerate(order):
        if not nexts[i]:
            variable = getattr(node, "variable", None)
            if variable is not None:
                (input_leaves if id(variable) in input_ids else param_leaves).append(i)

    on_input_path = _ancestors(input_leaves, parents, set())
    input_param_leaves: set[int] = set()
    for i in on_input_path:
        for f, _nr in nexts[i]:
            if f is None:
                continue
            j = position[f]
            if j in on_input_path:
                continue
            if not nexts[j]:
                input_param_leaves.add(j)
            elif len(parents[j]) > 1:
                input_param_leaves |= _descendant_leaves(j, nexts, position)
    weight_leaves = [j for j in param_leaves if j not in input_param_leaves]
    reaches_weights = _ancestors(weight_leaves, parents, on_input_path)
    owners = []
    for i in sorted(on_input_path):
        edges = tuple(k for k, (f, _nr) in enumerate(nexts[i]) if f is not None and position[f] in reaches_weights)
        if edges:  # (len(_input_metadata) costs ~20 us a call: once per chunk, here)
            owners.append((i, edges, len(order[i]._input_metadata)))
    return _Plan(signature=signature, owners=tuple(owners),
                 frame_nodes=tuple(i for i in on_input_path if FRAME_KEY in order[i].metadata),
                 input_params=tuple(j for j in param_leaves if j in input_param_leaves),
                 weight_params=tuple(weight_leaves),
                 outside_roots=tuple(r for r, node in enumerate(root_nodes) if position[node] in reaches_weights))


def _ancestors(starts: list[int], parents: list[list[int]], avoid: set[int]) -> set[int]:
    """`starts` and every node above them (through `parents`), not entering `avoid`."""
    found = set(starts)
    queue = list(starts)
    while queue:
        for parent in parents[queue.pop()]:
            if parent >= 0 and parent not in found and parent not in avoid:
                found.add(parent)
                queue.append(parent)
    return found


def _descendant_leaves(start: int, nexts: list[tuple], position: dict[Node, int]) -> set[int]:
    seen, queue, leaves = {start}, [start], set()
    while queue:
        i = queue.pop()
        if not nexts[i]:
            leaves.add(i)
        for f, _nr in nexts[i]:
            if f is not None and (j := position[f]) not in seen:
                seen.add(j)
                queue.append(j)
    return leaves
