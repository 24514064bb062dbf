"""The split backward with a weight-gradient store (docs/spec.md section 8: between I and W a chunk
keeps only its W store), as the zero-bubble paper's WeightGradStore and Transformer Engine's
delayed weight-gradient computation do it.

`stash_backward_input` (I) runs the engine once, for the chunk's inputs and the I parameters, with
the graph freed as it goes (no retain_graph): every node of the input-gradient chain drops what it
saved once it has run, and so does every layer activation checkpointing recomputed. Before an owner
of weight edges (`graph_cut`) runs, a pre-hook on it stashes what W needs of it:
- a matrix product whose weight edge is one parameter through a transpose, autocast's cast and at
  most one expert's slice (`weight_operands`: a linear layer's weight, fp32 or its bf16 cast, the
  routed experts' grouped matmul and its loop twin): the gradient it receives and its activation
  operand (and a grouped matmul's offsets), read from its saved tensors (out + in features per
  token: 16 d a transformer layer at ff = 4 d, about half of what the layer saves without
  checkpointing);
- any other weight edge (pseudo-queries' and key projections' products, MSAR's taps and gates):
  nothing; the edge is an output of I's engine call, so its flow, weight-sized and small, is stored
  instead (stashing a depth-attention product's operand, the stacked keys, would cost far more).
`drain_weight_store` (W) computes those weights' gradients from the stash in a fixed order (the
cut's) straight into their `.grad` (in fp32 and bf16 alike: W's share of the backward's FLOPs is
the same, `tests/parity/test_split_flops.py`), and carries the other flows, and the roots outside the chain,
down the weight branches (never run in I, so still whole) by one engine call.

Under activation checkpointing the store may instead be a *gradient store* (`model.weight_store_rule`
chooses, per chunk and microbatch, by the bytes each would hold: the products' operands, counted
per product from their saved sizes, against the chunk's layer frames' inputs, and the selective
policy's kept outputs): I keeps each product's received gradient and, for an operand its layer's
frame recomputed, only where it sits in the frame (`activation_checkpoint.probing`); the frames keep
their inputs past I, and W recomputes each layer once more (`_Frame.regenerate`, a forward under
the same autocast state, routing and kept outputs) for the operands, frame by frame, before its
products. An operand saved as it is (a frame's input, the head's) is stashed as before.

The stashed tensors are held through the activation meter, so the counted peak sees the store.
`split_backward.backward_input` / `backward_weight` (I keeps the graph until W) are its slow twin.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node

from attnres_pp.model.weight_store_rule import GRADIENTS, OPERANDS, weight_store_kind
from attnres_pp.pipeline.activation_checkpoint import probing
from attnres_pp.pipeline.graph_cut import CutCache
from attnres_pp.pipeline.memory_meter import ActivationMeter
from attnres_pp.pipeline.split_backward import accumulate_along, accumulate_leaf_grads
from attnres_pp.pipeline.weight_operands import WeightRoute, accumulate_weight, operand_names, weight_route


@dataclass
class _ProductStash:
    """One product's share of the store: the route of its weight edge and, once I reached it, the
    gradient it received and its saved operands (`weight_operands.operand_names`)."""

    route: WeightRoute
    grad: object = None
    operands: tuple = ()  # held tensors, or a _Regen for an operand W recomputes


@dataclass(frozen=True)
class _Regen:
    """An operand the gradient store leaves to W: position `index` of what `frame` saves."""

    frame: object
    index: int


@dataclass
class WeightStore:
    """What I leaves for W: the products' stashes, the flows into other weight branches, the roots
    outside the input-gradient chain with their gradients, and the parameters W accumulates into."""

    meter: ActivationMeter | None = None
    products: list[_ProductStash] = field(default_factory=list)
    flow_edges: list[GradientEdge] = field(default_factory=list)
    flows: list[object] = field(default_factory=list)
    outside_roots: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    params: list[torch.Tensor] | None = field(default_factory=list)  # None: every leaf of the graph
    kind: str = OPERANDS  # or GRADIENTS (`model.weight_store_rule`)

    def hold(self, t: torch.Tensor):
        return t.detach() if self.meter is None else self.meter.pack(t)

    def value(self, held) -> torch.Tensor:
        return held if self.meter is None else self.meter.unpack(held)


def stash_backward_input(roots: list[torch.Tensor], root_grads: list[torch.Tensor], inputs: list[torch.Tensor],
                         cuts: CutCache | None = None, key: object = None,
                         meter: ActivationMeter | None = None, kind: str | None = None) -> WeightStore:
    """I: accumulate the gradients of `inputs` and of the I parameters in their `.grad`, free the
    graph but the weight branches, and return the store W drains. `kind`: None, the rule's choice
    (`choose_store`); `OPERANDS`, the operand store whatever the rule says (its twin)."""
    pairs = [(r, g) for r, g in zip(roots, root_grads, strict=True) if r.grad_fn is not None]
    if not pairs:
        return WeightStore(meter)
    if not inputs:  # chunk 0: nothing goes back, all of it is W
        return WeightStore(meter, outside_roots=pairs, params=None)
    cut = (cuts or CutCache()).cut(key, [r.grad_fn for r, _ in pairs], inputs)
    store = WeightStore(meter, outside_roots=[pairs[r] for r in cut.outside_roots], params=cut.weight_params)
    handles, flow_targets, products = [], [], []
    weight_ids = {id(p) for p in cut.weight_params}
    for owner, edges, _n_out in cut.owners:
        for k, f, nr in edges:
            route = weight_route(owner, k, f, weight_ids)
            if route is None:
                flow_targets.append(GradientEdge(f, nr))
                continue
            stash = _ProductStash(route)
            store.products.append(stash)
            products.append((owner, stash))
    store.kind = OPERANDS if kind == OPERANDS else choose_store(cut.frames, [owner for owner, _stash in products])
    for owner, stash in products:
        handles.append(owner.register_prehook(_stasher(store, stash, owner)))
    wanted = list(inputs) + cut.input_params
    try:
        grads = torch.autograd.grad([r for r, _ in pairs], wanted + flow_targets,
                                    grad_outputs=[g for _, g in pairs], allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
    accumulate_leaf_grads(wanted, grads[:len(wanted)], len(inputs))
    for target, flow in zip(flow_targets, grads[len(wanted):], strict=True):
        if flow is not None:
            store.flow_edges.append(target)
            store.flows.append(store.hold(flow))
    return store


def choose_store(frames: list, owners: list[Node]) -> str:
    """The store this chunk's I leaves (`model.weight_store_rule`), and, for the gradient store, its
    frames told to keep their inputs until W. `frames`: the chunk's checkpointing frames (none: not
    checkpointed); `owners`: the products whose operands the operand store would stash."""
    frames = list({id(f): f for f in frames}.values())
    if not frames:
        return OPERANDS
    operand_bytes = sum(_operand_bytes(owner) for owner in owners)
    held: dict = {}
    for frame in frames:
        held.update(frame.checkpoint_storages())
    kind = weight_store_kind(operand_bytes, sum(held.values()))
    if kind == GRADIENTS:
        for frame in frames:
            frame.keep_for_w = True
    return kind


def _operand_bytes(owner: Node) -> int:
    """The activation operand's bytes, from its saved sizes (no read: reading would recompute)."""
    numel = 1
    for size in owner._saved_self_sym_sizes:
        numel *= int(size)
    return numel * owner._input_metadata[0].dtype.itemsize


