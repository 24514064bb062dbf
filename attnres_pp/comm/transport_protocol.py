"""`Transport` and `Ledger`: the interface every transport of a rank's hops implements (loopback,
NCCL-rule loopback, gloo/nccl point-to-point, batched NCCL, shared memory, per-peer pairs), so that
the executor and the workers call one set of methods and read one set of attributes, never probing.

Peers are pipeline ranks; `tag` is the message's tag (`pipeline.routes.message_tag`); `label` is the
ledger's (direction "fwd"/"bwd", hop index, microbatch). A self-hop never reaches a transport.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class Ledger(Protocol):
    """Every message a rank sent: (direction, hop index, microbatch, tensors, bytes) per record."""

    records: list[tuple[str, int, int, int, int]]

    def record(self, direction: str, hop_index: int, microbatch_index: int,
               tensors: list[torch.Tensor]) -> None: ...

    def clear(self) -> None: ...

    @property
    def total_bytes(self) -> int: ...

    def bytes_by_transport(self) -> dict[str, int]:
        """Bytes by the way they went ("shm", "gloo"); a transport of one way counts all as "gloo"."""
        ...

    def tensors_per_hop(self, direction: str, microbatch_index: int) -> dict[int, int]: ...


@runtime_checkable
class Transport(Protocol):
    """One rank's end of the pipeline's point-to-point messages.

    `p2p_semantics`: "gloo" (messages matched by tag, sends buffered) or "nccl" (matched in issue
    order, a send completes only once its receive is posted): under "nccl" the executor issues
    every message inside `begin_group` / `end_group` in `validate_nccl.lockstep_plan`'s groups.
    `can_prepost`: whether receives posted ahead (`prepost_recv`, gloo's look-ahead) help; a
    transport without it still accepts them under "nccl", where the plan posts them.
    """

    pp_rank: int
    ledger: Ledger
    can_prepost: bool
    p2p_semantics: str

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int, label: tuple[str, int, int]) -> None: ...

    def ready(self, src: int, tag: int) -> bool:
        """Whether `recv` of (src, tag) would return without waiting for the peer (in-process runs)."""
        ...

    def prepost_recv(self, shapes: list[torch.Size], dtype: torch.dtype, src: int, tag: int) -> None: ...

    def recv(self, shapes: list[torch.Size], dtype: torch.dtype, src: int, tag: int) -> list[torch.Tensor]: ...

    def begin_group(self) -> None: ...

    def end_group(self) -> None: ...

    def flush(self) -> None:
        """Wait for every send of the step."""
        ...

    def close(self) -> None:
        """Release what the transport holds beyond the process group (shared-memory doorbells)."""
        ...

    def message_slots(self) -> list[tuple[torch.Tensor, list[tuple[int, int]]]]:
        """Each buffer that holds several received messages (a shared-memory arena, one per peer),
        with (first byte, bytes) of every message's slot in it: a received tensor is a view of its
        slot, so the activation meter counts a kept one by its message. Empty where every received
        message is a buffer of its own (loopback, gloo, NCCL)."""
        ...
