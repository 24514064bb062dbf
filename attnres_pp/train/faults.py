"""Fault injection, in one place: the rehearsals a run can be told to go through, so that recovery
is tested against real deaths. `--inject-failure RANK:STEP[:allreduce]` makes a rank's worker exit
mid-step (or, with ':allreduce', as it would join the replicas' gradient reduction),
ATTNRES_PP_KILL_DURING_CHECKPOINT makes a process SIGKILL itself at one point of a checkpoint save,
ATTNRES_PP_FREEZE_RANK=RANK:STEP makes a rank SIGSTOP itself at the start of a step (a hung rank)
and ATTNRES_PP_LOSE_RANK_AT_START=RANK makes a rank's process exit while it joins the process group
(a rank lost during start-up). These two act on the ranks' first start only (a restarted rank,
or one of a torchrun restart, neither freezes nor is lost again) and need rank processes (not
--launcher inprocess, nor a run in one process). ATTNRES_PP_SLOW_STEP_S=SECONDS is pacing, not a
fault: every rank sleeps that long at the start of each step, so that a fault from outside (a host
killed) lands mid-run without steps slowed by compute. For tests and drills only; a run without them
never reaches these paths."""

from __future__ import annotations

import os
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from attnres_pp.launch.resolve import ranks_in_this_process
from attnres_pp.train.config import RunConfig

# The exit code of a rank that `--inject-failure` loses: not 0, so the driver sees a death, not a
# clean exit, and not a signal, so nothing is dumped.
LOST_RANK_EXIT_CODE = 17
_STAGING_DIR = re.compile(r"^step_(\d+)\.tmp$")  # a checkpoint being written

# Rehearsal hooks of a hung rank and of a rank lost at start-up (`freeze_point`, `start_loss_rank`).
FREEZE_RANK = "ATTNRES_PP_FREEZE_RANK"
LOSE_RANK_AT_START = "ATTNRES_PP_LOSE_RANK_AT_START"

# Pacing for rehearsals from outside (a host killed mid-run): a sleep at the start of every step, on
# every start of every rank; no number of the run changes (`slow_step_s`, `rehearse_slow_step`).
SLOW_STEP = "ATTNRES_PP_SLOW_STEP_S"

# Rehearsal hook, like `--inject-failure`: ATTNRES_PP_KILL_DURING_CHECKPOINT makes a process SIGKILL
# itself at one point of the save of checkpoint step_N, the crashes that saves and resume must survive
# (`kill_point`, KILL_POINTS). `N` alone is `N:before-meta`. For tests and drills only.
KILL_DURING_CHECKPOINT = "ATTNRES_PP_KILL_DURING_CHECKPOINT"
# The points of a save, in order: who dies there. `after-shard` takes the rank (`N:after-shard:R`).
KILL_POINTS = {
    "before-shards": "the driver, once step_N.tmp exists and before any rank writes its shard",
    "after-shard": "rank R, right after it wrote its shard, on the ranks' first start only (with --launcher "
                   "inprocess the ranks are threads of the driver, so the whole process)",
    "before-meta": "the driver, after every rank's shard and before meta.json",
    "before-rename": "the driver, after meta.json (fsynced) and before the rename to step_N",
    "between-renames": "the driver, when step_N exists already: after step_N -> step_N.old and before "
                       "step_N.tmp -> step_N",
}


@dataclass(frozen=True)
class KillPoint:
    """Where `ATTNRES_PP_KILL_DURING_CHECKPOINT` kills: the save of step_`step`, at `point` (one of
    KILL_POINTS), by rank `rank` for `after-shard` (None for the driver's points)."""

    step: int
    point: str
    rank: int | None = None


