"""Counting the bytes a rank keeps for its backward (docs/spec.md section 8, `activation_peak_bytes`).

`ActivationMeter.saving()` is a `torch.autograd.graph.saved_tensors_hooks` context: every tensor an
autograd node saves while it is active is packed into a handle (the tensor, its storage's count) that
keeps the tensor (so memory behaves exactly as without the hook) and counts its storage. The rules, which the
simulator's prediction follows:

- the unit is the **storage** (`untyped_storage()`, its whole `nbytes()`): a tensor saved by several
  nodes, or several views of one buffer (a received message's flat buffer, the q/k/v of one
  projection), count once, for as long as any handle to the storage lives;
- a storage that holds many messages at once (the shared-memory transport's arena of one peer's
  messages, `comm.shm_transport`: a received tensor is a view of its message's slot) is counted by
  the slot, not the whole storage: a saved view counts its message's bytes, as the message's own
  flat buffer counts under the loopback and gloo transports, so the count does not depend on the
  launcher (the transport names its slots, `set_slots`);
- a storage is alive from the first save until autograd drops the last handle: a fused backward
  (B) drops a node's handles as the node runs; so does the split backward's I, which packs the
  weight store's operands through the meter (`weight_store`: they live until W drains them); its
  slow twin keeps the whole graph (`retain_graph`), so the chunk's saved storages live until W;
- parameters' own storages are not activations (they are `param_bytes`), so they are never
  counted; a copy of a parameter (the bf16 cast under autocast, FSDP2's all-gathered unsharded
  parameter) is a new storage and is counted;
- inputs of a chunk (received hop tensors, cache reads) that a node saves are counted like any
  other saved storage, also when the cache counts the same storage in `cache_peak_bytes`: each
  term stands alone, and the rank's total peak is not their sum;
- activation checkpointing (`pipeline.activation_checkpoint`) packs its kept tensors and its
  recomputed ones through the same meter, so a recomputation inside a backward is a transient the
  peak includes.

The peak is the running maximum of live bytes over the step (it can only rise at a save), so it is
the peak over the action order including the moments inside an action.
"""

from __future__ import annotations

import bisect
import contextlib
import operator
import weakref

import torch


def storage_key(t: torch.Tensor) -> tuple[str, int]:
    """(device type, storage address); a DTensor (an FSDP2 shard, a tensor-parallel weight) is keyed
    by its local tensor, and the output of an async collective (the tensor-parallel layers'
    redistributions) by its result's, once it has arrived (a wrapper holds no storage of its own)."""
    t = _storage_holder(t)
    return (t.device.type, t.untyped_storage().data_ptr())


