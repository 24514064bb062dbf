"""One trial of `attnres-lab chaos`: a small training run under one launcher meets one fault, and
what a user would see is classified into the table's columns.

The kinds (`KINDS`), each with the outcome that counts as clean:

- `kill-rank`: a rank's process ends mid-step (`--inject-failure R:S`): restarted from the last
  checkpoint, rc 0, the undisturbed losses.
- `kill-in-save`: a rank SIGKILLs itself right after writing its shard of a checkpoint
  (ATTNRES_PP_KILL_DURING_CHECKPOINT=S:after-shard:R): the same.
- `freeze-rank`: a rank stopped (SIGSTOP) mid-run: detected as hung, restarted, the same. Through the
  run's own hook ATTNRES_PP_FREEZE_RANK=R:S where train.faults has it, else by an outside SIGSTOP.
- `lose-at-start`: a rank lost while the engine starts: restarted, the same. Hook
  ATTNRES_PP_LOSE_RANK_AT_START=R where train.faults has it, else an outside SIGKILL of the first
  rank process seen.
- `sigterm`: SIGTERM to the driver after step S: exit 143 with the one line
  "terminated (SIGTERM): stopping the workers"; `--resume` ends with the undisturbed losses.
- `torn-log`: the same stop, then a torn last line appended to metrics.jsonl (what a kill in the
  middle of a write leaves): `--resume` says one `warning:` line naming the file, then the losses.
- `full-disk-log`: the driver's write of a metrics record meets ENOSPC after half the line (in this
  process): exit 2, one `error: no space left on device` line; `--resume` gives the losses.
- `full-disk-save`: `--out` on a tmpfs with room for the checkpoints before step S, not step S's
  (root: mount): exit 2, the same line; after the tmpfs grows, `--resume` gives the losses.
- `sigkill-driver`: the driver SIGKILLed after step S (a process of its own): every rank and Ray
  process gone within LEAK_GRACE_S, nothing printed; `--resume` gives the losses.
- `kill-driver-in-save`: the driver SIGKILLs itself at a point of a save
  (ATTNRES_PP_KILL_DURING_CHECKPOINT=S:POINT): the same as `sigkill-driver`.

Columns: `hang` (the trial's deadline passed: the run was stopped from outside), `misleading` (the
run stopped otherwise than it should, or with more than one error line, and its line does not name
the cause), `traceback` ("Traceback" anywhere in what the driver and its ranks printed), `leak`
(processes, rendezvous folders or /dev/shm files of the run alive LEAK_GRACE_S after it ended),
`lost` (the losses after recovery or `--resume` differ from the undisturbed run's, or the resume
failed). `clean`: the expected exit, line and recovery, and none of the others.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

RANKS = 2
STEPS = 12
CHECKPOINT_EVERY = 2
FLAGS = ["--stages", str(RANKS), "--layers", "2", "--d-model", "16", "--heads", "2", "--seq-len", "8",
         "--batch-size", "2", "--microbatches", "2", "--steps", str(STEPS), "--checkpoint-every",
         str(CHECKPOINT_EVERY), "--eval-every", "0", "--max-restarts", "2", "--quiet"]
# A rank stopped for longer than this is hung (the run's --timeout, from which the deadlines derive).
TIMEOUT_S = 10
DEADLINE_S = {"local": 120.0, "ray": 240.0}  # a trial still running then is a hang
STOP_LINE = "terminated (SIGTERM): stopping the workers"
# The driver's kill points a first save of a step reaches ("between-renames" is reached only when
# step_N exists already, a save after a restart: tests/unit/test_crash_consistent_saves.py has it).
DRIVER_KILL_POINTS = ("before-shards", "before-meta", "before-rename")


@dataclass(frozen=True)
class Kind:
    driver: str  # "inprocess" (train's main in this process) or "subprocess" (a driver to SIGKILL)
    rc: int  # the run's expected exit (before any --resume)
    restarts: bool  # recovered inside the run (summary.json's restarts >= 1)
    cause: str  # what a line about it must say (regular expression, {rank} filled in)
    line: str = ""  # the one line the run prints (its start), "" for none


KINDS = {
    "kill-rank": Kind("inprocess", 0, True, r"rank {rank}\b.*(lost|exited|killed|closed)"),
    "kill-in-save": Kind("inprocess", 0, True, r"rank {rank}\b.*(lost|exited|killed|closed)"),
    "freeze-rank": Kind("inprocess", 0, True, r"rank {rank}\b.*(hung|hang|no progress|stopped|frozen|deadline)"),
    "lose-at-start": Kind("inprocess", 0, True, r"rank {rank}\b.*(lost|exited|killed|closed)"),
    "sigterm": Kind("inprocess", 143, False, r"SIGTERM", STOP_LINE),
    "torn-log": Kind("inprocess", 143, False, r"SIGTERM", STOP_LINE),
    "full-disk-log": Kind("inprocess", 2, False, r"no space left on device", "error: no space left on device"),
    "full-disk-save": Kind("inprocess", 2, False, r"no space left on device", "error: no space left on device"),
    "sigkill-driver": Kind("subprocess", -9, False, r"$^"),
    "kill-driver-in-save": Kind("subprocess", -9, False, r"$^"),
}
@dataclass(frozen=True)
class Trial:
    number: int
    kind: str
    launcher: str
    rank: int
    step: int  # 1-based: the step the fault hits (a checkpoint step for the save kinds)
    point: str = ""  # kill-driver-in-save's point of the save

    @property
    def label(self) -> str:
        where = f" at {self.point}" if self.point else ""
        return f"#{self.number} {self.kind} {self.launcher} rank {self.rank} step {self.step}{where}"


@dataclass
class Outcome:
    trial: Trial
    rc: int | None = None
    clean: bool = False
    hang: bool = False
    misleading: bool = False
    traceback: bool = False
    leaks: list[str] = field(default_factory=list)
    lost: bool = False
    line: str = ""  # the error, stop or warning lines the run printed
    note: str = ""
    seconds: float = 0.0
    leftover_s: float = 0.0  # how long the run's last process outlived it
    unavailable: str = ""  # why this trial could not run here (not counted)

    def row(self) -> dict:
        return {"trial": self.trial.label, "kind": self.trial.kind, "launcher": self.trial.launcher,
                "rc": self.rc, "clean": self.clean, "hang": self.hang, "misleading": self.misleading,
                "traceback": self.traceback, "leaks": self.leaks, "lost": self.lost, "line": self.line,
                "note": self.note, "seconds": round(self.seconds, 2), "leftover_s": round(self.leftover_s, 2),
                "unavailable": self.unavailable}


def plan(trials: int, seed: int, launchers: list[str], kinds: list[str], start: int = 0) -> list[Trial]:
    """`trials` trials, numbered from `start`: the kinds in turn (so a short plan still covers
    each), the launchers in turn within each kind, rank, step and save point drawn from `seed`."""
    import random

    rng = random.Random(seed)
    planned = []
    for number in range(trials):
        kind = kinds[number % len(kinds)]
        launcher = launchers[(number // len(kinds)) % len(launchers)]
        rank = rng.randrange(RANKS)
        if kind == "full-disk-save":  # the run keeps 2 checkpoints: from step_6 on, each save has the same room
            step = CHECKPOINT_EVERY * rng.randint(2, 3)
        elif kind in ("kill-in-save", "kill-driver-in-save"):
            step = CHECKPOINT_EVERY * rng.randint(2, 4)  # a save with an earlier checkpoint to fall back to
        else:
            step = rng.randint(3, 6)
        point = rng.choice(DRIVER_KILL_POINTS) if kind == "kill-driver-in-save" else ""
        planned.append(Trial(start + number, kind, launcher, rank, step, point))
    return planned


# SIGTERM stops a run like Ctrl-C: within this long of the signal.
STOP_WITHIN_S = 15.0
_NOTABLE = re.compile(r"^(error:|warning:|terminated|interrupted)|Error\b|Exception\b|Fatal Python error")
# What Ray prints about itself and its actors (the actors' set-up lines, its instance starting, a
# worker it saw die): not the run's verdict, so not held to the one-line rule (but read for errors).
_RAY_CHATTER = re.compile(r"^(\x1b\[\d+m)?\((StageActor|RankActor|GenerationActor|raylet|pid=\d+)\b"
                          r"|^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+\s+(INFO|WARNING) ")


def notable_lines(text: str) -> list[str]:
    """What a user reads as the run's verdict: error, warning and stop lines, and error names."""
    return [line for line in text.splitlines() if _NOTABLE.search(line)]


