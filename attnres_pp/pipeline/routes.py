"""The fixed facts of every communication action of a lowered schedule, computed once per run (per
pass in generation): the peer rank, the message tag, the shapes of the tensors, whether the hop
stays on the rank. The executor (`pipeline.executor`) looks them up by action position instead of
deriving them per message, and the shared-memory transport lays out its message slots from
`wire_messages`.
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
    return action_routes(schedule, plan, pp_rank, lambda _microbatch, source: shape_of(source))


def action_routes(schedule: Schedule, plan: PayloadPlan, pp_rank: int,
                  shape_of: Callable[[int, Source], torch.Size], first_id: int = 0) -> list[Route | None]:
    """As `rank_routes`, with shapes per (microbatch, source), and microbatch k numbered `first_id + k`
    in the message ids, tags and labels: a generation pass's pieces take the next ids of the session
    (so no tag is reused while a rank lives), and their token counts differ from piece to piece."""
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
        direction, sender, microbatch = action.message_id
        message_id = (direction, sender, first_id + microbatch)
        peer = schedule.peer(action)
        label = ("fwd", sender, message_id[2]) if direction == "F" else ("bwd", sender - 1, message_id[2])
        routes.append(Route(peer=peer, tag=message_tag(message_id, n_chunks),
                            shapes=tuple(shape_of(microbatch, s) for s in sources), self_hop=peer == pp_rank,
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
