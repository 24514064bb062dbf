"""Benchmark: the simulator, calibrated on one measured run, predicts held-out measured runs.

A thin wrapper of `attnres-pp bench fidelity` (attnres_pp/bench/fidelity.py holds the benchmark):

    python benchmarks/bench_fidelity.py --quick --json    # = attnres-pp bench fidelity --quick --json
    python benchmarks/bench_fidelity.py --out DIR         # the full version, results under DIR

Results go to benchmarks/results/fidelity[_quick]_<date>.json and .md by default.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, installed or not
    from attnres_pp.cli import main

    sys.exit(main(["bench", "fidelity", *sys.argv[1:]]))
