"""`attnres-lab chaos`: seeded fault injection over the launchers, faults as users meet them (a rank
killed, frozen or lost at start-up, a kill during a checkpoint save, a full disk, a torn log,
SIGTERM and SIGKILL to the driver; `chaos_trials.KINDS`), each trial a small two-rank training run
classified into the table's columns: trials, clean outcomes, hangs, misleading messages,
tracebacks, leaks, checkpoints lost. The target is 0 in every column but the first two, and
clean = trials. Progress goes to stderr, one line per trial; every run has a deadline.

    attnres-lab chaos --trials 60 --seed 7 --launchers local,ray

Writes chaos_<date>.json and .md (the table, then one row per trial that was not clean) under
benchmarks/results/ (or --out DIR). A trial that cannot run here (a tmpfs needs root) is listed
and not counted. tests/distributed/test_chaos.py runs the same trials in CI."""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path

from attnres_lab.chaos_trials import KINDS, Outcome, plan
from attnres_pp.bench.common import markdown_table

COLUMNS = ("trials", "clean", "hangs", "misleading", "tracebacks", "leaks", "checkpoints lost")
LAUNCHERS = ("local", "ray")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trials", type=int, default=30, help="how many trials (default 30; --quick: 10)")
    parser.add_argument("--seed", type=int, default=0, help="draws each trial's rank, step and save point")
    parser.add_argument("--launchers", default="local", help="comma-separated, of: " + ", ".join(LAUNCHERS))
    parser.add_argument("--kinds", default=",".join(KINDS), help="comma-separated, of: " + ", ".join(KINDS))


def _names(text: str) -> list[str]:
    return [name for name in text.split(",") if name]


def check(args: argparse.Namespace) -> str | None:
    if args.trials < 1:
        return f"--trials {args.trials} is invalid: give at least 1"
    unknown = [n for n in _names(args.launchers) if n not in LAUNCHERS] or not _names(args.launchers)
    if unknown:
        return f"--launchers {args.launchers!r} is invalid: give a comma-separated list of {', '.join(LAUNCHERS)}"
    unknown = [n for n in _names(args.kinds) if n not in KINDS] or not _names(args.kinds)
    if unknown:
        return f"--kinds {args.kinds!r} is invalid: give a comma-separated list of {', '.join(KINDS)}"
    return None


def run_options(args: argparse.Namespace) -> dict:
    return {"trials": args.trials, "seed": args.seed, "launchers": _names(args.launchers),
            "kinds": _names(args.kinds)}


def run_trials(trials: int, seed: int, launchers: list[str], kinds: list[str],
               progress: Callable[[str], None], work: Path, *, session=None, start: int = 0) -> list[Outcome]:
    """Every planned trial (numbered from `start`) in this process, its output (and its ranks') in
    `work`/output.log; or in `session`'s (a `chaos_run.Session`), whose output the caller captures."""
    from attnres_lab.chaos_outcomes import run_trial
    from attnres_lab.chaos_probe import output_to
    from attnres_lab.chaos_run import Session

    if session is None:
        with output_to(work / "output.log"):
            return run_trials(trials, seed, launchers, kinds, progress, work, session=Session(work, progress),
                              start=start)
    outcomes = []
    for trial in plan(trials, seed, launchers, kinds, start=start):
        outcome = run_trial(session, trial)
        outcomes.append(outcome)
        progress(f"{trial.label}: {verdict(outcome)} ({outcome.seconds:.1f} s)")
    return outcomes


def verdict(outcome: Outcome) -> str:
    if outcome.unavailable:
        return f"not run: {outcome.unavailable}"
    if outcome.clean:
        return "clean"
    found = [name for name, bad in (("hang", outcome.hang), ("misleading", outcome.misleading),
                                    ("traceback", outcome.traceback), ("leak", bool(outcome.leaks)),
                                    ("checkpoint lost", outcome.lost)) if bad]
    leaked = f"(left: {'; '.join(outcome.leaks)[:300]}, the last process ended {outcome.leftover_s:.1f} s after)" \
        if outcome.leaks else ""
    return f"NOT CLEAN rc {outcome.rc} {', '.join(found)} {leaked} {outcome.note} {outcome.line[:200]}".strip()


def tally(outcomes: list[Outcome]) -> dict[str, int]:
    counted = [o for o in outcomes if not o.unavailable]
    return {"trials": len(counted), "clean": sum(o.clean for o in counted), "hangs": sum(o.hang for o in counted),
            "misleading": sum(o.misleading for o in counted), "tracebacks": sum(o.traceback for o in counted),
            "leaks": sum(bool(o.leaks) for o in counted), "checkpoints lost": sum(o.lost for o in counted)}


def run(quick: bool, out_dir: Path, progress: Callable[[str], None], *, trials: int = 30, seed: int = 0,
        launchers: list[str] | None = None, kinds: list[str] | None = None) -> dict:
    del out_dir  # no pictures or traces
    work = Path(tempfile.mkdtemp(prefix="chaos-", dir="/tmp"))  # short: the fork server's socket lives below
    real_stderr = os.fdopen(os.dup(2), "w", buffering=1)
    try:
        outcomes = run_trials(10 if quick else trials, seed, launchers or ["local"], kinds or list(KINDS),
                              lambda line: print(line, file=real_stderr, flush=True), work)
    finally:
        real_stderr.close()
        shutil.rmtree(work, ignore_errors=True)
    rows = [o.row() for o in outcomes]
    groups = {"all": outcomes, **{f"launcher {n}": [o for o in outcomes if o.trial.launcher == n]
                                  for n in dict.fromkeys(o.trial.launcher for o in outcomes)},
              **{f"kind {k}": [o for o in outcomes if o.trial.kind == k] for k in dict.fromkeys(o.trial.kind
                                                                                               for o in outcomes)}}
    leftovers = [o.leftover_s for o in outcomes if o.trial.kind == "sigkill-driver" and o.trial.launcher == "ray"]
    return {"seed": seed, "launchers": launchers, "kinds": kinds, "table": {g: tally(o) for g, o in groups.items()},
            "ray_sigkill_leftover_s": leftovers,
            "ray_sigkill_leftover_median_s": statistics.median(leftovers) if leftovers else None, "rows": rows}


def to_markdown(payload: dict) -> str:
    table = markdown_table(["", *COLUMNS], [[group, *(counts[c] for c in COLUMNS)]
                                            for group, counts in payload["table"].items()])
    lines = ["# Chaos trials", "", table, ""]
    if payload.get("ray_sigkill_leftover_s"):
        times = ", ".join(f"{t:.1f}" for t in payload["ray_sigkill_leftover_s"])
        lines += [f"Ray processes after a SIGKILLed driver ended within {times} s (median "
                  f"{payload['ray_sigkill_leftover_median_s']:.1f} s).", ""]
    bad = [r for r in payload["rows"] if not r["clean"]]
    if bad:
        lines += ["Trials not clean (or not run):", "",
                  markdown_table(["trial", "rc", "what", "line"],
                                 [[r["trial"], r["rc"], r["unavailable"] or r["note"] or ", ".join(
                                     k for k in ("hang", "misleading", "traceback", "lost") if r[k]) or
                                   "; ".join(r["leaks"])[:200], r["line"][:200]] for r in bad]), ""]
    return "\n".join(lines)