def _storage_holder(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage `t`'s data lives in: `t` itself but for a wrapper subclass."""
    if type(t) in _PLAIN:  # nearly every saved tensor: no attribute probes
        return t
    if hasattr(t, "to_local"):
        t = t.to_local()
    if hasattr(t, "trigger_wait"):
        t = t.trigger_wait()
    return t


_PLAIN = (torch.Tensor, torch.nn.Parameter)


class _Storage:
    """One counted storage (or message slot): its key and bytes. Every handle to it is a plain tuple
    (tensor, this), so dropping a handle runs no Python; the storage's bytes stop counting when its
    last handle goes and this object with it. The meter finds it again through a weak reference
    (`ref`), which keeps nothing alive."""

    __slots__ = ("key", "n_bytes", "meter", "ref", "__weakref__")

    def __del__(self) -> None:
        meter = self.meter
        refs = meter._refs
        if refs.get(self.key) is self.ref:  # not a newer entry for a storage at the same address
            del refs[self.key]
        meter.live_bytes -= self.n_bytes


_weakref = weakref.ref


class ActivationMeter:
    """Live and peak bytes of the storages saved for backward under `saving()` (see module docstring).

    `exclude`: storage keys never counted (the rank's parameters); `set_excluded` renews them when
    parameters move (to a device, or into FSDP's shards)."""

    def __init__(self, exclude: set | None = None) -> None:
        self._exclude = set(exclude or ())
        self._slots: dict[tuple[str, int], tuple[list[int], list[int]]] = {}
        self._special = set(self._exclude)  # excluded or slotted keys: one test per saved tensor
        self._refs: dict[tuple, weakref.ref] = {}  # key -> weak reference to its live _Storage
        self.live_bytes = 0
        self.peak_bytes = 0

    def set_excluded(self, params) -> None:
        self._exclude = {storage_key(p) for p in params if not p.is_meta}
        self._special = self._exclude | set(self._slots)

    def set_slots(self, slots: dict[tuple[str, int], list[tuple[int, int]]]) -> None:
        """Storages (by `storage_key`) that hold several messages, each as (first byte, bytes) per
        message slot: a saved view of one counts its slot alone, keyed by the slot."""
        self._slots = {key: ([start for start, _n in sorted(ranges)], [n for _s, n in sorted(ranges)])
                       for key, ranges in slots.items()}
        self._special = self._exclude | set(self._slots)

    def _slot(self, t: torch.Tensor, key: tuple[str, int]) -> tuple[tuple, int] | None:
        """(the slot's key, its bytes) if `t` is a view into a message slot of storage `key`, else None."""
        starts, sizes = self._slots[key]
        first = t.storage_offset() * t.element_size()
        i = bisect.bisect_right(starts, first) - 1
        if i >= 0 and first < starts[i] + sizes[i]:
            return (*key, starts[i]), sizes[i]
        return None

    def reset_peak(self) -> None:
        """Start a step: the peak restarts from what is alive now (nothing, after a whole step)."""
        self.peak_bytes = self.live_bytes

    def pack(self, t: torch.Tensor) -> tuple:
        # Called for every tensor a forward saves, so it does the least it can in Python: no device
        # object for a CPU tensor, no attribute probes on a plain tensor, one set test for the rare
        # keys, a handle built by the interpreter, and nothing in Python when a handle is dropped.
        if type(t) in _PLAIN:
            if t.is_meta:
                return (t,)
            storage = t.untyped_storage()
            key = ("cpu" if t.is_cpu else t.device.type, storage.data_ptr())
            holder = t
        else:
            if t.is_meta or t.device.type == "meta":
                return (t,)
            holder = _storage_holder(t)
            storage = holder.untyped_storage()
            key = (holder.device.type, storage.data_ptr())
        # A node that saves its own output would hold itself through the tensor's grad_fn (a
        # reference cycle that only the garbage collector frees), so a non-leaf is kept without its
        # autograd history: `.data` (same storage, cheaper than detach()) for a plain tensor, `detach()` for a
        # wrapper subclass. A leaf holds no node and is kept as it is (autograd hands the pack hook a
        # detached leaf for every saved input).
        if not t.is_leaf:
            t = t.data if holder is t else t.detach()
        slot = None
        if key in self._special:
            if key in self._exclude:
                return (t,)
            slot = self._slot(holder, key)
            if slot is not None:
                key = slot[0]
        ref = self._refs.get(key)
        entry = None if ref is None else ref()
        if entry is None:  # the storage's first live save: its bytes start counting
            entry = _Storage()
            entry.key, entry.n_bytes, entry.meter = key, storage.nbytes() if slot is None else slot[1], self
            entry.ref = self._refs[key] = _weakref(entry)
            self.live_bytes += entry.n_bytes
            if self.live_bytes > self.peak_bytes:
                self.peak_bytes = self.live_bytes
        return (t, entry)

    def counted(self, held) -> tuple[tuple, int] | None:
        """(its key, the bytes it is counted as) for a handle `pack` returned; None if uncounted."""
        if len(held) != 2:
            return None
        entry = held[1]
        ref = self._refs.get(entry.key)
        return (entry.key, entry.n_bytes) if ref is not None and ref() is entry else None

    # What `pack` returned, back to its tensor (a C-level getter: it runs once per saved tensor).
    unpack = staticmethod(operator.itemgetter(0))

    def saving(self):
        """The context under which a forward's saved tensors are counted."""
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


def optional_saving(meter: ActivationMeter | None):
    return contextlib.nullcontext() if meter is None else meter.saving()