def parse_failure(text: str | None, run_cfg: RunConfig) -> tuple | None:
    """`--inject-failure RANK:STEP[:allreduce]` (STEP 1-based, as progress lines count) as (rank,
    0-based step), or (rank, 0-based step, "allreduce") for the failure inside the replicas' reduction."""
    if text is None:
        return None
    rank_text, _, rest = text.partition(":")
    step_text, _, point = rest.partition(":")
    try:
        rank, step = int(rank_text), int(step_text)
    except ValueError:
        raise ValueError(f"--inject-failure {text!r} is invalid: expected RANK:STEP, e.g. 1:3") from None
    if point not in ("", "allreduce"):
        raise ValueError(f"--inject-failure {text!r} is invalid: the point after STEP can only be 'allreduce'")
    if point and run_cfg.train.fault_tolerance != "replicas":
        raise ValueError(f"--inject-failure {text!r} is invalid: ':allreduce' is for --fault-tolerance replicas "
                          "(the replicas' reduction through torchft); drop it to fail mid-pipeline")
    pipe, steps = run_cfg.pipeline, run_cfg.train.steps
    if not 0 <= rank < pipe.world_size:
        layout = f"--stages {pipe.stages}"
        if pipe.data_parallel > 1:
            layout += f" x --data-parallel {pipe.data_parallel}"
        if pipe.tensor_parallel > 1:
            layout += f" x --tensor-parallel {pipe.tensor_parallel}"
        raise ValueError(f"--inject-failure {text!r} is invalid: RANK must be in 0..{pipe.world_size - 1} ({layout})")
    if not 1 <= step <= steps:
        raise ValueError(f"--inject-failure {text!r} is invalid: STEP must be in 1..{steps} (--steps {steps})")
    return (rank, step - 1, point) if point else (rank, step - 1)


def lose_this_rank() -> None:
    """End this rank's process at once, as a lost rank does (`--inject-failure`): no clean-up, no reply."""
    os._exit(LOST_RANK_EXIT_CODE)


def kill_point() -> KillPoint | None:
    """The kill point `ATTNRES_PP_KILL_DURING_CHECKPOINT` asks for (see KILL_POINTS), or None if it
    is unset: `N` (= `N:before-meta`, the hook's first form), `N:POINT` for the driver's points,
    `N:after-shard:R` for rank R. Raises ValueError saying what to set otherwise."""
    raw = os.environ.get(KILL_DURING_CHECKPOINT, "")
    if not raw:
        return None
    parts = raw.split(":")
    point = parts[1] if len(parts) > 1 else "before-meta"
    try:
        step = int(parts[0])
        rank = int(parts[2]) if len(parts) == 3 else None
    except ValueError:
        step, rank = 0, None
    valid = (step >= 1 and point in KILL_POINTS and len(parts) <= 3
             and (len(parts) == 3) == (point == "after-shard") and (rank is None or rank >= 0))
    if not valid:
        raise ValueError(f"{KILL_DURING_CHECKPOINT}={raw!r} is invalid: set it to N (the save of checkpoint step_N, "
                         f"N >= 1, killed before meta.json), N:POINT with POINT one of "
                         f"{', '.join(p for p in KILL_POINTS if p != 'after-shard')}, or N:after-shard:R (rank R "
                         "killed after writing its shard), or unset it")
    return KillPoint(step, point, rank)


def rehearse_kill(point: str, steps_done: int, rank: int | None = None) -> None:
    """SIGKILL this process if `ATTNRES_PP_KILL_DURING_CHECKPOINT` names this point of the save of
    step_`steps_done` (and, for `after-shard`, this `rank`)."""
    if kill_point() == KillPoint(steps_done, point, rank):
        os.kill(os.getpid(), signal.SIGKILL)


def rehearse_rank_kill(step_dir: str | Path, rank: int) -> None:
    """`rehearse_kill("after-shard", ...)` for a rank that has just written its shard into the
    staging folder `step_dir` (`step_N.tmp`, which names the step)."""
    m = _STAGING_DIR.match(Path(step_dir).name)
    if m:
        rehearse_kill("after-shard", int(m.group(1)), rank)


