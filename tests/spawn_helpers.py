"""Spawned rank processes for the multi-process tests: start them, collect one reply each, never hang.

A rank's target is called as `target(rank, init_method, *args, results)` and puts exactly one tuple
`(rank, value, ...)` on `results`; a rank that fails puts `(rank, traceback_text)`. Every wait has a
timeout, and the processes are joined (then terminated) whatever happened.
"""

from __future__ import annotations

import os

from attnres_pp.launch.process_rank_group import rank_context


def in_environ(environ: dict[str, str], target, *args) -> None:
    """A rank's body under the test's environment as it is now (a rank forked from the fork server
    would otherwise have the server's, the worker's environment when the server started)."""
    os.environ.clear()
    os.environ.update(environ)
    target(*args)


def start_ranks(target, args_of_rank: list[tuple]) -> list:
    """One started process per entry, `target(*args)` each, forked from the preloaded fork server
    as the local launcher's ranks are."""
    ctx = rank_context(target.__module__)
    procs = [ctx.Process(target=in_environ, args=(dict(os.environ), target, *args), daemon=True)
             for args in args_of_rank]
    for proc in procs:
        proc.start()
    return procs


def spawn_ranks(target, world: int, tmp_path, *args, replies: int | None = None,
                timeout_s: float = 120.0) -> list[tuple]:
    """Run `world` spawned ranks of `target` over a file rendezvous in `tmp_path` and return the
    `replies` (default `world`) tuples they put, in arrival order; a failed rank fails the test with
    its traceback. Fewer replies than ranks is for tests where a rank is meant to die."""
    results = rank_context(target.__module__).Queue()
    init_method = f"file://{tmp_path}/rendezvous"
    procs = start_ranks(target, [(rank, init_method, *args, results) for rank in range(world)])
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
