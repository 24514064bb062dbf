"""The forward-only runtime of generation (docs/spec.md section 7): one rank's passes of incremental decoding.

A pass (the prompt's prefill pieces, or one new token) runs the rank's lowered forward-only schedule
(`forward_schedule`) as a dispatch on action kind, over the same chunks, payload plan, per-rank block
cache and transports as training: each hop carries what the plan says for the pass's tokens (cached
mode: the open partial plus only the blocks the receiving rank does not hold), later chunks on a
rank read the rest from its cache, and self-hops are handed over in memory. Between passes the rank
keeps its `DecodeState`: the key/value caches of its own layers and, under MSAR, the history of
the sources it reads.

It is not `StageRuntime` because a pass differs from a training step in what it keeps and in shape:
no autograd, no backward and no loss, state that outlives the pass, and a token count that changes
from pass to pass (so receive shapes come from the pass, not from a fixed microbatch shape).

Message tags number the pieces of a whole session (`message_tag` of the training runtime with a
running piece id), so no tag is reused while a rank lives. How messages are issued depends on the
transport's point-to-point rules (docs/spec.md section 5):
- gloo (tags match, sends are buffered): every receive of a pass is posted before its first action,
  so the sender's isend writes at once (see comm.transport);
- nccl (issue order matches, sends wait for their receive): the sends and receives go out in the
  groups of `validate_nccl.lockstep_plan` for the pass's schedule, one `batch_isend_irecv` each,
  the order `forward_schedule.generation_schedule` proves deadlock-free with `check_nccl`. Posting
  every receive up front would deadlock there at V >= 2.
"""

from __future__ import annotations

import torch

from attnres_pp.comm.cache import BlockCache
from attnres_pp.comm.plan import RESIDUAL, PayloadPlan, Source
from attnres_pp.model.decode_state import DecodeState
from attnres_pp.pipeline.chunk import PipelineChunk
from attnres_pp.pipeline.loopback import run_in_turns
from attnres_pp.pipeline.runtime import issue_planned_groups, message_tag
from attnres_pp.schedule.forward_schedule import generation_schedule
from attnres_pp.schedule.ir import Action, ActionKind
from attnres_pp.schedule.validate_nccl import lockstep_plan


