"""Benchmark: generation with Block AttnRes vs the standard residual (prefill tokens/s, per-token
decode latency), in one process and pipelined over P = 2 ranks with V = 2.

A thin wrapper of `attnres-pp bench inference` (attnres_pp/bench/inference.py holds the benchmark):

    python benchmarks/bench_inference.py --quick --json    # = attnres-pp bench inference --quick --json
    python benchmarks/bench_inference.py --out DIR         # the full version, results under DIR

Results go to benchmarks/results/inference[_quick]_<date>.json and .md by default.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, installed or not
    from attnres_pp.cli import main

    sys.exit(main(["bench", "inference", *sys.argv[1:]]))
