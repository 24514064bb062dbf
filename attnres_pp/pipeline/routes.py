"""The fixed facts of every communication action of a lowered schedule, computed once per run: the
peer rank, the message tag, the shapes of the tensors, whether the hop stays on the rank. The
runtime looks them up by action position instead of deriving them per message, and the
shared-memory transport lays out its message slots from `wire_messages`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from attnres_pp.comm.plan import RESIDUAL, PayloadPlan, Source
from attnres_pp.schedule.ir import ActionKind, Schedule


def hop_shapes(microbatch_shape: tuple[int, int], source_width: int,
               residual_width: int) -> Callable[[Source], torch.Size]:
    """The shape of one tensor of a hop, per microbatch: [batch, seq, width] (the residual's width
    for the standard residual stream, the sources' otherwise)."""
    batch, seq = microbatch_shape
    source, residual = torch.Size((batch, seq, source_width)), torch.Size((batch, seq, residual_width))
    return lambda s: residual if s == RESIDUAL else source


def message_tag(message_id: tuple[str, int, int], n_chunks: int) -> int:
    """Distinct tag per (direction, sending chunk, microbatch): no FIFO assumption between ranks."""
    direction, chunk_index, microbatch_index = message_id
    return (microbatch_index * n_chunks + chunk_index) * 2 + (direction == "B")


@dataclass(frozen=True)
class Route:
    """One send or receive. label: the byte ledger's (direction, hop index, microbatch)."""

    peer: int
    tag: int
    shapes: tuple[torch.Size, ...]
    self_hop: bool
    message_id: tuple[str, int, int]
    label: tuple[str, int, int]


def rank_routes(schedule: Schedule, plan: PayloadPlan, pp_rank: int,
                shape_of: Callable[[Source], torch.Size]) -> list[Route | None]:
    """Per action of rank `pp_rank`'s list, its Route (None for compute actions)."""
    n_chunks = plan.partition.n_chunks
    routes: list[Route | None] = []
    for action in schedule.rank_actions[pp_rank]:
        if action.is_compute:
            routes.append(None)
            continue
        io = plan.chunks[action.chunk_index]
        if action.kind is ActionKind.SEND_F or action.kind is ActionKind.RECV_B:
            sources = io.sent  # the hop out of the chunk, and its gradients coming back
        else:
            sources = io.received
        message_id = action.message_id
        peer = schedule.peer(action)
        direction, sender, microbatch = message_id
        label = ("fwd", sender, microbatch) if direction == "F" else ("bwd", sender - 1, microbatch)
        routes.append(Route(peer=peer, tag=message_tag(message_id, n_chunks),
                            shapes=tuple(shape_of(s) for s in sources), self_hop=peer == pp_rank,
                            message_id=message_id, label=label))
    return routes


def wire_messages(schedule: Schedule, plan: PayloadPlan,
                  shape_of: Callable[[Source], torch.Size]) -> list[tuple[int, int, int, tuple[torch.Size, ...]]]:
    """Every message of one step that crosses between ranks: (src, dst, tag, shapes), in schedule
    order. Identical on every rank (it depends only on the schedule and the plan)."""
    messages = []
    for pp_rank in range(schedule.n_stages):
        for action, route in zip(schedule.rank_actions[pp_rank], rank_routes(schedule, plan, pp_rank, shape_of),
                                 strict=True):
            if route is not None and action.is_send and not route.self_hop:
                messages.append((pp_rank, route.peer, route.tag, route.shapes))
    return messages