def freeze_point(run_cfg: RunConfig | None = None) -> tuple[int, int] | None:
    """(rank, 1-based step) of `ATTNRES_PP_FREEZE_RANK=RANK:STEP`, or None if it is unset. Raises
    ValueError saying what to set for a malformed value, or, given the run's config, for a rank or
    step the run does not have or a run whose ranks are not processes of their own."""
    raw = os.environ.get(FREEZE_RANK, "")
    if not raw:
        return None
    rank_text, _, step_text = raw.partition(":")
    try:
        rank, step = int(rank_text), int(step_text)
    except ValueError:
        rank, step = -1, 0
    if rank < 0 or step < 1:
        raise ValueError(f"{FREEZE_RANK}={raw!r} is invalid: set it to RANK:STEP (that rank SIGSTOPs itself at the "
                         "start of 1-based step STEP), e.g. 1:2, or unset it")
    if run_cfg is not None:
        _check_rehearsed_rank(FREEZE_RANK, raw, rank, run_cfg)
        if step > run_cfg.train.steps:
            raise ValueError(f"{FREEZE_RANK}={raw!r} is invalid: STEP must be in 1..{run_cfg.train.steps} "
                             f"(--steps {run_cfg.train.steps})")
    return rank, step


def start_loss_rank(run_cfg: RunConfig | None = None) -> int | None:
    """The rank `ATTNRES_PP_LOSE_RANK_AT_START=RANK` loses while it joins the process group, or None
    if it is unset; ValueError as `freeze_point`."""
    raw = os.environ.get(LOSE_RANK_AT_START, "")
    if not raw:
        return None
    try:
        rank = int(raw)
    except ValueError:
        rank = -1
    if rank < 0:
        raise ValueError(f"{LOSE_RANK_AT_START}={raw!r} is invalid: set it to RANK (that rank's process exits while "
                         "it joins the process group), e.g. 1, or unset it")
    if run_cfg is not None:
        _check_rehearsed_rank(LOSE_RANK_AT_START, raw, rank, run_cfg)
    return rank


def slow_step_s() -> float:
    """The seconds `ATTNRES_PP_SLOW_STEP_S` asks each rank to sleep at the start of every step (0.0
    if it is unset). Raises ValueError saying what to set for a value that is not 0-60 seconds."""
    raw = os.environ.get(SLOW_STEP, "")
    if not raw:
        return 0.0
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds <= 60:
        raise ValueError(f"{SLOW_STEP}={raw!r} is invalid: set it to SECONDS from 0 to 60 (each rank sleeps that long "
                         "at the start of every step), or unset it")
    return seconds


def rehearse_slow_step(seconds: float) -> None:
    """Sleep `seconds` (a rank's `slow_step_s()`, read once at its start) before a step."""
    if seconds > 0:
        time.sleep(seconds)


def check_rank_rehearsals(run_cfg: RunConfig) -> None:
    """Validate the rank hooks against the run (the CLI calls this before any rank starts)."""
    freeze_point(run_cfg)
    start_loss_rank(run_cfg)
    slow_step_s()


def _check_rehearsed_rank(name: str, raw: str, rank: int, run_cfg: RunConfig) -> None:
    pipe = run_cfg.pipeline
    if ranks_in_this_process(pipe):
        raise ValueError(f"{name}={raw!r} needs rank processes to rehearse on: use --launcher local (with --stages or "
                         "--virtual > 1), ray or torchrun, or unset it")
    if rank >= pipe.world_size:
        raise ValueError(f"{name}={raw!r} is invalid: RANK must be in 0..{pipe.world_size - 1} "
                         f"({pipe.world_size} ranks)")


def first_start() -> bool:
    """Whether these ranks are the run's first (torchrun counts its restarts in
    TORCHELASTIC_RESTART_COUNT; the other launchers tell a restarted worker so themselves)."""
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"


def rehearse_freeze(rank: int, step: int) -> None:
    """SIGSTOP this process if `ATTNRES_PP_FREEZE_RANK` names rank `rank` at 0-based step `step`."""
    if freeze_point() == (rank, step + 1) and first_start():
        os.kill(os.getpid(), signal.SIGSTOP)


def rehearse_start_loss(rank: int) -> None:
    """End this process as a lost rank if `ATTNRES_PP_LOSE_RANK_AT_START` names rank `rank`."""
    if start_loss_rank() == rank and first_start():
        lose_this_rank()
