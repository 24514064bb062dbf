"""A chaos trial from its fault to its outcome (`chaos_run.Session.run` calls these): the run with
its fault, what it left behind, and, where it stopped, `train --resume` of its folder, whose losses
must be the undisturbed run's. A full disk is a tmpfs as small as the trial needs (root), grown
before the resume, as an operator who freed space would."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

from attnres_lab import chaos_probe as probe
from attnres_lab.chaos_run import Session, Watcher, fault, full_disk_at, ignore_sigterm, start_driver
from attnres_lab.chaos_trials import (
    CHECKPOINT_EVERY,
    DEADLINE_S,
    FLAGS,
    KINDS,
    RANKS,
    STOP_WITHIN_S,
    Outcome,
    Trial,
    classify,
    expected_line,
    notable_lines,
    run_losses,
    same_losses,
)
from attnres_pp.train.summary import read_metrics

_PAGE = 4096
_KEPT_CHECKPOINTS = 2  # what a run keeps by default: a save's room is beside this many
_SMALL_FILES_BYTES = 8 * _PAGE  # metrics.jsonl and the run's other small files, with room to spare


@contextlib.contextmanager
def small_disk(mount: Path, size_bytes: int):
    """A tmpfs of `size_bytes` at `mount` (yields None), or the reason it cannot be made (not root)."""
    mount.mkdir(parents=True)
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(mount)],
                          capture_output=True, text=True, timeout=30)
    if made.returncode != 0:
        yield f"a tmpfs cannot be mounted here ({made.stderr.strip() or made.returncode}); needs root"
        return
    try:
        yield None
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True, timeout=30)


def grow(mount: Path) -> None:
    subprocess.run(["mount", "-o", "remount,size=64m", str(mount)], capture_output=True, timeout=30, check=True)


def disk_for_save(step: int, checkpoint_bytes: int) -> int:
    """A tmpfs with room for the run's checkpoints before step `step`'s save and half of that save."""
    kept = min(step // CHECKPOINT_EVERY - 1, _KEPT_CHECKPOINTS)
    return _SMALL_FILES_BYTES + kept * checkpoint_bytes + checkpoint_bytes // 2


def tear(run: Path) -> None:
    """Append what a kill in the middle of a write leaves: the first half of a record, no newline."""
    lines = (run / "metrics.jsonl").read_text().splitlines()
    with open(run / "metrics.jsonl", "a") as handle:
        handle.write(lines[-1][: len(lines[-1]) // 2] if lines else '{"step": 0, "loss"')


def resume(session: Session, trial: Trial, run: Path, tmp: Path, reference: list[float], outcome: Outcome) -> None:
    """`train --resume` of a run that stopped: it must end with the undisturbed losses, printing
    nothing notable but, after a torn log, one warning naming metrics.jsonl."""
    from attnres_pp.train.checkpoint import latest_checkpoint

    if latest_checkpoint(run) is None:  # stopped before its first save: no checkpoint to lose
        outcome.note = (outcome.note + " (no checkpoint saved yet: nothing to resume)").strip()
        return
    rc, watcher, out = session.drive(["train", "--resume", str(run), "--quiet"], env={}, tmp=tmp,
                                     deadline_s=DEADLINE_S[trial.launcher], metrics=run / "metrics.jsonl")
    leaks, _ = probe.leaks(watcher.seen, tmp)
    probe.end_processes(watcher.seen)
    outcome.leaks += [f"after --resume: {leak}" for leak in leaks]
    outcome.hang |= watcher.hang
    outcome.traceback |= "Traceback" in out
    losses, _ = run_losses(run)
    outcome.lost = rc != 0 or not same_losses(losses, reference)
    lines = notable_lines(out)
    want_warning = trial.kind == "torn-log"
    if lines != lines[:1] or bool(lines) != want_warning or (lines and "metrics.jsonl" not in lines[0]):
        outcome.clean = False
        outcome.note = (outcome.note + f" --resume printed: {' | '.join(lines)[:300]}").strip()
    if outcome.lost:
        outcome.note = (outcome.note + f" --resume: rc {rc}").strip()
    outcome.clean &= not (outcome.traceback or outcome.hang or outcome.leaks or outcome.lost)


def run_trial(session: Session, trial: Trial) -> Outcome:
    """`trial` from its fault to its outcome, in its own folder under the session's."""
    reference = session.ensure_reference(trial.launcher)
    folder = session.work / f"t{trial.number}"
    tmp = folder / "tmp"
    tmp.mkdir(parents=True)
    started = time.monotonic()
    previous = signal.signal(signal.SIGTERM, ignore_sigterm)
    try:
        finish = finish_subprocess if KINDS[trial.kind].driver == "subprocess" else finish_inprocess
        outcome = finish(session, trial, folder, tmp, reference)
    finally:
        signal.signal(signal.SIGTERM, previous)
    outcome.seconds = time.monotonic() - started
    return outcome


