"""What the training loop needs to survive a lost worker: the error an engine raises when a rank's
process or actor is gone, the error that ends a run past `--max-restarts`, and the run's records
(`RunHistory`), which a checkpoint saves and a restart rewinds.

An engine that can recover has `restart_workers()`: it tears down every rank and the process
group and starts fresh ones from the seed (without any injected failure); the loop then loads the
last checkpoint into them. A rank that hangs (`launch.rank_group.RankHung`, a WorkerLost) is killed
by its rank group and restarted the same way. Start-up is part of the run: a rank lost while the
engine starts its ranks makes `start_engine` start them again, counted against `--max-restarts`.
Batches and the learning rate are functions of the step, so rewinding the records to the
checkpoint's step is all the data-side state there is; the tokens each step trained on are
recorded too, since `--batch-size` may change at a resume.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from attnres_pp.launch.storage_fault import StorageFault, mount_point
from attnres_pp.model.config import ModelConfig
from attnres_pp.pipeline.errors import WorkerLost
from attnres_pp.train.config import TrainConfig

__all__ = ["RunFailed", "RunHistory", "RunStopped", "WorkerLost", "describe_rank", "first_line", "start_engine"]
# WorkerLost: pipeline.errors


class RunFailed(RuntimeError):
    """Training stopped for good: a worker was lost and no restart is left (or possible)."""


class RunStopped(RuntimeError):
    """Training stopped for a cause the operator must remove (a full disk, an unwritable folder): no
    restart would help, so none is tried. The message is one line naming the cause, the fix and what
    stays resumable; the CLI prints it as `error:` with exit code 2."""


def storage_stop(fault: StorageFault, writing: str, out_dir: Path, last_checkpoint: Path | None) -> RunStopped:
    """The one line for a run whose write of `writing` (e.g. "checkpoint DIR/checkpoints/step_10")
    failed with `fault`: the cause and the disk (the one of the path that failed, else the run
    directory's), the fix, and the last complete checkpoint."""
    if last_checkpoint is not None:
        resumable = (f"the last complete checkpoint {last_checkpoint.name} stays resumable "
                     f"(attnres-pp train --resume {out_dir})")
    else:
        resumable = "no checkpoint is complete yet, so a new run starts from step 0"
    return RunStopped(f"{fault.reason} writing {writing} (the filesystem at {mount_point(fault.path or out_dir)}): "
                      f"{fault.fix} or give another --out; {resumable}")


def describe_rank(pp_rank: int) -> str:
    return f"rank {pp_rank}" if pp_rank >= 0 else "a stage worker"


def first_line(error: BaseException) -> str:
    """An error's first line: what a rank's report says before the traceback it may carry."""
    return (str(error).splitlines() or [""])[0]


def start_engine(make: Callable[[bool], object], *, max_restarts: int, restarts_done: int, can_restart: bool,
                 say) -> tuple[object, int]:
    """`make(first)`, an engine whose ranks start (`first`: their first start, when rehearsal hooks
    may act), made again while a rank is lost as they start (WorkerLost), each time counted against
    `max_restarts` beside the run's `restarts_done`; returns (the engine, the restarts it took). One
    line each time (`say`); RunFailed, one line, when no restart is left or `can_restart` is False
    (the launcher cannot start ranks again)."""
    restarts = 0
    while True:
        try:
            return make(restarts == 0), restarts
        except WorkerLost as lost:
            where, cause = f"{describe_rank(lost.pp_rank)} lost while the ranks started", first_line(lost)
            if not can_restart:
                raise RunFailed(f"{where}: {cause} (this launcher cannot restart workers)") from None
            if restarts_done + restarts >= max_restarts:
                raise RunFailed(f"{where}, after {restarts_done + restarts} restart(s), the limit set by "
                                f"--max-restarts: {cause}") from None
            restarts += 1
            say(f"{where}; starting them again (restart {restarts_done + restarts}/{max_restarts}); cause: {cause}",
                flush=True)


@dataclass
class RunHistory:
    """Everything summary.json and metrics.jsonl report about completed steps. `records[i]`,
    `losses[i]` and `tokens[i]` (the tokens step i trained on) belong to 0-based step i; `restarts`
    counts recoveries over the whole run."""

    losses: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    val_losses: list[list] = field(default_factory=list)
    records: list[dict] = field(default_factory=list)
    extras: dict = field(default_factory=dict)
    restarts: int = 0

    @property
    def steps_done(self) -> int:
        return len(self.losses)

    @property
    def tokens_seen(self) -> int:
        return sum(self.tokens)

    def rewind(self, steps_done: int) -> None:
        """Forget every step after the first `steps_done` (a restart re-runs them)."""
        del self.losses[steps_done:], self.step_times[steps_done:], self.records[steps_done:]
        del self.tokens[steps_done:]
        self.val_losses = [entry for entry in self.val_losses if entry[0] < steps_done]

    def to_meta(self) -> dict:
        """The JSON-able part a checkpoint's meta.json carries (records stay in metrics.jsonl)."""
        return {"losses": self.losses, "step_times": self.step_times, "tokens": self.tokens,
                "val_losses": self.val_losses, "extras": self.extras, "restarts": self.restarts}

    @classmethod
    def from_meta(cls, meta: dict, records: list[dict]) -> RunHistory:
        """The history of a checkpoint: its meta.json plus the metrics.jsonl records of its steps.
        Checkpoints written before meta.json had "tokens" trained every step on their config's batch."""
        steps_done = int(meta["steps_done"])
        if "tokens" in meta:
            tokens = [int(n) for n in meta["tokens"]]
        else:
            config = meta.get("config", {})
            per_step = (config.get("train", {}).get("batch_size", TrainConfig().batch_size)
                        * config.get("model", {}).get("seq_len", ModelConfig().seq_len))
            tokens = [per_step] * steps_done
        history = cls(losses=list(meta["losses"]), step_times=list(meta["step_times"]), tokens=tokens,
                      val_losses=[list(entry) for entry in meta["val_losses"]],
                      records=[r for r in records if r.get("step", steps_done) < steps_done],
                      extras=dict(meta.get("extras", {})), restarts=int(meta.get("restarts", 0)))
        if not len(history.losses) == len(history.step_times) == len(history.tokens) == steps_done:
            raise ValueError(f"checkpoint meta.json is inconsistent: steps_done={steps_done} but "
                             f"{len(history.losses)} losses, {len(history.step_times)} step times and "
                             f"{len(history.tokens)} token counts")
        return history
