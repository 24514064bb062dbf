"""Benchmark: bytes and time per step: standard / Full naive / Block naive / Block cached.

A thin wrapper of `attnres-pp bench comm` (attnres_pp/bench/comm.py holds the benchmark):

    python benchmarks/bench_comm.py --quick --json    # = attnres-pp bench comm --quick --json
    python benchmarks/bench_comm.py --out DIR         # the full version, results under DIR

Results go to benchmarks/results/comm[_quick]_<date>.json and .md by default.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, installed or not
    from attnres_pp.cli import main

    sys.exit(main(["bench", "comm", *sys.argv[1:]]))