def _stasher(store: WeightStore, stash: _ProductStash, owner: Node):
    names = operand_names(stash.route.kind)
    regenerates = store.kind == GRADIENTS

    def prehook(grad_outputs):
        # Runs just before the owner does, while its saved tensors are still there (under activation
        # checkpointing: recomputed by now or by this read).
        if grad_outputs[0] is not None:
            stash.grad = store.hold(grad_outputs[0])
            stash.operands = tuple(_operand(store, owner, name, regenerates and name == "_saved_self")
                                   for name in names)
        return None

    return prehook


def _operand(store: WeightStore, owner: Node, name: str, regenerates: bool):
    if not regenerates:
        return store.hold(getattr(owner, name))
    with probing() as seen:
        value = getattr(owner, name)
    if seen and seen[-1][0].keep_for_w:
        return _Regen(*seen[-1])  # the recomputed operand dies with the owner; W recomputes it
    return store.hold(value)


@torch.no_grad()  # the stashed operands are activations: build no graph on them
def drain_weight_store(store: WeightStore) -> None:
    """W: the parameters' gradients from the store, accumulated in their `.grad`; empties the store."""
    edges, flows = [], []
    weight_ids = None if store.params is None else {id(p) for p in store.params}
    regenerated = _Regenerated(store.products)
    for stash in store.products:
        if stash.grad is None:  # no gradient reached the owner in I
            continue
        grad, operands = store.value(stash.grad), tuple(regenerated.value(store, h) for h in stash.operands)
        stash.grad, stash.operands = None, ()  # the handles go as the products are computed
        accumulate_weight(stash.route, grad, operands)
        del grad, operands
    for edge, held in zip(store.flow_edges, store.flows, strict=True):
        flow = store.value(held)
        if not accumulate_along(edge.node, flow, weight_ids):  # a stack of pseudo-queries: no engine
            edges.append(edge)
            flows.append(flow)
    for root, grad in store.outside_roots:
        edges.append(root)
        flows.append(grad)
    store.products.clear()
    regenerated.release()  # (empty unless a product W computed failed part way)
    store.flow_edges.clear()
    store.flows.clear()
    store.outside_roots.clear()
    if edges and (store.params is None or store.params):
        torch.autograd.backward(edges, flows, inputs=store.params)


class _Regenerated:
    """W's recomputed operands: a frame is recomputed at its first product's turn, for all its
    products' operands, and each is let go once its last product has used it."""

    def __init__(self, products: list[_ProductStash]) -> None:
        self.wanted: dict[int, set[int]] = {}
        self.uses: dict[tuple[int, int], int] = {}
        for stash in products:
            for held in stash.operands if stash.grad is not None else ():
                if isinstance(held, _Regen):
                    self.wanted.setdefault(id(held.frame), set()).add(held.index)
                    key = (id(held.frame), held.index)
                    self.uses[key] = self.uses.get(key, 0) + 1
        self.values: dict[tuple[int, int], object] = {}

    def value(self, store: WeightStore, held) -> torch.Tensor:
        if not isinstance(held, _Regen):
            return store.value(held)
        frame_id, key = id(held.frame), (id(held.frame), held.index)
        if frame_id in self.wanted:
            for index, value in held.frame.regenerate(self.wanted.pop(frame_id)).items():
                self.values[(frame_id, index)] = value
        self.uses[key] -= 1
        value = self.values[key] if self.uses[key] else self.values.pop(key)
        return held.frame.unwrap(value)

    def release(self) -> None:
        self.values.clear()
