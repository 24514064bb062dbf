"""The forward-only runtime of generation (docs/spec.md section 7): one rank's passes of incremental decoding.

A pass (the prompt's prefill pieces, or one new token) runs the rank's lowered forward-only schedule
(`forward_schedule.generation_schedule`) through the one action executor (`pipeline.executor`), over
the same chunks, payload plan, per-rank block cache and transports as training: each hop carries
what the plan says for the pass's tokens (cached mode: the open partial plus only the blocks the
receiving rank does not hold), later chunks on a rank read the rest from its cache, and self-hops
are handed over in memory. Between passes the rank keeps its `DecodeState`: the key/value caches of
its own layers and, under MSAR, the history of the sources it reads.

It is not `StageRuntime` because a pass differs from a training step in what it keeps and in shape:
no autograd, no backward and no loss, state that outlives the pass, and a token count that changes
from pass to pass (so hop shapes come from the pass's pieces, not from a fixed microbatch shape).
Message tags number the pieces of a whole session (the executor's `first_id`: a running piece id),
so no tag is reused while a rank lives. Under gloo every receive of a pass is posted at its start;
under NCCL's rules they go out in the lockstep plan's groups (see the executor).
"""

from __future__ import annotations

import torch

from attnres_pp.comm.plan import PayloadPlan
from attnres_pp.comm.transport_protocol import Transport
from attnres_pp.model.decode_state import DecodeState
from attnres_pp.pipeline.chunk import PipelineChunk
from attnres_pp.pipeline.executor import ActionExecutor, ExecutorView
from attnres_pp.pipeline.loopback import run_in_turns
from attnres_pp.pipeline.routes import hop_shapes
from attnres_pp.schedule.forward_schedule import generation_schedule
from attnres_pp.schedule.ir import Action


class GenerationRuntime(ExecutorView):
    """Rank `pp_rank` of a generation pipeline. `start_pass` / `run_next` / `finish_pass`, or
    `run_pass` at once; `reset` starts a new batch of sequences (empty caches). `window`: the
    key/value cache's attention window (`DecodeState`)."""

    def __init__(self, *, pp_rank: int, chunks: dict[int, PipelineChunk], plan: PayloadPlan, transport: Transport,
                 dtype: torch.dtype = torch.float32, window: int | None = None) -> None:
        self.pp_rank = pp_rank
        self.window = window  # the decode state's attention window (None: the trained seq_len)
        self.chunks = chunks
        self.plan = plan
        self.dtype = dtype
        self.cfg = next(iter(chunks.values())).cfg
        self.partition = plan.partition
        self.executor = ActionExecutor(pp_rank=pp_rank, plan=plan, transport=transport, dtype=dtype,
                                       compute=self._forward, recv_lookahead=None, recv_leaves=False)
        self._next_piece_id = 0  # running piece count: message tags are never reused
        self.reset()

    def reset(self) -> None:
        """Forget every earlier token: the next pass starts a new batch of sequences at position 0."""
        self.decode_state = DecodeState(self.cfg, window=self.window)

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
        self._pieces, self._tokens, self._all_logits = pieces, tokens_by_piece, all_logits
        self._logits: list[torch.Tensor] = []
        shape_of = [hop_shapes((batch_size, n_tokens), self.cfg.source_width, self.cfg.d_model)
                    for _start, n_tokens in pieces]
        self.executor.load(self.schedule, lambda piece, source: shape_of[piece](source),
                           first_id=self._next_piece_id)
        self._next_piece_id += len(pieces)
        self.executor.start()

    @property
    def finished(self) -> bool:
        return self.executor.finished

    def next_ready(self) -> bool:
        """True if the next action can run now (a receive only once its message is there)."""
        return self.executor.next_ready()

    def run_next(self) -> None:
        with torch.no_grad():
            self.executor.run_next()

    def finish_pass(self) -> torch.Tensor | None:
        """Wait for this pass's sends; the logits if this rank runs the last chunk, else None."""
        self.executor.flush()
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

    # ---- the compute action (the executor runs the hops) ----
    def _forward(self, action: Action) -> None:
        start, n_tokens = self._pieces[action.microbatch_index]
        chunk = self.chunks[action.chunk_index]
        inputs = self.executor.forward_inputs(action)
        idx_BT = self._tokens[action.microbatch_index] if chunk.is_first else None
        produced, logits = chunk.run(inputs, idx_BT, self.decode_state.step(start, n_tokens))
        self.executor.forward_outputs(action, inputs, produced)
        if logits is not None:
            self._logits.append(logits if self._all_logits else logits[:, -1])


def run_loopback_pass(runtimes: list[GenerationRuntime], batch_size: int, pieces: list[tuple[int, int]],
                      tokens_by_piece: list[torch.Tensor], all_logits: bool = False) -> torch.Tensor:
    """One pass through every rank in this process (loopback transport); returns the logits."""
    last_rank = runtimes[0].partition.rank_of(runtimes[0].partition.n_chunks - 1)
    for runtime in runtimes:
        runtime.start_pass(batch_size, pieces, tokens_by_piece if runtime.pp_rank == 0 else None, all_logits)
    run_in_turns(runtimes, "generation pass")
    results = [runtime.finish_pass() for runtime in runtimes]
    return results[last_rank]
