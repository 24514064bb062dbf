"""Errors that the pipeline's process hosting raises and the training loop handles: they live here,
below both, so that the pipeline never imports the training layer."""

from __future__ import annotations


class WorkerLost(RuntimeError):
    """A rank's process died or stopped answering. `pp_rank` is -1 when the engine cannot tell which."""

    def __init__(self, pp_rank: int, message: str) -> None:
        super().__init__(message)
        self.pp_rank = pp_rank
