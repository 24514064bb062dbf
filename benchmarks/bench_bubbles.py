"""Benchmark: measured pipeline bubbles per schedule vs the calibrated simulator and the closed form.

A thin wrapper of `attnres-pp bench bubbles` (attnres_pp/bench/bubbles.py holds the benchmark):

    python benchmarks/bench_bubbles.py --quick --json    # = attnres-pp bench bubbles --quick --json
    python benchmarks/bench_bubbles.py --out DIR         # the full version, results under DIR

Results go to benchmarks/results/bubbles[_quick]_<date>.json and .md by default.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, installed or not
    from attnres_pp.cli import main

    sys.exit(main(["bench", "bubbles", *sys.argv[1:]]))