def finish_inprocess(session: Session, trial: Trial, folder: Path, tmp: Path, reference: list[float]) -> Outcome:
    if trial.kind != "full-disk-save":
        return _inprocess(session, trial, folder / "run", tmp, reference)
    mount = folder / "disk"
    with small_disk(mount, disk_for_save(trial.step, session.checkpoint_bytes)) as unavailable:
        if unavailable:
            return Outcome(trial, unavailable=unavailable)
        return _inprocess(session, trial, mount / "run", tmp, reference, disk=mount)


def _check_stop(trial: Trial, run: Path, watcher: Watcher, ended_at: float, outcome: Outcome) -> None:
    """What a stopped run must also show: SIGTERM honoured within STOP_WITHIN_S; a full disk met
    without a restart (each step trained once) and without a half-written checkpoint left."""
    if trial.kind in ("sigterm", "torn-log") and watcher.fired_at is not None \
            and ended_at - watcher.fired_at > STOP_WITHIN_S:
        outcome.note = f"stopped {ended_at - watcher.fired_at:.1f} s after SIGTERM"
    if trial.kind.startswith("full-disk"):
        steps = [r.get("step") for r in read_metrics(run / "metrics.jsonl")[0]]
        trained = trial.step if trial.kind == "full-disk-save" else trial.step - 1
        staging = sorted(p.name for p in (run / "checkpoints").glob("*.tmp")) if (run / "checkpoints").exists() else []
        if steps != list(range(trained)) or staging:
            outcome.note = f"after the full disk: records of steps {steps}, left {staging}"


def _inprocess(session: Session, trial: Trial, run: Path, tmp: Path, reference: list[float],
               disk: Path | None = None) -> Outcome:
    env, flags, when, fire = fault(trial, os.getpid(), run)
    args = ["train", "--launcher", trial.launcher, *FLAGS, *flags, "--out", str(run)]
    logging_fault = full_disk_at(trial.step) if trial.kind == "full-disk-log" else contextlib.nullcontext()
    with logging_fault:
        rc, watcher, out = session.drive(args, env=env, tmp=tmp, deadline_s=DEADLINE_S[trial.launcher], when=when,
                                         fire=fire, metrics=run / "metrics.jsonl")
    ended_at = time.monotonic()
    outcome = Outcome(trial, rc=rc, hang=watcher.hang)
    outcome.leaks, outcome.leftover_s = probe.leaks(watcher.seen, tmp)
    probe.end_processes(watcher.seen)  # a stopped or stray rank, counted above
    _check_stop(trial, run, watcher, ended_at, outcome)
    _check_delivered(trial, watcher, when, outcome)
    losses, restarts = run_losses(run)
    line = expected_line(trial, run, disk)
    classify(outcome, out, expected_lines=[line] if line else [], restarts=restarts)
    if outcome.note:
        outcome.clean = False
    if rc == 0:
        outcome.lost = not same_losses(losses, reference)
        outcome.clean &= not outcome.lost
        return outcome
    if trial.kind == "torn-log":
        tear(run)
    if disk is not None:
        grow(disk)
    resume(session, trial, run, tmp, reference, outcome)
    return outcome


def _check_delivered(trial: Trial, watcher: Watcher, when, outcome: Outcome, processes: int = RANKS) -> None:
    """A trial whose fault never came, or whose run's processes were never seen (so that no leak
    could be), proves nothing: not clean."""
    if when is not None and not watcher.fired:
        outcome.note = "the fault was not delivered (the run ended first)"
    elif len(watcher.seen) < processes and trial.kind != "lose-at-start":
        outcome.note = f"saw {len(watcher.seen)} processes of the run, expected {processes} or more"


def finish_subprocess(session: Session, trial: Trial, folder: Path, tmp: Path, reference: list[float]) -> Outcome:
    """The driver as a process of its own (it is to die), its output and its ranks' in driver.log."""
    run, log = folder / "run", folder / "driver.log"
    env, flags, _, _ = fault(trial, 0, run)
    proc = start_driver(["train", "--launcher", trial.launcher, *FLAGS, *flags, "--out", str(run)], env, tmp, log,
                        trial.launcher)
    _, _, when, fire = fault(trial, proc.pid, run)
    deadline = DEADLINE_S[trial.launcher]
    watcher = Watcher(proc.pid, run / "metrics.jsonl", exclude=set(), deadline_s=deadline, on_deadline=proc.kill,
                      when=when, fire=fire)
    watcher.start()
    try:
        rc = proc.wait(timeout=deadline + 30)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = proc.wait(timeout=30)
    finally:
        watcher.stop()
    outcome = Outcome(trial, rc=rc, hang=watcher.hang)
    outcome.leaks, outcome.leftover_s = probe.leaks(watcher.seen, tmp)
    probe.end_processes(watcher.seen)
    _check_delivered(trial, watcher, when, outcome, processes=RANKS + 1)
    _, restarts = run_losses(run)
    classify(outcome, log.read_text(errors="replace"), expected_lines=[], restarts=restarts)
    if outcome.note:
        outcome.clean = False
    resume(session, trial, run, tmp, reference, outcome)
    return outcome
