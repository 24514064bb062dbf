"""The forward-only schedule of pipelined evaluation: every rank runs F of its chunks for every
microbatch, with the hops `passes.insert_comm` adds, and nothing else (no backward, no deposits).

Order per rank: GPipe's forward half, all microbatches through one chunk before the next chunk, in
the order a microbatch visits the rank's chunks. Every hop's sends then leave in the order their
receiver posts the receives, so it runs under NCCL's in-order matching as well as gloo's tags.
(`validate.validate` expects a backward for every forward, so the runtime test of this schedule is
the in-process loopback execution, which raises on any stuck rank.)
"""

from __future__ import annotations

from attnres_pp.comm.partition import chunk_rank
from attnres_pp.schedule.ir import F, Schedule
from attnres_pp.schedule.passes import insert_comm


def forward_only_schedule(n_stages: int, n_virtual: int, n_microbatches: int, placement: str = "loop") -> Schedule:
    """The lowered forward-only schedule of P ranks x V chunks and m microbatches."""
    n_chunks = n_stages * n_virtual
    rank_actions = []
    for pp_rank in range(n_stages):
        chunks = [c for c in range(n_chunks) if chunk_rank(c, n_stages, placement) == pp_rank]
        rank_actions.append(tuple(F(c, mb) for c in chunks for mb in range(n_microbatches)))
    return insert_comm(Schedule(name="forward_only", n_stages=n_stages, n_virtual=n_virtual,
                                n_microbatches=n_microbatches, rank_actions=tuple(rank_actions), placement=placement))
