"""The bytes a rank's tensor-parallel collectives send: `summary.json`'s `tp_bytes_per_step`.

`TensorParallelBytes` is a TorchDispatchMode: the DTensor layers' redistributions (all-gathers,
reduce-scatters, all-reduces over the tp mesh) reach the dispatcher as functional collectives, and
MSAR's halo and the partial gradients' sums as c10d ones; the mode adds up what each collective
over the tp group sends from this rank under the ring algorithms the simulator prices
(docs/spec.md section 10): an all-gather of an input of n bytes over T ranks sends (T - 1) n, a
reduce-scatter of n bytes (T - 1) n / T, an all-reduce 2 (T - 1) n / T. Collectives over other
groups (dp, pp, every rank) are not counted, and a step's pipeline hops are point-to-point.

Every aten op of the counted region goes through Python dispatch, so a rank counts one step (the
bytes are the same every step: one plan, one shape) and reports that count for every step.

Thread ranks (the in-process launcher) send some of their tp traffic where no dispatcher sees it:
the sums of partial gradients between threads (`mesh.ThreadCollectives`) and c10d ops over the
threaded process group, a Python group whose ops never reach the dispatcher (MSAR's halo). Those
callers report their bytes with `count_outside_dispatch`, so a thread rank counts what a rank
process counts.
"""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

_counting = threading.local()  # the TensorParallelBytes counting on this thread, if one is


def count_outside_dispatch(n_bytes_sent: int, *, c10d_op: bool) -> None:
    """Add `n_bytes_sent` to this thread's counting `TensorParallelBytes`, if one counts: the bytes of
    a tp collective it cannot see, a sum between thread ranks (`c10d_op=False`), or a c10d op, which
    it sees itself unless the tp group is the threaded one (`c10d_op=True`: then counted here only)."""
    counter = getattr(_counting, "counter", None)
    if counter is not None and (not c10d_op or counter.threaded):
        counter.sent_bytes += n_bytes_sent


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _named(group_name: str):
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


class TensorParallelBytes(TorchDispatchMode):
    """Counts, in `sent_bytes`, what this rank's collectives over the ranks of `tp_group` send (over
    any group of those ranks: a second mesh of the same ranks may reuse the first one's groups)."""

    def __init__(self, tp_group) -> None:
        super().__init__()
        self.members, t = tuple(dist.get_process_group_ranks(tp_group)), tp_group.size()
        self._is_tp: dict[str, bool] = {}  # group name -> whether it holds the tp group's ranks
        self.sent_bytes = 0
        self.threaded = dist.get_backend(tp_group) == "threaded"  # its c10d ops bypass the dispatcher
        functional, c10d = torch.ops._c10d_functional, torch.ops.c10d
        unbox = dist.ProcessGroup.unbox
        # op -> (its process group, bytes sent) from its arguments
        self._rules = {
            functional.all_gather_into_tensor.default: lambda a: (_named(a[2]), _bytes(a[0]) * (t - 1)),
            functional.reduce_scatter_tensor.default: lambda a: (_named(a[3]), _bytes(a[0]) * (t - 1) // t),
            functional.all_reduce.default: lambda a: (_named(a[2]), 2 * _bytes(a[0]) * (t - 1) // t),
            c10d.allgather_.default: lambda a: (unbox(a[2]), sum(_bytes(x) for x in a[1]) * (t - 1)),
            c10d.allreduce_.default: lambda a: (unbox(a[1]), 2 * sum(_bytes(x) for x in a[0]) * (t - 1) // t),
        }

    def __enter__(self):
        _counting.counter = self
        return super().__enter__()

    def __exit__(self, *exc):
        _counting.counter = None
        return super().__exit__(*exc)

    def _over_tp(self, group) -> bool:
        name = group.group_name
        if name not in self._is_tp:
            try:
                self._is_tp[name] = tuple(dist.get_process_group_ranks(group)) == self.members
            except KeyError:  # a group c10d does not hold (torchft's, across replica groups): not tp
                self._is_tp[name] = False
        return self._is_tp[name]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(kind, DTensor) for kind in types):
            # Let DTensor lower the op first: its collectives then come back here on plain tensors.
            return NotImplemented
        rule = self._rules.get(func)
        if rule is not None:
            group, sent = rule(args)
            if self._over_tp(group):
                self.sent_bytes += sent
        return func(*args, **(kwargs or {}))
