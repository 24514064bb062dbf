"""The stage runtime of training and pipelined evaluation: a rank's compute actions against its
chunks, run by the one action executor (`pipeline.executor`, which owns the cursor, the messages,
self-hops, the block cache and how messages are issued), and a timestamp for every action.

Dispatch on action kind (docs/architecture.md rule 3). What each hop carries comes from the payload plan alone.
Gradient bookkeeping per chunk and microbatch, in the backward (B, or I, which does all of this,
then W, which adds the parameters' gradients later; see `split_backward`):
- a tensor this chunk *produced* gets its outside gradient (from the next hop and/or from cache
  deposits) as an autograd root;
- a tensor that came *in* (over the wire or from the cache) is an autograd leaf; its gradient is
  the leaf's own plus any outside gradient for it (it was forwarded or cached), and goes back over
  the wire (received) or into the cache as a deposit (cache read).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from attnres_pp.comm.plan import PayloadPlan, Source
from attnres_pp.comm.transport_protocol import Transport
from attnres_pp.model.moe import set_aux_scale
from attnres_pp.pipeline.chunk import PipelineChunk
from attnres_pp.pipeline.clock import make_clock
from attnres_pp.pipeline.executor import ActionExecutor, ExecutorView
from attnres_pp.pipeline.graph_cut import CutCache
from attnres_pp.pipeline.memory_meter import ActivationMeter, storage_key
from attnres_pp.pipeline.meter_steps import MeterSteps, batch_signature, figures_can_change
from attnres_pp.pipeline.routes import hop_shapes, message_tag
from attnres_pp.pipeline.split_backward import WeightWork, backward_input, backward_weight, fused_backward
from attnres_pp.pipeline.weight_store import WeightStore, drain_weight_store, stash_backward_input
from attnres_pp.schedule.ir import Action, ActionKind, Schedule


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


__all__ = ["ActionEvent", "StageRuntime", "StepRecord", "message_tag"]


class StageRuntime(ExecutorView):
    """Rank `pp_rank` of a pipelined training run (or of its forward-only evaluation): `start_step`,
    then `run_next` until `finished` (or `run_to_end`), then `finish_step` for the step's record."""

    def __init__(self, *, pp_rank: int, chunks: dict[int, PipelineChunk], plan: PayloadPlan, schedule: Schedule,
                 transport: Transport, microbatch_shape: tuple[int, int], source_width: int, residual_width: int,
                 dtype: torch.dtype = torch.float32, clock=None, compute_hooks=None) -> None:
        self.pp_rank = pp_rank
        self.chunks = chunks
        self.plan = plan
        self.schedule = schedule
        self.dtype = dtype  # of hops: the activation dtype (bf16 under bf16 autocast)
        self.shape_of = hop_shapes(microbatch_shape, source_width, residual_width)
        device = next((p.device for chunk in chunks.values() for p in chunk.parameters()), torch.device("cpu"))
        self._clock = clock or make_clock(device)  # CUDA events on a GPU, perf_counter on CPU
        self.first_chunk = min(chunks)
        self.memory = ActivationMeter()  # what the forwards save for backward (docs/spec.md section 8)
        # A transport whose received tensors are views of one arena per peer (shared memory) names
        # its message slots, so that a kept view counts its message alone (`memory_meter`).
        self.memory.set_slots({storage_key(arena): ranges for arena, ranges in transport.message_slots()})
        # The meter runs while the step's figure can change (`meter_steps`): every step where routing
        # or a meter-read decision moves it, else the first steps of each batch shape.
        has_weight_actions = any(a.kind == ActionKind.W for actions in schedule.rank_actions for a in actions)
        self._meter_steps = MeterSteps(every_step=figures_can_change(chunks.values(), has_weight_actions) is not None)
        self._metered = False  # whether the step in progress runs the meter
        # Called around every compute action (`before(action)`, `after(action)`): FSDP2's unshard and
        # reshard of the action's chunk (`train.fsdp`); None: nothing to do.
        self.compute_hooks = compute_hooks
        self._cuts = CutCache()  # each chunk's graph has the same I/W cut for every microbatch
        self.executor = ActionExecutor(pp_rank=pp_rank, plan=plan, transport=transport, dtype=dtype,
                                       compute=self._compute)
        # The routes are fixed for the run: a message costs lookups, not re-derivations.
        self.executor.load(schedule, lambda _microbatch, source: self.shape_of(source))
        self._names = [str(a) for a in self.actions]
        self._categories = ["compute" if a.is_compute else "comm" for a in self.actions]

    # ---- one step ----
    def start_step(self, inputs_by_mb: list[torch.Tensor] | None, targets_by_mb: list[torch.Tensor] | None,
                   loss_scale: float, *, forward_only: bool = False) -> None:
        """`forward_only`: for a schedule of F actions and their hops alone (evaluation): forwards run
        without autograd and keep no context for a backward."""
        self._inputs_by_mb, self._targets_by_mb, self._loss_scale = inputs_by_mb, targets_by_mb, loss_scale
        self._forward_only = forward_only
        for chunk in self.chunks.values():  # an MoE aux loss counts in the objective as the loss does
            set_aux_scale(chunk, loss_scale)
        self._contexts: dict[tuple[int, int], _ChunkContext] = {}
        self._weight_work: dict[tuple[int, int], WeightWork | WeightStore] = {}  # I done, W to come
        # `start` on every training step (it follows the batch's shape), before the slow twin's flag.
        self._metered = not forward_only and (self._meter_steps.start(batch_signature(inputs_by_mb, targets_by_mb))
                                              or self.meter_every_step)
        if self._metered:
            self.memory.set_excluded(p for chunk in self.chunks.values() for p in chunk.parameters())
            self.memory.reset_peak()
        self.record = StepRecord()
        # The last chunk's losses stay on the device until finish_step: a float() per microbatch
        # would make the host wait for the GPU after every last-chunk forward.
        self._losses_on_device: dict[int, torch.Tensor] = {}
        self._clock.start_step()
        self.executor.start()

    @property
    def finished(self) -> bool:
        return self.executor.finished

    def next_ready(self) -> bool:
        """True if the next action can run now (a receive whose message has arrived, or any other)."""
        return self.executor.next_ready()

    def run_next(self) -> None:
        executor = self.executor
        cursor = executor.cursor
        action = executor.actions[cursor]
        start = self._clock.mark()
        hooks = self.compute_hooks if action.is_compute else None
        if hooks is not None:
            hooks.before(action)
        executor.run_next()
        if hooks is not None:
            hooks.after(action)
        self.record.events.append(ActionEvent(self.pp_rank, self._names[cursor], start, self._clock.mark(),
                                              self._categories[cursor]))

    def run_to_end(self) -> StepRecord:
        while not self.finished:
            self.run_next()
        return self.finish_step()

    def finish_step(self) -> StepRecord:
        start = self._clock.mark()
        self.executor.flush()
        self.record.events.append(ActionEvent(self.pp_rank, "flush", start, self._clock.mark(), "comm"))
        self._clock.resolve(self.record.events)
        if self._losses_on_device:  # one transfer for the whole step
            # double: Python's float, so a float64 model's losses are not rounded to fp32 on the way
            values = torch.stack(list(self._losses_on_device.values())).double().cpu().tolist()
            self.record.losses = dict(zip(self._losses_on_device, values, strict=True))
        leftover = sorted(self._contexts)
        if leftover:
            raise RuntimeError(f"rank {self.pp_rank}: forward contexts {leftover} never ran their backward")
        if self._weight_work:
            raise RuntimeError(f"rank {self.pp_rank}: (chunk, microbatch) {sorted(self._weight_work)} ran I "
                               "but never W")
        self.record.cache_peak_bytes = self.cache.peak_held_bytes
        if not self._forward_only:  # an unmetered step reports the metered steps' figure
            self.record.activation_peak_bytes = self._meter_steps.finish(
                self.memory.peak_bytes if self._metered else None)
        return self.record

    # ---- compute handlers (the executor runs the communication actions) ----
    def _compute(self, action: Action) -> None:
        self._HANDLERS[action.kind](self, action)

    def _forward(self, action: Action) -> None:
        c, mb = action.chunk_index, action.microbatch_index
        chunk = self.chunks[c]
        inputs = self.executor.forward_inputs(action)
        idx = self._inputs_by_mb[mb] if chunk.is_first else None
        targets = self._targets_by_mb[mb] if chunk.is_last else None
        with torch.no_grad() if self._forward_only else contextlib.nullcontext():
            produced, loss = chunk(inputs, idx, targets, meter=self.memory if self._metered else None)
        self.executor.forward_outputs(action, inputs, produced)
        if loss is not None:
            self._losses_on_device[mb] = loss.detach()
        if not self._forward_only:
            self._contexts[(c, mb)] = _ChunkContext(inputs, produced, loss)

    def _backward(self, action: Action) -> None:
        """B: input and weight gradients in one pass."""
        ctx, outside, roots, root_grads = self._backward_roots(action)
        fused_backward(roots, root_grads)
        self._emit_input_grads(action, ctx, outside)

    # False: I frees the chunk's graph and leaves W a weight store (`weight_store`: the same gradients,
    # a fraction of the memory between I and W; `simulator.memory` predicts it). True: I keeps the
    # whole graph for W (`split_backward`), the slow twin the store is tested against.
    split_retains_graph = False
    # True: the meter runs on every step (the slow twin `meter_steps`' figures are tested against);
    # False: on the steps whose figure can differ from the last metered one (`meter_steps`).
    meter_every_step = False

    def _backward_input(self, action: Action) -> None:
        """I: what B sends and deposits, and none of the parameters' gradients but the cheap ones."""
        ctx, outside, roots, root_grads = self._backward_roots(action)
        leaves = [t for t in ctx.inputs.values() if t.requires_grad]
        if self.split_retains_graph:
            work = backward_input(roots, root_grads, leaves, self._cuts, action.chunk_index)
        else:
            work = stash_backward_input(roots, root_grads, leaves, self._cuts, action.chunk_index,
                                        self.memory if self._metered else None)
        self._weight_work[(action.chunk_index, action.microbatch_index)] = work
        self._emit_input_grads(action, ctx, outside)

    def _backward_weight(self, action: Action) -> None:
        work = self._weight_work.pop((action.chunk_index, action.microbatch_index))
        if isinstance(work, WeightStore):
            drain_weight_store(work)
        else:
            backward_weight(work)

    def _backward_roots(self, action: Action):
        """The chunk's context, its outside gradients (next hop and collected deposits) and the
        autograd roots with their gradients: the loss, and produced tensors with outside gradients."""
        c, mb = action.chunk_index, action.microbatch_index
        io, ctx = self.plan.chunks[c], self._contexts.pop((c, mb))
        sent_grads = self.executor.grads_back.pop((c, mb), [])  # none for the last chunk, which sends nothing
        if len(sent_grads) != len(io.sent):
            raise RuntimeError(f"rank {self.pp_rank}: {action} got {len(sent_grads)} gradients back for the "
                               f"{len(io.sent)} tensors chunk {c} sent for microbatch {mb} (the plan and the "
                               "backward hop disagree)")
        outside: dict[Source, torch.Tensor] = dict(zip(io.sent, sent_grads, strict=True))
        cache_id = self.executor.cache_id(action)
        for source in io.cache_puts:
            deposit = self.cache.collect(cache_id, source)
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
            self.executor.grads_out[(c, mb)] = [
                g if (g := input_grad(s)) is not None else torch.zeros_like(ctx.inputs[s]) for s in io.received
            ]
        cache_id = self.executor.cache_id(action)
        for source in io.cache_reads:
            grad = input_grad(source)
            if grad is not None:
                self.cache.deposit(cache_id, source, grad)
        if c == self.first_chunk:
            self.cache.check_drained(cache_id)

    _HANDLERS = {
        ActionKind.F: _forward,
        ActionKind.B: _backward,
        ActionKind.I: _backward_input,
        ActionKind.W: _backward_weight,
    }
