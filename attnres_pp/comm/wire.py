"""The wire format of one hop's message, shared by every transport: a hop's tensors packed into one
flat buffer whose size the receiver knows from the plan (no shape handshake), the receiver's dtype
check, and the emulated arrival time a message carries after its payload on a slow link
(`comm.link`: one float64, written by the sender as it posts the send)."""

from __future__ import annotations

import time

import torch


def refuse_self_hop(pp_rank: int, peer: int) -> None:
    """Raise if rank `pp_rank` asks a transport to message itself (the executor keeps self-hops)."""
    if peer == pp_rank:
        raise ValueError(f"rank {pp_rank} asked the transport to message itself: a hop between two chunks "
                         "of one rank is handed over in memory by the runtime, never sent")


def pack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One flat copy of `tensors` (an empty buffer for none)."""
    return torch.cat([t.detach().reshape(-1) for t in tensors]) if tensors else torch.empty(0)


def unpack(flat: torch.Tensor, shapes: list[torch.Size]) -> list[torch.Tensor]:
    """Views of `flat` with `shapes`, in order (the inverse of `pack`)."""
    sizes = [int(torch.Size(s).numel()) for s in shapes]
    return [piece.view(shape) for piece, shape in zip(flat.split(sizes), shapes, strict=True)]


def check_dtype(flat: torch.Tensor, dtype: torch.dtype, pp_rank: int, src: int, tag: int) -> None:
    """Refuse a message whose dtype is not the one its receiver expects: NCCL would receive its bytes
    into a buffer of another size (and hang, or read garbage), so an in-process run must not cast."""
    if flat.dtype != dtype and flat.numel():  # a message of no tensors has no bytes to misread
        raise TypeError(f"rank {pp_rank}: message with tag {tag} from rank {src} carries {flat.dtype}, the receiver "
                        f"expects {dtype}: sender and receiver disagree on the hop dtype")


def stamp_numel(dtype: torch.dtype) -> int:
    """Elements of `dtype` that hold one float64 (the emulated arrival carried after a payload)."""
    return 8 // torch.empty((), dtype=dtype).element_size()


def with_arrival(flat: torch.Tensor, arrival_s: float) -> torch.Tensor:
    """`flat` followed by its emulated arrival time (perf_counter seconds)."""
    stamp = torch.tensor([arrival_s], dtype=torch.float64).view(flat.dtype).to(flat.device)
    return torch.cat([flat, stamp])


def wait_for_arrival(flat: torch.Tensor) -> torch.Tensor:
    """The payload of a stamped message, returned once its emulated arrival time has passed."""
    n_stamp = stamp_numel(flat.dtype)
    arrival_s = float(flat[-n_stamp:].clone().view(torch.float64).item())
    remaining = arrival_s - time.perf_counter()
    if remaining > 0:
        time.sleep(remaining)
    return flat[:-n_stamp]
