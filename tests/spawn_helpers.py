"""Spawned rank processes for the multi-process tests: start them, collect one reply each, never hang.

A rank's target is called as `target(rank, init_method, *args, results)` and puts exactly one tuple
`(rank, value, ...)` on `results`; a rank that fails puts `(rank, traceback_text)`. Every wait has a
timeout, and the processes are joined (then terminated) whatever happened.
"""

from __future__ import annotations

import multiprocessing as mp


def spawn_ranks(target, world: int, tmp_path, *args, replies: int | None = None,
                timeout_s: float = 120.0) -> list[tuple]:
    """Run `world` spawned ranks of `target` over a file rendezvous in `tmp_path` and return the
    `replies` (default `world`) tuples they put, in arrival order; a failed rank fails the test with
    its traceback. Fewer replies than ranks is for tests where a rank is meant to die."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    init_method = f"file://{tmp_path}/rendezvous"
    procs = [ctx.Process(target=target, args=(rank, init_method, *args, results), daemon=True)
             for rank in range(world)]
    for proc in procs:
        proc.start()
    try:
        out = [results.get(timeout=timeout_s) for _ in range(world if replies is None else replies)]
    finally:
        for proc in procs:
            proc.join(timeout=20)
            if proc.is_alive():
                proc.terminate()
    for reply in out:
        assert not (len(reply) == 2 and isinstance(reply[1], str)), f"rank {reply[0]} failed:\n{reply[1]}"
    return out
