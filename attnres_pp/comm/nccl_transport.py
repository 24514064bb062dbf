"""`BatchedDistTransport`: torch.distributed point-to-point issued the way NCCL needs (docs/spec.md
section 5), for the nccl backend (and, to test the same code path on CPU, over gloo).

NCCL ignores tags, matches the messages between two ranks in issue order and completes a send only
once its receive is posted, so the executor (`pipeline.executor`, under NCCL rules) issues every
message in the groups of `schedule.validate_nccl.lockstep_plan`: each group, the receives posted
ahead plus at most the action's own send, goes out as one `batch_isend_irecv` (one NCCL group,
whose operations progress together, as torch.distributed.pipelining batches its p2p ops), without
waiting. A receive waits for its group's work when its data is needed; sends are waited at `flush`.
Peers are pipeline ranks, mapped to global ranks by `peer_ranks` as in `DistTransport` (D x P runs),
and an emulated slow link (`link`, `comm.link`) stamps and delays messages as it does there.
"""

from __future__ import annotations

import time

import torch

from attnres_pp.comm.link import LinkModel
from attnres_pp.comm.transport import DistTransport, TransportTimeout
from attnres_pp.comm.wire import pack, refuse_self_hop, stamp_numel, unpack, wait_for_arrival, with_arrival


class BatchedDistTransport(DistTransport):
    p2p_semantics = "nccl"

    def __init__(self, pp_rank: int, timeout_s: float, device: torch.device, ledger=None,
                 peer_ranks: list[int] | None = None, link: LinkModel | None = None):
        super().__init__(pp_rank, timeout_s, device, ledger, peer_ranks, link)
        self.can_prepost = False  # receives are posted where the NCCL plan says
        self._group: list | None = None  # (P2POp, buffer, (src, tag) for a receive | None)

    def begin_group(self) -> None:
        if self._group is not None:
            raise RuntimeError(f"rank {self.pp_rank}: begin_group inside an open group")
        self._group = []

    def end_group(self) -> None:
        import torch.distributed as dist

        group, self._group = self._group, None
        if not group:
            return
        works = dist.batch_isend_irecv([op for op, _, _ in group])
        # One work per op (gloo; each must be waited exactly once: a gloo receive waited twice waits
        # for a second message), or one coalesced work for the whole NCCL group (waits are idempotent).
        per_op = [[w] for w in works] if len(works) == len(group) else [list(works)] * len(group)
        for (_, flat, key), op_works in zip(group, per_op, strict=True):
            if key is None:
                self._pending.append((op_works, flat, None))
            else:
                self._posted[key] = (op_works, flat)

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int, label: tuple[str, int, int]) -> None:
        import torch.distributed as dist

        if self._group is None:
            raise RuntimeError(f"rank {self.pp_rank}: a send outside the NCCL plan's groups (tag {tag})")
        refuse_self_hop(self.pp_rank, dst)
        self.ledger.record(*label, tensors)
        flat = pack(tensors).to(self.device)
        if self.link_clock is not None:  # posted now: the emulated link decides when it arrives
            n_bytes = flat.numel() * flat.element_size()
            flat = with_arrival(flat, self.link_clock.arrival(dst, n_bytes, time.perf_counter()))
        self._group.append((dist.P2POp(dist.isend, flat, self._global(dst), tag=tag), flat, None))

    def prepost_recv(self, shapes: list[torch.Size], dtype: torch.dtype, src: int, tag: int) -> None:
        import torch.distributed as dist

        if self._group is None:
            raise RuntimeError(f"rank {self.pp_rank}: a receive outside the NCCL plan's groups (tag {tag})")
        refuse_self_hop(self.pp_rank, src)
        numel = sum(int(torch.Size(s).numel()) for s in shapes)
        if self.link_clock is not None:
            numel += stamp_numel(dtype)
        flat = torch.empty(numel, dtype=dtype, device=self.device)
        self._group.append((dist.P2POp(dist.irecv, flat, self._global(src), tag=tag), flat, (src, tag)))

    def recv(self, shapes: list[torch.Size], dtype: torch.dtype, src: int, tag: int) -> list[torch.Tensor]:
        posted = self._posted.pop((src, tag), None)
        if posted is None:
            raise RuntimeError(f"rank {self.pp_rank}: receive from rank {src} (tag {tag}) was never posted")
        works, flat = posted
        self._wait(works, f"receive from rank {src} (tag {tag})", src)
        if self.link_clock is not None:
            flat = wait_for_arrival(flat)
        return unpack(flat, shapes)

    def flush(self) -> None:
        pending, self._pending = self._pending, []
        for works, _buffer, _ in pending:
            self._wait(works, "a send", None)

    def _wait(self, works, what: str, peer: int | None) -> None:
        for work in works:
            try:
                work.wait(self.timeout)
            except RuntimeError as error:
                alive = f"; is rank {peer} still alive?" if peer is not None else ""
                raise TransportTimeout(
                    f"rank {self.pp_rank}: {what} failed (a peer reset, or nothing within "
                    f"{self.timeout.total_seconds():.0f} s){alive} ({error})"
                ) from error
