"""Counting the bytes a rank keeps for its backward (docs/spec.md section 8, `activation_peak_bytes`).

`ActivationMeter.saving()` is a `torch.autograd.graph.saved_tensors_hooks` context: every tensor an
autograd node saves while it is active is packed into a `_Held` handle that keeps the tensor (so
memory behaves exactly as without the hook) and counts its storage. The rules, which the
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


class _Held(tuple):
    """A saved tensor counted by a meter: (tensor, entry, meter), the entry being the meter's
    [handles alive, storage bytes, key] of its storage; the count drops when autograd drops this.

    A tuple built by `tuple.__new__` (no Python `__init__`) and read back by `itemgetter(0)`: the
    meter makes one per saved tensor, so its construction and its unpacking stay in C. A tensor
    that is not counted (a parameter's storage, a meta tensor) is packed as a plain 1-tuple."""

    __slots__ = ()

    def __del__(self) -> None:
        entry = self[1]
        entry[0] -= 1
        if not entry[0]:  # the storage's last handle: its bytes are no longer held
            meter = self[2]
            del meter._refs[entry[2]]
            meter.live_bytes -= entry[1]


_new_held = tuple.__new__


class ActivationMeter:
    """Live and peak bytes of the storages saved for backward under `saving()` (see module docstring).

    `exclude`: storage keys never counted (the rank's parameters); `set_excluded` renews them when
    parameters move (to a device, or into FSDP's shards)."""

    def __init__(self, exclude: set | None = None) -> None:
        self._exclude = set(exclude or ())
        self._slots: dict[tuple[str, int], tuple[list[int], list[int]]] = {}
        self._refs: dict[tuple, list] = {}  # key -> [handles alive, storage bytes, key]
        self.live_bytes = 0
        self.peak_bytes = 0

    def set_excluded(self, params) -> None:
        self._exclude = {storage_key(p) for p in params if not p.is_meta}

    def set_slots(self, slots: dict[tuple[str, int], list[tuple[int, int]]]) -> None:
        """Storages (by `storage_key`) that hold several messages, each as (first byte, bytes) per
        message slot: a saved view of one counts its slot alone, keyed by the slot."""
        self._slots = {key: ([start for start, _n in sorted(ranges)], [n for _s, n in sorted(ranges)])
                       for key, ranges in slots.items()}

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
        # object for a CPU tensor, no attribute probes on a plain tensor, C-level handles.
        if type(t) in _PLAIN:
            if t.is_meta:
                return (t,)
            holder = t
            device_type = "cpu" if t.is_cpu else t.device.type
        else:
            if t.is_meta or t.device.type == "meta":
                return (t,)
            holder = _storage_holder(t)
            device_type = holder.device.type
        storage = holder.untyped_storage()
        key = (device_type, storage.data_ptr())
        # A node that saves its own output would hold itself through the tensor's grad_fn (a
        # reference cycle that only the garbage collector frees), so a non-leaf is kept without its
        # autograd history: `.data` (same storage, cheaper than detach()) for a plain tensor, `detach()` for a
        # wrapper subclass. A leaf holds no node and is kept as it is (autograd hands the pack hook a
        # detached leaf for every saved input).
        if not t.is_leaf:
            t = t.data if holder is t else t.detach()
        if key in self._exclude:
            return (t,)
        slot = self._slot(holder, key) if key in self._slots else None
        if slot is not None:
            key, n_bytes = slot
        entry = self._refs.get(key)
        if entry is None:
            if slot is None:
                n_bytes = storage.nbytes()
            self._refs[key] = entry = [1, n_bytes, key]
            self.live_bytes += n_bytes
            if self.live_bytes > self.peak_bytes:
                self.peak_bytes = self.live_bytes
        else:
            entry[0] += 1
        return _new_held(_Held, (t, entry, self))

    def counted(self, held) -> tuple[tuple, int] | None:
        """(its key, the bytes it is counted as) for a handle `pack` returned; None if uncounted."""
        if not isinstance(held, _Held):
            return None
        entry = held[1]  # [handles alive, storage bytes, key]
        return (entry[2], entry[1]) if self._refs.get(entry[2]) is entry else None

    # What `pack` returned, back to its tensor (a C-level getter: it runs once per saved tensor).
    unpack = staticmethod(operator.itemgetter(0))

    def saving(self):
        """The context under which a forward's saved tensors are counted."""
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


def optional_saving(meter: ActivationMeter | None):
    return contextlib.nullcontext() if meter is None else meter.saving()