def expected_line(trial: Trial, run: Path, disk: Path | None) -> str:
    """The one line a clean trial of `trial.kind` prints (whole, or its start), "" for none. A full
    disk's names the cause, what could not be written, the filesystem, the fix and the last complete
    checkpoint with the command that resumes from it."""
    kind = KINDS[trial.kind]
    if not trial.kind.startswith("full-disk"):
        return kind.line
    from attnres_pp.launch.storage_fault import mount_point

    if trial.kind == "full-disk-save":
        what, last = f"checkpoint {run / 'checkpoints' / f'step_{trial.step}'}", trial.step - CHECKPOINT_EVERY
    else:
        what, last = str(run / "metrics.jsonl"), CHECKPOINT_EVERY * ((trial.step - 1) // CHECKPOINT_EVERY)
    return (f"error: no space left on device writing {what} (the filesystem at {disk or mount_point(run)}): free "
            f"space or give another --out; the last complete checkpoint step_{last} stays resumable "
            f"(attnres-pp train --resume {run})")


def classify(outcome: Outcome, output: str, *, expected_lines: list[str], restarts: int | None) -> None:
    """Fill `outcome`'s columns from the run's exit, its `output` and what recovery gave (its
    `hang`, `leaks` and `lost` are set already). `expected_lines`: the starts of the lines a clean
    trial prints, in order: a `--quiet` run prints nothing else."""
    kind, trial = KINDS[outcome.trial.kind], outcome.trial
    lines = notable_lines(output)
    outcome.line = " | ".join(lines)[:400]
    outcome.traceback = "Traceback" in output or "Fatal Python error" in output
    cause = re.compile(kind.cause.format(rank=trial.rank))
    printed = [line for line in output.splitlines()
               if line.strip() and not (trial.launcher == "ray" and _RAY_CHATTER.search(line))]
    as_expected = (len(printed) == len(expected_lines)
                   and all(line.startswith(want) for line, want in zip(printed, expected_lines, strict=True)))
    errors = [line for line in lines if line.startswith("error:")]
    wrong_exit = outcome.rc != kind.rc or not as_expected
    outcome.misleading = not outcome.hang and wrong_exit and (len(errors) > 1 or not any(
        cause.search(line) for line in lines))
    recovered = (not kind.restarts) or (restarts or 0) >= 1
    outcome.clean = not (wrong_exit or outcome.hang or outcome.misleading or outcome.traceback or outcome.leaks
                         or outcome.lost or not recovered)
    if not recovered and not outcome.note:
        outcome.note = "no restart recorded"


def run_losses(run: Path) -> tuple[list[float] | None, int | None]:
    """(summary.json's losses, its restarts), or (None, None) without a summary."""
    try:
        summary = json.loads((run / "summary.json").read_text())
    except (OSError, ValueError):
        return None, None
    return summary.get("losses"), summary.get("restarts")


def same_losses(got: list[float] | None, want: list[float], rtol: float = 1e-5) -> bool:
    return got is not None and len(got) == len(want) and all(
        abs(g - w) <= rtol * abs(w) for g, w in zip(got, want, strict=True))
