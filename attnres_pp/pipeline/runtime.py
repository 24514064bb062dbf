"""The one stage runtime: executes a rank's lowered action list against its chunks, its block
cache and a transport, and timestamps every action.

Dispatch on action kind (docs/architecture.md rule 3). What each hop carries comes from the payload plan alone.
Gradient bookkeeping per chunk and microbatch, in the backward (B, or I, which does all of this,
then W, which adds the parameters' gradients later; see `split_backward`):
- a tensor this chunk *produced* gets its outside gradient (from the next hop and/or from cache
  deposits) as an autograd root;
- a tensor that came *in* (over the wire or from the cache) is an autograd leaf; its gradient is
  the leaf's own plus any outside gradient for it (it was forwarded or cached), and goes back over
  the wire (received) or into the cache as a deposit (cache read).
A self-hop (two consecutive chunks on this rank, for any placement) never touches the transport:
its send parks the tensors in memory and its receive takes them (no copy, no bytes, no ledger
entry), so the wire carries, and the ledger counts, only what crosses between ranks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from attnres_pp.comm.cache import BlockCache
from attnres_pp.comm.plan import PayloadPlan, Source
from attnres_pp.pipeline.chunk import PipelineChunk
from attnres_pp.pipeline.clock import make_clock
from attnres_pp.pipeline.graph_cut import CutCache
from attnres_pp.pipeline.memory_meter import ActivationMeter
from attnres_pp.pipeline.routes import Route, hop_shapes, message_tag, rank_routes
from attnres_pp.pipeline.split_backward import WeightWork, backward_input, backward_weight, fused_backward
from attnres_pp.schedule.ir import Action, ActionKind, Schedule


def issue_planned_groups(transport, groups: list[list[Action]], action: Action | None,
                         prepost: Callable[[Action], None], run: Callable[[Action], None]) -> bool:
    """Issue one position's groups of a lockstep plan (`schedule.validate_nccl.lockstep_plan`), as
    every runtime does under NCCL's rules: per group, its receives posted ahead (`prepost`), and
    `action`'s own send run inside the group it belongs to (`run`). True if `action` ran here."""
    ran = False
    for group in groups:
        transport.begin_group()
        for planned in group:
            if planned.is_recv:
                prepost(planned)
        if action is not None and action.is_send and action in group:
            run(action)
            ran = True
        transport.end_group()
    return ran


@dataclass
class _ChunkContext:
    inputs: dict[Source, torch.Tensor]
    produced: dict[Source, torch.Tensor]
    loss: torch.Tensor | None


@dataclass
class ActionEvent:
    """One executed action: name as the IR prints it, start/end in seconds on this rank's own clock
    (perf_counter; on a GPU, CUDA events converted to it, `pipeline.clock`)."""

    pp_rank: int
    name: str
    start_s: float
    end_s: float
    category: str  # "compute" or "comm"


@dataclass
class StepRecord:
    # microbatch -> loss (last chunk's rank); read from the device once, at the end of the step
    losses: dict[int, float] = field(default_factory=dict)
    events: list[ActionEvent] = field(default_factory=list)
    cache_peak_bytes: int = 0  # cache entries plus deposits (docs/spec.md section 8)
    activation_peak_bytes: int = 0  # storages saved for backward (`memory_meter`)


# Receives a rank keeps posted ahead under gloo: enough to cover the next forward and backward of
# each of a few chunks, few enough that the buffers stay small next to the activations.
RECV_LOOKAHEAD = 4


__all__ = ["ActionEvent", "StageRuntime", "StepRecord", "message_tag"]


