"""Several `python -m attnres_pp.cli ARGV` runs (or `python SCRIPT ARGV` runs of a script's
`main(argv)`) in ONE fresh interpreter, one after the other, for tests that check a fresh
process's exit status and output (an interpreter start and a torch import
cost ~2.5 CPU-s each; a fork would inherit the test process's warning filters and logging).

Each run's stdout and stderr are closed by a marker line carrying its exit code, so every run is
checked on its own output. A warning is printed once per interpreter at its first occurrence: a
later run could only miss one that an earlier run already printed, and that run's own stderr
check fails on it, so a batch that passes is a batch in which no run warned."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tests.run_helpers import REPO

END = "=== end of run, exit "
_CHILD = ("import json, runpy, sys\n"
          "script = sys.argv[2] if len(sys.argv) > 2 else None\n"
          "entry = runpy.run_path(script)['main'] if script else None\n"
          "for argv in json.loads(sys.argv[1]):\n"
          "    sys.argv = [script or 'attnres_pp.cli', *argv]\n"
          "    code = 0\n"
          "    try:\n"
          "        if entry:\n"
          "            code = entry(argv)\n"
          "        else:\n"
          "            runpy.run_module('attnres_pp.cli', run_name='__main__')\n"
          "    except SystemExit as done:\n"
          "        code = done.code if isinstance(done.code, int) else int(done.code is not None)\n"
          f"    print('{END}' + str(code), flush=True)\n"
          f"    print('{END}' + str(code), file=sys.stderr, flush=True)\n")


@dataclass(frozen=True)
class Run:
    returncode: int
    stdout: str
    stderr: str


def run_cli_batch(argvs: list[list[str]], timeout_s: float, script: Path | None = None, *,
                  unset: tuple[str, ...] = (), **env: str) -> list[Run]:
    """Each argv's exit code, stdout and stderr, in order (the CLI's, or `script`'s main); the child,
    with `env` added and `unset` removed, is killed past `timeout_s`."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    environ = {k: v for k, v in os.environ.items() if k not in unset} | {"PYTHONPATH": path, **env}
    done = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(argvs), *([str(script)] if script else [])],
                          cwd=REPO, capture_output=True, text=True, timeout=timeout_s, env=environ)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (outs, codes), (errs, _) = _by_run(done.stdout), _by_run(done.stderr)
    assert len(outs) == len(errs) == len(codes) == len(argvs), done.stdout[-3000:] + done.stderr[-3000:]
    return [Run(code, out, err) for code, out, err in zip(codes, outs, errs, strict=True)]


def split_runs(text: str, end: str = END) -> tuple[list[str], list[int], str]:
    """A batch child's output cut at each run's `end` marker line (which carries the run's exit
    code): each run's output and exit code, and what the child printed after the last run."""
    parts = text.split(end)
    outs, codes = [parts[0]], []
    for part in parts[1:]:
        code, _, tail = part.partition("\n")
        codes.append(int(code))
        outs.append(tail)
    return outs[:-1], codes, outs[-1]


def _by_run(text: str) -> tuple[list[str], list[int]]:
    """Each run's output and exit code; what the interpreter printed after the last run (its exit)
    counts as the last run's, as it would in a process of its own."""
    outs, codes, after_last = split_runs(text)
    if outs:
        outs[-1] += after_last
    return outs, codes
