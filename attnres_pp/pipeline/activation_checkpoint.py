"""Activation checkpointing of a chunk's transformer layers (`--activation-checkpoint`), made to
compose with the split backward (I, then W) and with the memory meter.

- `full`: a layer's forward keeps only what it was given (its inputs: the depth state's blocks,
  partial or residual, counted by the meter until the recomputation) and the parameters; everything
  else it would save is recomputed, once, the first time the backward asks for it.
- `selective`: as `full`, but the outputs of the layers' projections (matrix products at least
  `d_model` wide: qkv, out, up, down) and of scaled-dot-product attention are kept
  (`torch.utils.checkpoint.create_selective_checkpoint_contexts` records them in the forward and
  serves them to the recomputation, so no matrix product runs twice); norms, softmax, GELU,
  depth-attention scores, weights and reads, MSAR streams and gates are recomputed.

Why not `torch.utils.checkpoint.checkpoint` itself: it recomputes once per autograd graph task
(`_current_graph_task_id`), and the split backward runs several: I, W's engine call, and W's reads
of matrix products' saved operands outside any graph task, each of which would run the layer's
forward again (one recomputation per read: a 12-layer chunk's W recomputed its layers dozens of
times). Here a layer's forward is one `_Frame`: the first unpack of a recomputed tensor, in any
graph task or none, recomputes the whole layer and keeps the results until autograd drops the
frame's last handle (B: when the layer's backward is done; I/W: when W is done), so W never
recomputes what I did and never finds a tensor I consumed. Each result dies with the handle of the
node that saved it: a backward that frees its graph (B; I with the weight store, which keeps only
the stashed operands) frees a recomputed tensor as soon as its node has run. Cached reads and received tensors stay
the leaves they are (they are the frame's inputs, saved as they are); deposits are untouched.

Recomputation reproduces the forward exactly: the same inputs (detached, requiring grad as
before), the same parameters, the autocast state of the forward; the layers draw no random numbers
(MoE routing is a function of the inputs and the expert bias, which moves only after the step).

The gradient store (`weight_store`, `model.weight_store_rule`): a frame I marks `keep_for_w` keeps
its inputs (and the selective policy's kept outputs) past I's recomputation, and W recomputes the
layer once more (`regenerate`) for the matrix products' operands it left behind (found by
`probing`: which frame and saved position a read of a saved tensor came from).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable

import torch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    _CachedTorchDispatchMode,
    create_selective_checkpoint_contexts,
)

from attnres_pp.model.moe import recomputing
from attnres_pp.pipeline.memory_meter import ActivationMeter, storage_key

_ATTENTION_OPS = frozenset(
    getattr(torch.ops.aten, name).default for name in (
        "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")
    if hasattr(torch.ops.aten, name))
_PRODUCT_OPS = frozenset({torch.ops.aten.mm.default, torch.ops.aten.addmm.default})
# The node metadata key under which a checkpointed call's outputs name their frame.
FRAME_KEY = "attnres_pp.checkpoint_frame"
# While set (`probing`): a list that each read of a recomputed saved tensor appends (frame, position) to.
_PROBE: contextvars.ContextVar[list | None] = contextvars.ContextVar("checkpoint_probe", default=None)


@contextlib.contextmanager
def probing():
    """Records where the reads of saved tensors inside come from: (frame, position) for a tensor the
    frame recomputes; a tensor saved as it is (an input, a parameter) records nothing."""
    seen: list = []
    token = _PROBE.set(seen)
    try:
        yield seen
    finally:
        _PROBE.reset(token)


def selective_policy(min_width: int) -> Callable:
    """SAC policy: save projections (matrix products whose output is at least `min_width` wide, so a
    depth-attention score or an MSAR gate, a few columns wide, is recomputed) and attention."""

    def policy(_ctx, op, *_args, **_kwargs):
        if op in _ATTENTION_OPS:
            return CheckpointPolicy.MUST_SAVE
        if op in _PRODUCT_OPS:
            out = _ctx.op_output
            if isinstance(out, torch.Tensor) and out.dim() >= 1 and out.shape[-1] >= min_width:
                return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


class _Direct:
    __slots__ = ("value",)

    def __init__(self, value) -> None:
        self.value = value


class _Recompute:
    """A recomputed tensor's place in its frame. Autograd drops it with the node that saved it (after
    the node ran, unless the graph is retained): its result is then dropped too, so what a freeing
    backward (B, or I with a weight store) has consumed dies while the rest of the layer runs."""

    __slots__ = ("frame", "index")

    def __init__(self, frame: _Frame, index: int) -> None:
        self.frame, self.index = frame, index

    def __del__(self) -> None:
        self.frame.release(self.index)


class _Frame:
    """One checkpointed call of `fn(*args)`: what its recomputation needs, and its results."""

    def __init__(self, fn, args, meter: ActivationMeter | None, keep: set, policy_fn) -> None:
        self.fn, self.meter, self.keep = fn, meter, keep
        self.args = [a.detach().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a for a in args]
        # The frame itself keeps the inputs its recomputation starts from (no autograd node need save
        # them: under bf16 the norms save fp32 copies, which are recomputed): the meter counts them
        # until the recomputation, a storage once (an input a node also saves is not counted twice).
        self.held_inputs = None if meter is None else [meter.pack(a) for a in self.args if isinstance(a, torch.Tensor)]
        self.n_packed = 0
        self.direct: set[int] = set()
        self.dropped: set[int] = set()  # packed, then dropped by autograd before the recomputation
        self.recomputed: list | None = None
        self.cached: list | None = None
        self.device_type = next(a.device.type for a in args if isinstance(a, torch.Tensor))
        self.autocast = (torch.is_autocast_enabled(self.device_type), torch.get_autocast_dtype(self.device_type))
        self.forward_mode, self.recompute_mode = (None, None) if policy_fn is None else \
            create_selective_checkpoint_contexts(policy_fn)
        self.keep_for_w = False  # the gradient store: keep what W recomputes from past I
        self.w_storage: dict | None = None  # selective: the kept outputs, for W's recomputation
        self.cached_bytes = 0

    def _wrap(self, t: torch.Tensor):
        return t.detach() if self.meter is None else self.meter.pack(t)

    def unwrap(self, held) -> torch.Tensor:
        return held if self.meter is None else self.meter.unpack(held)

    def pack(self, t: torch.Tensor):
        index = self.n_packed
        self.n_packed += 1
        if storage_key(t) in self.keep:  # an input or a parameter: alive anyway, saved as it is
            self.direct.add(index)
            return _Direct(self._wrap(t))
        return _Recompute(self, index)

    def unpack(self, packed) -> torch.Tensor:
        if isinstance(packed, _Direct):
            return self.unwrap(packed.value)
        if self.recomputed is None:
            self._recompute()
        probe = _PROBE.get()
        if probe is not None:
            probe.append((self, packed.index))
        return self.unwrap(self.recomputed[packed.index])

    def release(self, index: int) -> None:
        if self.recomputed is None:
            self.dropped.add(index)
        else:
            self.recomputed[index] = None

    def _recompute(self) -> None:
        saved: list = []
        unwanted = self.direct | self.dropped

        def collect(t: torch.Tensor):
            # A tensor a tp collective is still producing is kept as it is until the recomputation
            # is over: detaching it here would wait for it inside the region, one wait more than
            # the forward, where nothing waited at the save, and selective checkpointing numbers
            # every op of the region, the waits included, and serves its saved outputs by that number.
            saved.append(None if len(saved) in unwanted else t if _pending(t) else self._wrap(t.detach()))
            return None

        if self.keep_for_w and self.recompute_mode is not None:
            # SAC serves each kept output once: W's recomputation reads them from its own copy.
            self.w_storage = {key: dict(entries) for key, entries in self.recompute_mode.storage.items()}
        self._run(collect, self.recompute_mode)
        saved = [self._wrap(t.wait().detach()) if _pending(t) else t for t in saved]
        self._check_count(len(saved))
        self.recomputed = saved
        if not self.keep_for_w:
            self.fn = self.args = self.cached = self.held_inputs = None  # the results are all W and B need

    def _run(self, collect, mode) -> None:
        enabled, dtype = self.autocast
        mode = mode if mode is not None else contextlib.nullcontext()
        with torch.enable_grad(), torch.autocast(self.device_type, dtype=dtype, enabled=enabled), mode, \
                torch.autograd.graph.saved_tensors_hooks(collect, lambda _unused: None), recomputing():
            self.fn(*self.args)

    def _check_count(self, n_saved: int) -> None:
        if n_saved != self.n_packed:
            raise RuntimeError(f"activation checkpointing: the recomputed layer saved {n_saved} tensors, "
                               f"the forward {self.n_packed}: the layer's forward is not deterministic")

    def regenerate(self, positions: set[int]) -> dict[int, object]:
        """W's recomputation under the gradient store: the saved tensors at `positions`, held through
        the meter (so W's transient is counted); then the frame lets go of its inputs."""
        if self.fn is None:
            raise RuntimeError("activation checkpointing: W recomputes a layer whose inputs are gone "
                               "(the frame was not kept for W)")
        found: dict[int, object] = {}
        unwanted_pending: list = []  # waited for as I's recomputation waits for them: after the region
        count = [0]
        last = max(positions)

        def collect(t: torch.Tensor):
            if count[0] in positions:
                found[count[0]] = t
            elif _pending(t):
                unwanted_pending.append(t)
            count[0] += 1
            if count[0] > last:
                # An op saves its inputs before it runs: the rest of the layer (the down projection's
                # product, the residual or block bookkeeping) is not computed. Every tp or ep peer
                # stops at the same op, so no collective is left half-issued.
                raise _Collected
            return None

        mode = None if self.w_storage is None else _CachedTorchDispatchMode(None, self.w_storage)
        try:
            self._run(collect, mode)
        except _Collected:
            pass
        for t in unwanted_pending:
            t.wait()
        if len(found) != len(positions):
            raise RuntimeError(f"activation checkpointing: W's recomputation saved {count[0]} tensors, fewer "
                               f"than I's: the layer's forward is not deterministic")
        self.release_inputs()
        return {i: self._wrap(t.wait().detach() if _pending(t) else t.detach()) for i, t in found.items()}

    def release_inputs(self) -> None:
        self.fn = self.args = self.cached = self.held_inputs = self.w_storage = None

    def checkpoint_storages(self) -> dict[tuple, int]:
        """What keeping this frame for W holds: its inputs' storages and the kept outputs (bytes)."""
        if self.meter is not None:  # as the meter counts them: a received message's slot, not its buffer
            held = dict(c for h in self.held_inputs if (c := self.meter.counted(h)) is not None)
        else:
            held = {(storage_key(a), a.storage_offset()): a.numel() * a.element_size()
                    for a in self.args if isinstance(a, torch.Tensor)}
        if self.cached_bytes:
            held[("cached", id(self))] = self.cached_bytes
        return held

    def hold_cached(self) -> None:
        """Count what selective checkpointing keeps (the SAC storage holds it, not autograd)."""
        if self.forward_mode is None:
            return
        self.cached_bytes = sum(wrapper.val.untyped_storage().nbytes()
                                for per_op in self.forward_mode.storage.values() for entry in per_op.values()
                                for wrapper in _wrappers(entry) if isinstance(wrapper.val, torch.Tensor))
        if self.meter is None:
            return
        self.cached = [self.meter.pack(wrapper.val) for per_op in self.forward_mode.storage.values()
                       for entry in per_op.values() for wrapper in _wrappers(entry)
                       if isinstance(wrapper.val, torch.Tensor)]


class _Collected(Exception):
    """W's recomputation has every operand it was asked for."""


def _wrappers(entry) -> list:
    if isinstance(entry, list | tuple):
        return [w for item in entry for w in _wrappers(item)]
    return [entry] if hasattr(entry, "val") else []


def checkpointed(fn: Callable, args: list, *, policy: str, meter: ActivationMeter | None, keep: set,
                 min_width: int):
    """`fn(*args)` under activation checkpointing `policy` ("full" or "selective"); `keep`: storage
    keys saved as they are (the parameters'); the args' storages are added. Returns fn's result,
    whose autograd graph is the ordinary one."""
    keep = keep | {storage_key(a) for a in args if isinstance(a, torch.Tensor)}
    frame = _Frame(fn, args, meter, keep, selective_policy(min_width) if policy == "selective" else None)
    mode = frame.forward_mode if frame.forward_mode is not None else contextlib.nullcontext()
    with torch.autograd.graph.saved_tensors_hooks(frame.pack, frame.unpack), mode:
        result = fn(*args)
    frame.hold_cached()
    for out in result if isinstance(result, list | tuple) else [result]:
        if isinstance(out, torch.Tensor) and out.grad_fn is not None:
            # The weight store finds the chunk's frames from its graph (`graph_cut`).
            out.grad_fn.metadata.setdefault(FRAME_KEY, []).append(frame)
    return result


def _pending(t) -> bool:
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return isinstance(t, AsyncCollectiveTensor)