class GenerationRuntime:
    """Rank `pp_rank` of a generation pipeline. `start_pass` / `run_next` / `finish_pass`, or
    `run_pass` at once; `reset` starts a new batch of sequences (empty caches)."""

    def __init__(self, *, pp_rank: int, chunks: dict[int, PipelineChunk], plan: PayloadPlan, transport,
                 dtype: torch.dtype = torch.float32) -> None:
        self.pp_rank = pp_rank
        self.chunks = chunks
        self.plan = plan
        self.transport = transport
        self.dtype = dtype
        self.cfg = next(iter(chunks.values())).cfg
        self.partition = plan.partition
        self._prepost = getattr(transport, "can_prepost", False)
        self._nccl = getattr(transport, "p2p_semantics", "gloo") == "nccl"
        self._next_piece_id = 0  # running piece count: message tags are never reused
        self.reset()

    def reset(self) -> None:
        """Forget every earlier token: the next pass starts a new batch of sequences at position 0."""
        self.decode_state = DecodeState(self.cfg)

    def keep_rows(self, rows: list[int]) -> None:
        """Keep only the sequences at batch indices `rows` (the others are done)."""
        self.decode_state.keep_rows(rows)

    # ---- one pass ----
    def start_pass(self, batch_size: int, pieces: list[tuple[int, int]],
                   tokens_by_piece: list[torch.Tensor] | None, all_logits: bool = False) -> None:
        """pieces: (start position, tokens) of each piece, in order; tokens_by_piece: `[B, n]` ids of
        each piece (chunk 0's rank only). The last chunk's rank returns the logits of the pass's last
        position `[B, V]` (or, with `all_logits`, of every position `[B, T, V]`)."""
        self.schedule = generation_schedule(self.partition.n_stages, self.partition.n_virtual, len(pieces))
        self.actions = self.schedule.rank_actions[self.pp_rank]
        self._batch, self._pieces, self._tokens, self._all_logits = batch_size, pieces, tokens_by_piece, all_logits
        self._first_piece_id = self._next_piece_id
        self._next_piece_id += len(pieces)
        self._received: dict[tuple[int, int], dict[Source, torch.Tensor]] = {}
        self._outbox: dict[tuple[int, int], list[torch.Tensor]] = {}
        self._in_memory: dict[tuple[str, int, int], list[torch.Tensor]] = {}
        self._logits: list[torch.Tensor] = []
        self.cache = BlockCache()
        self.cursor = 0
        self._nccl_plan = lockstep_plan(self.schedule)[self.pp_rank] if self._nccl else None
        self._nccl_posted_at = -1
        if self._prepost and not self._nccl:
            for action in self.actions:
                if action.is_recv and not self._is_self_hop(action):
                    self.transport.prepost_recv(self._recv_shapes(action), self.dtype, self.schedule.peer(action),
                                                self._tag(action))

    @property
    def finished(self) -> bool:
        return self.cursor >= len(self.actions)

    def next_ready(self) -> bool:
        """True if the next action can run now (a receive only once its message is there)."""
        action = self.actions[self.cursor]
        if not action.is_recv:
            return True
        if self._is_self_hop(action):
            return self._message_id(action) in self._in_memory
        self._issue_nccl_groups(None)
        return self.transport.ready(self.schedule.peer(action), self._tag(action))

    def run_next(self) -> None:
        action = self.actions[self.cursor]
        with torch.no_grad():
            if not self._issue_nccl_groups(action):
                self._HANDLERS[action.kind](self, action)
        self.cursor += 1

    def _issue_nccl_groups(self, action: Action | None) -> bool:
        """Under NCCL's rules, issue (once per position) the groups the plan places at the cursor:
        their receives, and `action`'s own send inside its group. True if `action` ran here."""
        if self._nccl_plan is None or self._nccl_posted_at == self.cursor:
            return False
        self._nccl_posted_at = self.cursor

        def prepost(planned: Action) -> None:
            self.transport.prepost_recv(self._recv_shapes(planned), self.dtype, self.schedule.peer(planned),
                                        self._tag(planned))

        return issue_planned_groups(self.transport, self._nccl_plan[self.cursor], action, prepost,
                                    lambda a: self._HANDLERS[a.kind](self, a))

    def finish_pass(self) -> torch.Tensor | None:
        """Wait for this pass's sends; the logits if this rank runs the last chunk, else None."""
        self.transport.flush()
        if len(self.cache):
            raise RuntimeError(f"rank {self.pp_rank}: {len(self.cache)} cache entries outlived the pass "
                               "(the payload plan's frees and the cache disagree)")
        if not self._logits:
            return None
        return torch.cat(self._logits, dim=1) if self._all_logits else self._logits[-1]

    def run_pass(self, batch_size: int, pieces: list[tuple[int, int]],
                 tokens_by_piece: list[torch.Tensor] | None, all_logits: bool = False) -> torch.Tensor | None:
        self.start_pass(batch_size, pieces, tokens_by_piece, all_logits)
        while not self.finished:
            self.run_next()
        return self.finish_pass()

    # ---- handlers ----
    def _piece_id(self, action: Action) -> int:
        return self._first_piece_id + action.microbatch_index

    def _message_id(self, action: Action) -> tuple[str, int, int]:
        direction, chunk_index, _piece = action.message_id
        return direction, chunk_index, self._piece_id(action)

    def _tag(self, action: Action) -> int:
        return message_tag(self._message_id(action), self.partition.n_chunks)

    def _is_self_hop(self, action: Action) -> bool:
        return self.schedule.peer(action) == self.pp_rank

    def _recv_shapes(self, action: Action) -> list[torch.Size]:
        n_tokens = self._pieces[action.microbatch_index][1]
        width = {True: self.cfg.d_model, False: self.cfg.source_width}
        return [torch.Size((self._batch, n_tokens, width[s == RESIDUAL]))
                for s in self.plan.chunks[action.chunk_index].received]

    def _forward(self, action: Action) -> None:
        c, k = action.chunk_index, action.microbatch_index
        piece_id, (start, n_tokens) = self._piece_id(action), self._pieces[k]
        io, chunk = self.plan.chunks[c], self.chunks[c]
        inputs = self._received.pop((c, k), {})
        for source in io.cache_reads:
            inputs[source] = self.cache.read(piece_id, source)
        idx_BT = self._tokens[k] if chunk.is_first else None
        produced, logits = chunk.run(inputs, idx_BT, self.decode_state.step(start, n_tokens))
        for source in io.cache_puts:
            self.cache.put(piece_id, source, produced.get(source, inputs.get(source)))
        for source in io.frees:
            self.cache.free(piece_id, source)
        if logits is not None:
            self._logits.append(logits if self._all_logits else logits[:, -1])
        else:
            self._outbox[(c, k)] = [produced.get(s, inputs.get(s)) for s in io.sent]

    def _send_forward(self, action: Action) -> None:
        tensors = self._outbox.pop((action.chunk_index, action.microbatch_index))
        if self._is_self_hop(action):
            self._in_memory[self._message_id(action)] = tensors
        else:
            self.transport.send(tensors, self.schedule.peer(action), self._tag(action),
                                ("fwd", action.chunk_index, self._piece_id(action)))

    def _recv_forward(self, action: Action) -> None:
        if self._is_self_hop(action):
            tensors = self._in_memory.pop(self._message_id(action))
        else:
            tensors = self.transport.recv(self._recv_shapes(action), self.dtype, self.schedule.peer(action),
                                          self._tag(action))
        sources = self.plan.chunks[action.chunk_index].received
        self._received[(action.chunk_index, action.microbatch_index)] = dict(zip(sources, tensors, strict=True))

    _HANDLERS = {
        ActionKind.F: _forward,
        ActionKind.SEND_F: _send_forward,
        ActionKind.RECV_F: _recv_forward,
    }


def run_loopback_pass(runtimes: list[GenerationRuntime], batch_size: int, pieces: list[tuple[int, int]],
                      tokens_by_piece: list[torch.Tensor], all_logits: bool = False) -> torch.Tensor:
    """One pass through every rank in this process (loopback transport); returns the logits."""
    last_rank = runtimes[0].partition.rank_of(runtimes[0].partition.n_chunks - 1)
    for runtime in runtimes:
        runtime.start_pass(batch_size, pieces, tokens_by_piece if runtime.pp_rank == 0 else None, all_logits)
    run_in_turns(runtimes, "generation pass")
    results = [runtime.finish_pass() for runtime in runtimes]
    return results[last_rank]
