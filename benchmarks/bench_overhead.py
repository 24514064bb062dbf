"""Benchmark: step time of Block AttnRes with the cache vs the standard residual, same pipeline.

A thin wrapper of `attnres-pp bench overhead` (attnres_pp/bench/overhead.py holds the benchmark):

    python benchmarks/bench_overhead.py --quick --json    # = attnres-pp bench overhead --quick --json
    python benchmarks/bench_overhead.py --out DIR         # the full version, results under DIR

Results go to benchmarks/results/overhead[_quick]_<date>.json and .md by default.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, installed or not
    from attnres_pp.cli import main

    sys.exit(main(["bench", "overhead", *sys.argv[1:]]))
