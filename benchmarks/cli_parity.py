"""Check, through the real CLI, that a pipelined run gives the single-process losses.

For every variant: `attnres-pp train --launcher local --stages 1 --virtual 1` against
`attnres-pp train --launcher local --stages 2 --virtual 2` (interleaved 1F1B, cache on), on the
defaults otherwise (or --steps N). Writes benchmarks/results/cli_parity_<date>.{json,md}.

    python benchmarks/cli_parity.py [--steps 60]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

VARIANTS = {
    "standard": ["--residual", "standard"],
    "full_attnres": ["--residual", "attnres", "--block-size", "1"],
    "block_attnres": ["--residual", "attnres", "--block-size", "2"],
    "lr_projected": ["--residual", "lr_attnres", "--key-mode", "projected"],
    "lr_sliced": ["--residual", "lr_attnres", "--key-mode", "sliced"],
    "msar": ["--residual", "msar"],
}


def train(out: Path, flags: list[str]) -> list[float]:
    cmd = ["attnres-pp", "train", "--launcher", "local", "--quiet", "--out", str(out), *flags]
    subprocess.run(cmd, check=True)
    return json.loads((out / "summary.json").read_text())["losses"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, flags in VARIANTS.items():
            base = [*flags, "--steps", str(args.steps)]
            single = train(Path(tmp) / f"{name}-1", [*base, "--stages", "1", "--virtual", "1"])
            piped = train(Path(tmp) / f"{name}-2x2", [*base, "--stages", "2", "--virtual", "2"])
            worst = max(abs(a - b) / abs(a) for a, b in zip(single, piped, strict=True))
            rows.append({"variant": name, "steps": args.steps, "first_loss": single[0], "last_loss": single[-1],
                         "max_rel_loss_diff": worst})
            print(f"{name:14s} loss {single[0]:.4f} -> {single[-1]:.4f}  max rel diff {worst:.2e}", flush=True)
    date = datetime.date.today().isoformat()
    command = "python benchmarks/cli_parity.py " + " ".join(sys.argv[1:])
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    machine = f"{platform.machine()}, {platform.processor() or 'cpu'}, python {platform.python_version()}"
    (out / f"cli_parity_{date}.json").write_text(json.dumps({"command": command, "machine": machine,
                                                              "rows": rows}, indent=2))
    lines = [f"# Pipelined (P=2, V=2) vs single-process losses, {date}", "", f"Command: `{command}`",
             f"Machine: {machine}", "", "| variant | steps | loss first -> last | max relative loss difference |",
             "|---|---|---|---|"]
    lines += [f"| {r['variant']} | {r['steps']} | {r['first_loss']:.4f} -> {r['last_loss']:.4f} | "
              f"{r['max_rel_loss_diff']:.2e} |" for r in rows]
    (out / f"cli_parity_{date}.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
