"""Benchmark: the backward split in I and W against the fused backward B, per chunk.

A thin wrapper of `attnres-pp bench split` (attnres_pp/bench/split.py holds the benchmark):

    python benchmarks/bench_split.py --quick --json    # = attnres-pp bench split --quick --json
    python benchmarks/bench_split.py --out DIR         # the full version, results under DIR

Results go to benchmarks/results/split[_quick]_<date>.json and .md by default.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, installed or not
    from attnres_pp.cli import main

    sys.exit(main(["bench", "split", *sys.argv[1:]]))
