"""Benchmark: our pipeline runtime vs torch.distributed.pipelining (Schedule1F1B, ScheduleInterleaved1F1B,
ScheduleInterleavedZeroBubble).

A thin wrapper of `attnres-pp bench peer` (attnres_pp/bench/peer.py holds the benchmark):

    python benchmarks/bench_peer.py --quick --json    # = attnres-pp bench peer --quick --json
    python benchmarks/bench_peer.py --out DIR         # the full version, results under DIR

Results go to benchmarks/results/peer[_quick]_<date>.json and .md by default.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, installed or not
    from attnres_pp.cli import main

    sys.exit(main(["bench", "peer", *sys.argv[1:]]))
