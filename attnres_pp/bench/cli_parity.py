"""`attnres-pp bench cli-parity [--steps 60]`: through the real CLI, a pipelined run gives the
single-process losses.

For every variant: `attnres-pp train --launcher local --stages 1 --virtual 1` against
`attnres-pp train --launcher local --stages 2 --virtual 2` (interleaved 1F1B, cache on), on the
defaults otherwise (or --steps N), each a fresh `python -m attnres_pp.cli` process of this
interpreter. Writes cli_parity_<date>.{json,md}.
"""

from __future__ import annotations

import datetime
import json
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

VARIANTS = {
    "standard": ["--residual", "standard"],
    "full_attnres": ["--residual", "attnres", "--block-size", "1"],
    "block_attnres": ["--residual", "attnres", "--block-size", "2"],
    "lr_projected": ["--residual", "lr_attnres", "--key-mode", "projected"],
    "lr_sliced": ["--residual", "lr_attnres", "--key-mode", "sliced"],
    "msar": ["--residual", "msar"],
}


def add_arguments(parser) -> None:
    parser.add_argument("--steps", type=int, default=60, help="training steps per run (default 60)")


def check(args) -> str | None:
    return "--steps must be >= 1" if args.steps < 1 else None


def run_options(args) -> dict:
    return {"steps": args.steps}


def train(out: Path, flags: list[str]) -> list[float]:
    cmd = [sys.executable, "-m", "attnres_pp.cli", "train", "--launcher", "local", "--quiet", "--out", str(out),
           *flags]
    subprocess.run(cmd, check=True, stdout=sys.stderr)  # stdout is the benchmark's table or JSON
    return json.loads((out / "summary.json").read_text())["losses"]


def run(quick: bool, out_dir: Path, progress: Callable[[str], None], *, steps: int = 60) -> dict:
    del quick, out_dir  # no short version (a small --steps is one); tables only
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, flags in VARIANTS.items():
            base = [*flags, "--steps", str(steps)]
            single = train(Path(tmp) / f"{name}-1", [*base, "--stages", "1", "--virtual", "1"])
            piped = train(Path(tmp) / f"{name}-2x2", [*base, "--stages", "2", "--virtual", "2"])
            worst = max(abs(a - b) / abs(a) for a, b in zip(single, piped, strict=True))
            rows.append({"variant": name, "steps": steps, "first_loss": single[0], "last_loss": single[-1],
                         "max_rel_loss_diff": worst})
            progress(f"{name:14s} loss {single[0]:.4f} -> {single[-1]:.4f}  max rel diff {worst:.2e}")
    return {"date": datetime.date.today().isoformat(), "rows": rows}


def to_markdown(payload: dict) -> str:
    lines = [f"# Pipelined (P=2, V=2) vs single-process losses, {payload['date']}", "",
             "| variant | steps | loss first -> last | max relative loss difference |", "|---|---|---|---|"]
    lines += [f"| {r['variant']} | {r['steps']} | {r['first_loss']:.4f} -> {r['last_loss']:.4f} | "
              f"{r['max_rel_loss_diff']:.2e} |" for r in payload["rows"]]
    return "\n".join(lines)
