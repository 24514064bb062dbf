"""ShardSaves: one rank's part of a checkpoint, written at once or in the background and read back,
for the rank workers (`StageWorker`; a one-process run is rank 0 alone). A host provides `model`,
`params` (by whole-model name), `optimizer`, `rng_stream`, `rank`, `distributed` (in a
torch.distributed group), `peers` (the thread ranks of this process, or None) and `timeout_s`
(bounding a background write); `background_save` starts None.
Under expert parallelism also `collectives` (whose "ep" axis gathers the expert slices whole)."""

from __future__ import annotations

import sys

from torch.distributed.checkpoint.api import CheckpointException

from attnres_pp.pipeline.expert_parallel import expert_parallel_size, expert_rows
from attnres_pp.train.background_save import BackgroundSave, save_failure, state_bytes
from attnres_pp.train.expert_shards import expert_targets, whole_expert_state
from attnres_pp.train.faults import rehearse_rank_kill
from attnres_pp.train.shards import load_shard, save_shard, shard_state
from attnres_pp.train.tp_rank import whole_dtensors


class ShardSaves:
    background_save: BackgroundSave | None = None
    distributed = False
    peers = None
    rank = 0
    # The ranks' first start (StageWorker sets it; a restarted rank does not): the after-shard kill of
    # ATTNRES_PP_KILL_DURING_CHECKPOINT acts then only, as a real crash does not come back with the rank.
    rehearse = True

    def _shard_state(self) -> dict:
        """What this rank saves (`shards.shard_state`), its expert slices made whole (`expert_shards`)."""
        state = shard_state(self.model, self.params, self.optimizer, self.rng_stream)
        rows = expert_rows(self.model)
        if rows:
            state = whole_expert_state(state, rows, self.collectives, expert_parallel_size(self.model))
        return state

    def save_shard(self, step_dir: str) -> None:
        """Write this rank's part of checkpoint `step_dir` (DCP; every rank calls this together).
        Thread ranks hand their states to rank 0, which writes them as one (replicas' equal copies once).
        The files are fsynced before this returns (`save_shard`), so a rank reports done only once
        its part is on disk. A write the disk refuses raises StorageFault; any other failure, DCP's
        CheckpointException (a BaseException) included, a RuntimeError: a rank reports it, never dies of it."""
        state = self._shard_state()
        try:
            if self.peers is None:
                save_shard(step_dir, state, distributed=self.distributed)
            else:
                states = self.peers.gather(self.rank, whole_dtensors(state))
                if states is not None:
                    state = {key: value for rank_state in states for key, value in rank_state.items()}
                    save_shard(step_dir, state, distributed=False)
        except (Exception, CheckpointException) as error:
            raise save_failure(step_dir, error, needed_bytes=state_bytes(state)) from error
        if self.rehearse:
            rehearse_rank_kill(step_dir, self.rank)

    def begin_save(self, step_dir: str) -> float:
        """`save_shard` in the background (`--async-checkpoint`, `train.background_save`): returns once
        this rank's state is copied, with the seconds it blocked. Thread ranks hand their states to
        rank 0, whose write carries them all."""
        if self.background_save is None:
            self.background_save = BackgroundSave(self.timeout_s)
        state = self._shard_state()
        if self.peers is not None:
            states = self.peers.gather(self.rank, whole_dtensors(state))
            if states is None:
                return 0.0
            state = {key: value for rank_state in states for key, value in rank_state.items()}
        return self.background_save.begin(step_dir, state, distributed=self.distributed and self.peers is None,
                                          on_written=lambda: self.rehearse and rehearse_rank_kill(step_dir, self.rank))

    def save_written(self) -> bool:
        """Whether this rank has no checkpoint write in flight."""
        return self.background_save is None or self.background_save.written()

    def finish_save(self) -> None:
        """Wait for this rank's checkpoint write in flight (bounded; a failed write raises)."""
        if self.background_save is not None:
            self.background_save.wait()

    def load_shard(self, step_dir: str) -> str | None:
        """Load this rank's parameters, optimizer state and RNG state from checkpoint `step_dir`, whatever
        split wrote it (every rank calls this together). The RNG state is its stream's (`rng_stream`):
        where the checkpoint has none, this rank keeps its own and says so on stderr (and returns it)."""
        rows = expert_rows(self.model)
        layout = expert_targets(rows, self.model.cfg.moe_experts, getattr(self, "collectives", None)) if rows else None
        note = load_shard(step_dir, self.model, self.params, self.optimizer, self.rng_stream,
                          distributed=self.distributed, layout_targets=layout)
        if note is not None:
            print(f"note: rank {self.rank}: {note}", file=sys.stderr, flush=True)
        return note