class StageRuntime:
    def __init__(self, *, pp_rank: int, chunks: dict[int, PipelineChunk], plan: PayloadPlan, schedule: Schedule,
                 transport, microbatch_shape: tuple[int, int], source_width: int, residual_width: int,
                 dtype: torch.dtype = torch.float32, clock=None, compute_hooks=None) -> None:
        self.pp_rank = pp_rank
        self.chunks = chunks
        self.plan = plan
        self.schedule = schedule
        self.actions = schedule.rank_actions[pp_rank]
        self.transport = transport
        self.dtype = dtype  # of hops: the activation dtype (bf16 under bf16 autocast)
        self.shape_of = hop_shapes(microbatch_shape, source_width, residual_width)
        device = next((p.device for chunk in chunks.values() for p in chunk.parameters()), torch.device("cpu"))
        self._clock = clock or make_clock(device)  # CUDA events on a GPU, perf_counter on CPU
        self.first_chunk = min(chunks)
        self.cache = BlockCache()
        self.memory = ActivationMeter()  # what the forwards save for backward (docs/spec.md section 8)
        # Called around every compute action (`before(action)`, `after(action)`): FSDP2's unshard and
        # reshard of the action's chunk (`train.fsdp`); None: nothing to do.
        self.compute_hooks = compute_hooks
        self._cuts = CutCache()  # each chunk's graph has the same I/W cut for every microbatch
        # Per action position: its route (peer, tag, shapes; None for compute), name and category,
        # fixed for the run, so that a message costs lookups, not re-derivations.
        self._routes: list[Route | None] = rank_routes(schedule, plan, pp_rank, self.shape_of)
        self._route_of = {a: r for a, r in zip(self.actions, self._routes, strict=True) if r is not None}
        self._names = [str(a) for a in self.actions]
        self._categories = ["compute" if a.is_compute else "comm" for a in self.actions]
        # Positions of this rank's receives; with a transport that can post receives ahead (gloo),
        # the next RECV_LOOKAHEAD of them are always posted (see comm.transport for why).
        self._recv_positions = [i for i, (action, route) in enumerate(zip(self.actions, self._routes, strict=True))
                                if action.is_recv and not route.self_hop]
        self._prepost = getattr(transport, "can_prepost", False)
        # NCCL rules (no tags, rendezvous sends): issue the sends and receives in the groups that
        # validate_nccl.lockstep_plan proves deadlock-free, one batch_isend_irecv per group.
        self._nccl_plan = None
        if getattr(transport, "p2p_semantics", "gloo") == "nccl":
            from attnres_pp.schedule.validate_nccl import lockstep_plan

            self._nccl_plan = lockstep_plan(schedule)[pp_rank]

    # ---- one step ----
    def start_step(self, inputs_by_mb: list[torch.Tensor] | None, targets_by_mb: list[torch.Tensor] | None,
                   loss_scale: float, *, forward_only: bool = False) -> None:
        """`forward_only`: for a schedule of F actions and their hops alone (evaluation): forwards run
        without autograd and keep no context for a backward."""
        self._inputs_by_mb, self._targets_by_mb, self._loss_scale = inputs_by_mb, targets_by_mb, loss_scale
        self._forward_only = forward_only
        self._received: dict[tuple[int, int], dict[Source, torch.Tensor]] = {}
        self._out_grads: dict[tuple[int, int], list[torch.Tensor]] = {}
        self._outbox: dict[tuple[int, int], list[torch.Tensor]] = {}
        self._in_grads: dict[tuple[int, int], list[torch.Tensor]] = {}
        self._contexts: dict[tuple[int, int], _ChunkContext] = {}
        self._weight_work: dict[tuple[int, int], WeightWork] = {}  # I done, W to come
        self._in_memory: dict[tuple[str, int, int], list[torch.Tensor]] = {}  # self-hops, by message id
        self.cache = BlockCache()
        self.memory.set_excluded(p for chunk in self.chunks.values() for p in chunk.parameters())
        self.memory.reset_peak()
        self.record = StepRecord()
        # The last chunk's losses stay on the device until finish_step: a float() per microbatch
        # would make the host wait for the GPU after every last-chunk forward.
        self._losses_on_device: dict[int, torch.Tensor] = {}
        self._clock.start_step()
        self.cursor = 0
        self._nccl_posted_at = -1
        self._recvs_done = self._recvs_posted = 0
        self._prepost_receives()

    @property
    def finished(self) -> bool:
        return self.cursor >= len(self.actions)

    def next_ready(self) -> bool:
        """True if the next action can run now (a receive whose message has arrived, or any other)."""
        action, route = self.actions[self.cursor], self._routes[self.cursor]
        if not action.is_recv:
            return True
        if route.self_hop:
            return route.message_id in self._in_memory
        self._issue_nccl_groups(None)
        return self.transport.ready(route.peer, route.tag)

    def run_next(self) -> None:
        cursor = self.cursor
        action = self.actions[cursor]
        start = self._clock.mark()
        hooks = self.compute_hooks if action.is_compute else None
        if hooks is not None:
            hooks.before(action)
        if not self._issue_nccl_groups(action):
            self._HANDLERS[action.kind](self, action)
        if hooks is not None:
            hooks.after(action)
        self.record.events.append(ActionEvent(self.pp_rank, self._names[cursor], start, self._clock.mark(),
                                              self._categories[cursor]))
        self.cursor = cursor + 1

    def run_to_end(self) -> StepRecord:
        while not self.finished:
            self.run_next()
        return self.finish_step()

    def finish_step(self) -> StepRecord:
        start = self._clock.mark()
        self.transport.flush()
        self.record.events.append(ActionEvent(self.pp_rank, "flush", start, self._clock.mark(), "comm"))
        self._clock.resolve(self.record.events)
        if self._losses_on_device:  # one transfer for the whole step
            values = torch.stack(list(self._losses_on_device.values())).float().cpu().tolist()
            self.record.losses = dict(zip(self._losses_on_device, values, strict=True))
        leftover = sorted(self._contexts)
        if leftover:
            raise RuntimeError(f"rank {self.pp_rank}: forward contexts {leftover} never ran their backward")
        if self._weight_work:
            raise RuntimeError(f"rank {self.pp_rank}: (chunk, microbatch) {sorted(self._weight_work)} ran I "
                               "but never W")
        self.record.cache_peak_bytes = self.cache.peak_held_bytes
        self.record.activation_peak_bytes = self.memory.peak_bytes
        return self.record

    def _prepost_receives(self) -> None:
        """Keep posted the receive being run and the RECV_LOOKAHEAD receive actions after it."""
        if not self._prepost:
            return
        limit = min(len(self._recv_positions), self._recvs_done + RECV_LOOKAHEAD)
        while self._recvs_posted < limit:
            route = self._routes[self._recv_positions[self._recvs_posted]]
            self.transport.prepost_recv(route.shapes, self.dtype, route.peer, route.tag)
            self._recvs_posted += 1

    def _issue_nccl_groups(self, action: Action | None) -> bool:
        """Under NCCL rules, issue (once) the groups planned at the cursor: their receives, and the
        action's own send inside its group. True if `action` ran here."""
        if self._nccl_plan is None or self._nccl_posted_at == self.cursor:
            return False
        self._nccl_posted_at = self.cursor

        def prepost(planned: Action) -> None:
            route = self._route_of[planned]
            self.transport.prepost_recv(route.shapes, self.dtype, route.peer, route.tag)

        return issue_planned_groups(self.transport, self._nccl_plan[self.cursor], action, prepost,
                                    lambda a: self._HANDLERS[a.kind](self, a))

    # ---- handlers ----

    def _forward(self, action: Action) -> None:
        c, mb = action.chunk_index, action.microbatch_index
        io, chunk = self.plan.chunks[c], self.chunks[c]
        inputs = self._received.pop((c, mb), {})
        for source in io.cache_reads:
            inputs[source] = self.cache.read(mb, source)
        idx = self._inputs_by_mb[mb] if chunk.is_first else None
        targets = self._targets_by_mb[mb] if chunk.is_last else None
        with torch.no_grad() if self._forward_only else contextlib.nullcontext():
            produced, loss = chunk(inputs, idx, targets, meter=None if self._forward_only else self.memory)
        for source in io.cache_puts:
            self.cache.put(mb, source, produced.get(source, inputs.get(source)))
        for source in io.frees:
            self.cache.free(mb, source)
        if loss is not None:
            self._losses_on_device[mb] = loss.detach()
        if not self._forward_only:
            self._contexts[(c, mb)] = _ChunkContext(inputs, produced, loss)
        if not chunk.is_last:  # the hop's tensors (none on a self-hop that carries nothing)
            self._outbox[(c, mb)] = [produced.get(s, inputs.get(s)) for s in io.sent]

    def _backward(self, action: Action) -> None:
        """B: input and weight gradients in one pass."""
        ctx, outside, roots, root_grads = self._backward_roots(action)
        fused_backward(roots, root_grads)
        self._emit_input_grads(action, ctx, outside)

    def _backward_input(self, action: Action) -> None:
        """I: what B sends and deposits, and none of the parameters' gradients but the cheap ones."""
        ctx, outside, roots, root_grads = self._backward_roots(action)
        leaves = [t for t in ctx.inputs.values() if t.requires_grad]
        self._weight_work[(action.chunk_index, action.microbatch_index)] = backward_input(
            roots, root_grads, leaves, self._cuts, action.chunk_index)
        self._emit_input_grads(action, ctx, outside)

    def _backward_weight(self, action: Action) -> None:
        backward_weight(self._weight_work.pop((action.chunk_index, action.microbatch_index)))

    def _backward_roots(self, action: Action):
        """The chunk's context, its outside gradients (next hop and collected deposits) and the
        autograd roots with their gradients: the loss, and produced tensors with outside gradients."""
        c, mb = action.chunk_index, action.microbatch_index
        io, ctx = self.plan.chunks[c], self._contexts.pop((c, mb))
        sent_grads = self._out_grads.pop((c, mb), [])  # none for the last chunk, which sends nothing
        if len(sent_grads) != len(io.sent):
            raise RuntimeError(f"rank {self.pp_rank}: {action} got {len(sent_grads)} gradients back for the "
                               f"{len(io.sent)} tensors chunk {c} sent for microbatch {mb} (the plan and the "
                               "backward hop disagree)")
        outside: dict[Source, torch.Tensor] = dict(zip(io.sent, sent_grads, strict=True))
        for source in io.cache_puts:
            deposit = self.cache.collect(mb, source)
            if deposit is not None:
                outside[source] = deposit if source not in outside else outside[source] + deposit
        roots, root_grads = [], []
        if ctx.loss is not None:
            roots.append(ctx.loss * self._loss_scale)
            root_grads.append(torch.ones_like(ctx.loss))
        for source, grad in outside.items():
            if source in ctx.produced:
                roots.append(ctx.produced[source])
                root_grads.append(grad)
        return ctx, outside, roots, root_grads

    def _emit_input_grads(self, action: Action, ctx: _ChunkContext, outside: dict[Source, torch.Tensor]) -> None:
        """The backward hop's gradients and the deposits of the cache reads' gradients."""
        c, mb = action.chunk_index, action.microbatch_index
        io = self.plan.chunks[c]

        def input_grad(source: Source) -> torch.Tensor | None:
            grad = ctx.inputs[source].grad
            extra = outside.get(source) if source not in ctx.produced else None
            if extra is not None:
                grad = extra if grad is None else grad + extra
            return grad

        if c > 0:  # the backward hop's gradients (none on a self-hop that carried nothing)
            self._in_grads[(c, mb)] = [
                g if (g := input_grad(s)) is not None else torch.zeros_like(ctx.inputs[s]) for s in io.received
            ]
        for source in io.cache_reads:
            grad = input_grad(source)
            if grad is not None:
                self.cache.deposit(mb, source, grad)
        if c == self.first_chunk:
            self.cache.check_drained(mb)

    def _send_forward(self, action: Action) -> None:
        self._send(self._outbox.pop((action.chunk_index, action.microbatch_index)))

    def _recv_forward(self, action: Action) -> None:
        # Fresh leaves: over the wire they are new buffers (or message slots); in memory, new views.
        self._received[(action.chunk_index, action.microbatch_index)] = {
            s: t.detach().requires_grad_(True)
            for s, t in zip(self.plan.chunks[action.chunk_index].received, self._receive(), strict=True)}

    def _send_backward(self, action: Action) -> None:
        self._send(self._in_grads.pop((action.chunk_index, action.microbatch_index)))

    def _recv_backward(self, action: Action) -> None:
        self._out_grads[(action.chunk_index, action.microbatch_index)] = self._receive()

    def _send(self, tensors: list[torch.Tensor]) -> None:
        route = self._routes[self.cursor]
        if route.self_hop:
            self._in_memory[route.message_id] = [t.detach() for t in tensors]
        else:
            self.transport.send(tensors, route.peer, route.tag, route.label)

    def _receive(self) -> list[torch.Tensor]:
        route = self._routes[self.cursor]
        if route.self_hop:
            try:
                return self._in_memory.pop(route.message_id)
            except KeyError:
                action = self.actions[self.cursor]
                raise RuntimeError(f"rank {self.pp_rank}: {action} runs before its self-hop send "
                                   f"{action.matching()} (the schedule orders them wrongly)") from None
        self._recvs_done += 1
        if self._prepost:  # before waiting: the next receives are posted while this one waits
            self._prepost_receives()
        return self.transport.recv(route.shapes, self.dtype, route.peer, route.tag)

    _HANDLERS = {
        ActionKind.F: _forward,
        ActionKind.B: _backward,
        ActionKind.I: _backward_input,
        ActionKind.W: _backward_weight,
        ActionKind.SEND_F: _send_forward,
        ActionKind.RECV_F: _recv_forward,
        ActionKind.SEND_B: _send_backward,
        ActionKind.RECV_B: _recv_backward,
    }
