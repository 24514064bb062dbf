"""The one action executor (docs/architecture.md rule 14): runs a rank's lowered action list, for training, for
pipelined evaluation and for generation alike. The runtimes (`runtime.StageRuntime`,
`generation_runtime.GenerationRuntime`) supply the compute actions (F, B, I, W); this owns the rest:

- the cursor over the actions, and each communication action's route (peer, tag, shapes), fixed
  when a schedule is loaded (`routes.action_routes`);
- the messages: what a forward hands its hop (`outbox`), what a receive brought (`received`,
  `grads_back`), what a backward hands its hop (`grads_out`), and the block cache of the step;
- self-hops (two consecutive chunks on this rank, any placement): the send parks the tensors in
  memory and the receive takes them (no copy, no bytes, no ledger entry), so the wire carries, and
  the ledger counts, only what crosses between ranks;
- how messages are issued, from the transport's point-to-point rules (docs/spec.md section 5):
  gloo (tags match, sends are buffered): receives are posted ahead (`recv_lookahead` of them, or
  all of a pass's), so the sender's isend writes at once (see comm.transport);
  nccl (issue order matches, sends wait for their receive): the sends and receives go out in the
  groups of `validate_nccl.lockstep_plan`, one `batch_isend_irecv` each, the order that plan
  proves deadlock-free. Posting every receive up front would deadlock there at V >= 2;
- the forward's communication around a chunk's compute: its inputs (the hop's tensors, then its
  cache reads) and, after it, its cache puts and frees and the tensors of its outgoing hop.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from attnres_pp.comm.cache import BlockCache
from attnres_pp.comm.plan import PayloadPlan, Source
from attnres_pp.comm.transport_protocol import Transport
from attnres_pp.pipeline.routes import Route, action_routes
from attnres_pp.schedule.ir import Action, ActionKind, Schedule
from attnres_pp.schedule.validate_nccl import lockstep_plan

# Receives a rank keeps posted ahead under gloo in a training step: enough to cover the next forward
# and backward of each of a few chunks, few enough that the buffers stay small next to the activations.
RECV_LOOKAHEAD = 4

Key = tuple[int, int]  # (chunk_index, microbatch_index)


class ActionExecutor:
    """Rank `pp_rank`'s executor. `load` a lowered schedule (once per run, or per generation pass),
    `start` each step, then `run_next` until `finished` (`next_ready` says whether the next action
    can run now, for in-process turns). `compute(action)` runs a compute action.

    `recv_lookahead`: receives kept posted ahead under gloo (None: every receive of the step, posted
    at `start`). `recv_leaves`: received forward tensors become fresh autograd leaves (training)."""

    def __init__(self, *, pp_rank: int, plan: PayloadPlan, transport: Transport, dtype: torch.dtype,
                 compute: Callable[[Action], None], recv_lookahead: int | None = RECV_LOOKAHEAD,
                 recv_leaves: bool = True) -> None:
        self.pp_rank = pp_rank
        self.plan = plan
        self.transport = transport
        self.dtype = dtype  # of hops: the activation dtype (bf16 under bf16 autocast)
        self.compute = compute
        self.recv_lookahead = recv_lookahead
        self.recv_leaves = recv_leaves
        self._prepost = transport.can_prepost and transport.p2p_semantics != "nccl"
        self.cache = BlockCache()
        self.cursor = 0
        self.actions: tuple[Action, ...] = ()

    def load(self, schedule: Schedule, shape_of: Callable[[int, Source], torch.Size], first_id: int = 0) -> None:
        """Take `schedule`'s actions of this rank, their routes (`routes.action_routes`: hop shapes per
        (microbatch, source), microbatch k numbered `first_id + k` in tags and cache entries) and,
        under NCCL's rules, its issue plan."""
        self.actions = schedule.rank_actions[self.pp_rank]
        self.first_id = first_id
        self.routes: list[Route | None] = action_routes(schedule, self.plan, self.pp_rank, shape_of, first_id)
        self._route_of = {a: r for a, r in zip(self.actions, self.routes, strict=True) if r is not None}
        self._recv_positions = [i for i, (action, route) in enumerate(zip(self.actions, self.routes, strict=True))
                                if action.is_recv and not route.self_hop]
        self._nccl_plan = lockstep_plan(schedule)[self.pp_rank] if self.transport.p2p_semantics == "nccl" else None

    def start(self) -> None:
        """Begin a step (or pass) of the loaded schedule: empty messages and cache, cursor at 0."""
        self.received: dict[Key, dict[Source, torch.Tensor]] = {}  # a forward's inputs off its hop
        self.outbox: dict[Key, list[torch.Tensor]] = {}  # a forward's hop out of its chunk
        self.grads_back: dict[Key, list[torch.Tensor]] = {}  # gradients of what a chunk sent
        self.grads_out: dict[Key, list[torch.Tensor]] = {}  # gradients of what a chunk received
        self._in_memory: dict[tuple[str, int, int], list[torch.Tensor]] = {}  # self-hops, by message id
        self.cache = BlockCache()
        self.cursor = 0
        self._nccl_posted_at = -1
        self._recvs_done = self._recvs_posted = 0
        self._prepost_receives()

    @property
    def finished(self) -> bool:
        return self.cursor >= len(self.actions)

    def next_ready(self) -> bool:
        """True if the next action can run now (a receive whose message has arrived, or any other)."""
        action, route = self.actions[self.cursor], self.routes[self.cursor]
        if not action.is_recv:
            return True
        if route.self_hop:
            return route.message_id in self._in_memory
        self._issue_nccl_groups(None)
        return self.transport.ready(route.peer, route.tag)

    def run_next(self) -> None:
        action = self.actions[self.cursor]
        if not self._issue_nccl_groups(action):
            self._run(action)
        self.cursor += 1

    def flush(self) -> None:
        """Wait for the step's sends."""
        self.transport.flush()

    def cache_id(self, action: Action) -> int:
        """The id of `action`'s microbatch in the cache and the tags (`first_id` + its index)."""
        return self.first_id + action.microbatch_index

    # ---- the forward's communication ----
    def forward_inputs(self, action: Action) -> dict[Source, torch.Tensor]:
        """F `action`'s inputs: the tensors its hop brought, then its chunk's cache reads."""
        c = action.chunk_index
        inputs = self.received.pop((c, action.microbatch_index), {})
        cache_id = self.cache_id(action)
        for source in self.plan.chunks[c].cache_reads:
            inputs[source] = self.cache.read(cache_id, source)
        return inputs

    def forward_outputs(self, action: Action, inputs: dict[Source, torch.Tensor],
                        produced: dict[Source, torch.Tensor]) -> None:
        """After F `action`: its chunk's cache puts and frees, and (but on the last chunk) the tensors
        of its outgoing hop (none on a self-hop that carries nothing)."""
        c = action.chunk_index
        io, cache_id = self.plan.chunks[c], self.cache_id(action)
        for source in io.cache_puts:
            self.cache.put(cache_id, source, produced.get(source, inputs.get(source)))
        for source in io.frees:
            self.cache.free(cache_id, source)
        if c < self.plan.partition.n_chunks - 1:
            self.outbox[(c, action.microbatch_index)] = [produced.get(s, inputs.get(s)) for s in io.sent]

    # ---- communication actions ----
    def _run(self, action: Action) -> None:
        handler = self._COMM_HANDLERS.get(action.kind)
        if handler is None:
            self.compute(action)
        else:
            handler(self, action)

    def _send_forward(self, action: Action) -> None:
        self._send(self.outbox.pop((action.chunk_index, action.microbatch_index)))

    def _recv_forward(self, action: Action) -> None:
        # Fresh leaves: over the wire they are new buffers (or message slots); in memory, new views.
        tensors = self._receive()
        if self.recv_leaves:
            tensors = [t.detach().requires_grad_(True) for t in tensors]
        sources = self.plan.chunks[action.chunk_index].received
        self.received[(action.chunk_index, action.microbatch_index)] = dict(zip(sources, tensors, strict=True))

    def _send_backward(self, action: Action) -> None:
        self._send(self.grads_out.pop((action.chunk_index, action.microbatch_index)))

    def _recv_backward(self, action: Action) -> None:
        self.grads_back[(action.chunk_index, action.microbatch_index)] = self._receive()

    _COMM_HANDLERS = {
        ActionKind.SEND_F: _send_forward,
        ActionKind.RECV_F: _recv_forward,
        ActionKind.SEND_B: _send_backward,
        ActionKind.RECV_B: _recv_backward,
    }

    def _send(self, tensors: list[torch.Tensor]) -> None:
        route = self.routes[self.cursor]
        if route.self_hop:
            self._in_memory[route.message_id] = [t.detach() for t in tensors]
        else:
            self.transport.send(tensors, route.peer, route.tag, route.label)

    def _receive(self) -> list[torch.Tensor]:
        route = self.routes[self.cursor]
        if route.self_hop:
            try:
                return self._in_memory.pop(route.message_id)
            except KeyError:
                action = self.actions[self.cursor]
                raise RuntimeError(f"rank {self.pp_rank}: {action} runs before its self-hop send "
                                   f"{action.matching()} (the schedule orders them wrongly)") from None
        self._recvs_done += 1
        self._prepost_receives()  # before waiting: the next receives are posted while this one waits
        return self.transport.recv(route.shapes, self.dtype, route.peer, route.tag)

    def _prepost_receives(self) -> None:
        """Under gloo, keep posted the receive being run and the `recv_lookahead` receives after it."""
        if not self._prepost:
            return
        ahead = len(self._recv_positions) if self.recv_lookahead is None else self.recv_lookahead
        limit = min(len(self._recv_positions), self._recvs_done + ahead)
        while self._recvs_posted < limit:
            route = self.routes[self._recv_positions[self._recvs_posted]]
            self.transport.prepost_recv(route.shapes, self.dtype, route.peer, route.tag)
            self._recvs_posted += 1

    def _issue_nccl_groups(self, action: Action | None) -> bool:
        """Under NCCL's rules, issue (once per position) the groups the plan places at the cursor: per
        group, its receives posted ahead, and `action`'s own send inside the group it belongs to.
        True if `action` ran here."""
        if self._nccl_plan is None or self._nccl_posted_at == self.cursor:
            return False
        self._nccl_posted_at = self.cursor
        ran = False
        for group in self._nccl_plan[self.cursor]:
            self.transport.begin_group()
            for planned in group:
                if planned.is_recv:
                    route = self._route_of[planned]
                    self.transport.prepost_recv(route.shapes, self.dtype, route.peer, route.tag)
            if action is not None and action.is_send and action in group:
                self._run(action)
                ran = True
            self.transport.end_group()
        return ran


class ExecutorView:
    """What a runtime shows of its executor: the transport, the rank's lowered actions, the cursor
    over them and the step's block cache. A runtime sets `self.executor`."""

    executor: ActionExecutor

    @property
    def transport(self) -> Transport:
        return self.executor.transport

    @property
    def actions(self) -> tuple[Action, ...]:
        return self.executor.actions

    @property
    def cursor(self) -> int:
        return self.executor.cursor

    @property
    def cache(self) -> BlockCache:
        """The step's block cache (cache entries and gradient deposits)."""
        return self.executor.cache
