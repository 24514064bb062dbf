"""What a rank holds, in bytes: summary.json's `memory_per_rank` entries (docs/spec.md section 8).

`param_bytes`, `grad_bytes` and `optimizer_bytes` are counted from the tensors the rank holds (their
local tensors: a sharded parameter counts its shard); `optimizer_bytes` is AdamW's two moments
(`exp_avg`, `exp_avg_sq`; the step counter is not counted). `activation_peak_bytes` comes from the
runtime's saved-tensor meter (`pipeline.memory_meter`), `cache_peak_bytes` from the block cache
(entries plus deposits). `transport_buffer_bytes` is what the rank's transport maps for the
whole step besides saved tensors: the shared-memory receive slots (`comm.shm_transport`, one per
message a peer sends it in a step, under `--launcher local` and Ray on one host; 0 where hops are
buffers of their own, freed when consumed: in-process ranks, gloo). `peak_rss_bytes` is the
process's peak resident set (ranks that share a process, under the in-process launcher, report
the same one). On CUDA the entry also carries `cuda_max_memory_allocated_bytes`
(`torch.cuda.max_memory_allocated` of the rank's device, reset every step).
"""

from __future__ import annotations

import resource

import torch

MEMORY_KEYS = ("param_bytes", "grad_bytes", "optimizer_bytes", "activation_peak_bytes", "cache_peak_bytes",
               "peak_rss_bytes", "transport_buffer_bytes")
_MOMENTS = ("exp_avg", "exp_avg_sq")


def local_bytes(t: torch.Tensor) -> int:
    """Bytes of the part of `t` this rank holds (a DTensor's local shard)."""
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def peak_rss_bytes() -> int:
    """This process's peak resident set size (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def grad_bytes(params) -> int:
    """Bytes of the gradients held (call at the end of the backward and its sync: the optimizer step
    drops them)."""
    return sum(local_bytes(p.grad) for p in params if p.grad is not None)


def transport_buffer_bytes(transport) -> int:
    """Bytes of the receive arenas `transport` maps (`Transport.message_slots`: one storage per peer,
    every page allocated at set-up), 0 for a transport whose messages are buffers of their own."""
    return sum(arena.untyped_storage().nbytes() for arena, _ranges in transport.message_slots())


def memory_entry(params, optimizer, *, grad_bytes: int, activation_peak_bytes: int, cache_peak_bytes: int,
                 device: torch.device | None = None, transport_buffer_bytes: int = 0) -> dict:
    """One rank's `memory_per_rank` entry; call after the optimizer step (its state exists then)."""
    params = list(params)
    optimizer_bytes = sum(local_bytes(state[name]) for state in optimizer.state.values()
                          for name in _MOMENTS if name in state)
    entry = {
        "param_bytes": sum(local_bytes(p) for p in params),
        "grad_bytes": int(grad_bytes),
        "optimizer_bytes": optimizer_bytes,
        "activation_peak_bytes": int(activation_peak_bytes),
        "cache_peak_bytes": int(cache_peak_bytes),
        "peak_rss_bytes": peak_rss_bytes(),
        "transport_buffer_bytes": int(transport_buffer_bytes),
    }
    if device is not None and device.type == "cuda":
        entry["cuda_max_memory_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    return entry
