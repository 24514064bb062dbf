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

import torch


def storage_key(t: torch.Tensor) -> tuple[str, int]:
    """(device type, storage address); a DTensor (an FSDP2 shard, a tensor-parallel weight) is keyed
    by its local tensor, and the output of an async collective (the tensor-parallel layers'
    redistributions) by its result's, once it has arrived (a wrapper holds no storage of its own)."""
    if hasattr(t, "to_local"):
        t = t.to_local()
    if hasattr(t, "trigger_wait"):
        t = t.trigger_wait()
    storage = t.untyped_storage()
    return (t.device.type, storage.data_ptr())


class _Held:
    """A saved tensor and the meter that counts it; the count drops when autograd drops this."""

    __slots__ = ("tensor", "_meter", "_key")

    def __init__(self, tensor: torch.Tensor, meter: ActivationMeter | None, key) -> None:
        self.tensor, self._meter, self._key = tensor, meter, key

    def __del__(self) -> None:
        if self._meter is not None:
            self._meter._release(self._key)


class ActivationMeter:
    """Live and peak bytes of the storages saved for backward under `saving()` (see module docstring).

    `exclude`: storage keys never counted (the rank's parameters); `set_excluded` renews them when
    parameters move (to a device, or into FSDP's shards)."""

    def __init__(self, exclude: set | None = None) -> None:
        self._exclude = set(exclude or ())
        self._slots: dict[tuple[str, int], tuple[list[int], list[int]]] = {}
        self._refs: dict[tuple, list[int]] = {}  # key -> [handles alive, storage bytes]
        self.live_bytes = 0
        self.peak_bytes = 0

    def set_excluded(self, params) -> None:
        self._exclude = {storage_key(p) for p in params if not p.is_meta}

    def set_slots(self, slots: dict[tuple[str, int], list[tuple[int, int]]]) -> None:
        """Storages (by `storage_key`) that hold several messages, each as (first byte, bytes) per
        message slot: a saved view of one counts its slot alone, keyed by the slot."""
        self._slots = {key: ([start for start, _n in sorted(ranges)], [n for _s, n in sorted(ranges)])
                       for key, ranges in slots.items()}

    def _unit(self, t: torch.Tensor, key: tuple[str, int]) -> tuple[tuple, int]:
        """(the counting unit's key, its bytes): the storage, or the message slot a view lies in."""
        slots = self._slots.get(key)
        if slots is not None:
            starts, sizes = slots
            first = t.storage_offset() * t.element_size()
            i = bisect.bisect_right(starts, first) - 1
            if i >= 0 and first < starts[i] + sizes[i]:
                return (*key, starts[i]), sizes[i]
        return key, t.untyped_storage().nbytes()

    def reset_peak(self) -> None:
        """Start a step: the peak restarts from what is alive now (nothing, after a whole step)."""
        self.peak_bytes = self.live_bytes

    def pack(self, t: torch.Tensor) -> _Held:
        # Detached: a node that saves its own output would otherwise hold itself through the tensor's
        # grad_fn (a reference cycle that only the garbage collector frees); same storage either way.
        t = t.detach()
        if t.is_meta or t.device.type == "meta":
            return _Held(t, None, None)
        key = storage_key(t)
        if key in self._exclude:
            return _Held(t, None, None)
        key, n_bytes = self._unit(t, key)
        entry = self._refs.get(key)
        if entry is None:
            self._refs[key] = [1, n_bytes]
            self.live_bytes += n_bytes
            if self.live_bytes > self.peak_bytes:
                self.peak_bytes = self.live_bytes
        else:
            entry[0] += 1
        return _Held(t, self, key)

    @staticmethod
    def unpack(held: _Held) -> torch.Tensor:
        return held.tensor

    def _release(self, key) -> None:
        entry = self._refs.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            del self._refs[key]
            self.live_bytes -= entry[1]

    def saving(self):
        """The context under which a forward's saved tensors are counted."""
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


def optional_saving(meter: ActivationMeter | None):
    return contextlib.nullcontext() if meter is None else meter.saving()
