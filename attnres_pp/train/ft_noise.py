"""What torchft prints in a replica group that recovers, held back unless the recovery fails.

When a peer group's rank is lost, each live rank's Manager logs the failed reduction with a
traceback ("got exception waiting for work"), its checkpoint server logs every healing GET, and
torch warns that the received buffer is not writable: two tracebacks and four lines for a run that
then heals and ends with the undisturbed losses. `HeldErrors` keeps torchft's log records of a
step until its outcome is known: dropped when a later step commits (the group recovered), attached
to the error when the rank's step fails (`attach`), so they reach the user with the traceback the
driver shows if the run fails, and nowhere if the driver recovers (it restarts the group). The
checkpoint server's access log and the
buffer warning say nothing a user acts on and are silenced."""

from __future__ import annotations

import logging
import warnings

# Records held at most (a long stretch of failures keeps its latest ones).
_HELD_MAX = 200


class HeldErrors(logging.Handler):
    """torchft's log records since its last committed step."""

    def __init__(self) -> None:
        super().__init__(level=logging.ERROR)
        self.records: list[logging.LogRecord] = []
        self.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        self.records = [*self.records[-(_HELD_MAX - 1):], record]

    def drop(self) -> None:
        """The group committed a step: what went wrong before was recovered."""
        self.records = []

    def attach(self, error: BaseException) -> None:
        """The rank's step failed with `error`: what torchft said goes with it, as a note (shown in
        the error's traceback, which the rank replies with)."""
        held, self.records = self.records, []
        if held and hasattr(error, "add_note"):
            error.add_note("torchft logged before this failure:\n" + "\n".join(self.format(r) for r in held))


def hold_torchft_errors() -> HeldErrors:
    """Route the `torchft` loggers' records (ERROR and above) to a fresh HeldErrors, not to stderr."""
    logger = logging.getLogger("torchft")
    logger.setLevel(logging.ERROR)  # a warning per quorum on CPU (no NCCL recorder)
    held = HeldErrors()
    for handler in [h for h in logger.handlers if isinstance(h, HeldErrors)]:
        logger.removeHandler(handler)
    logger.addHandler(held)
    logger.propagate = False
    warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)
    return held


def quiet_checkpoint_server(manager) -> None:
    """No access-log line per healing request from the Manager's checkpoint server (torchft's
    HTTPTransport serves with http.server, which logs every request to stderr)."""
    server = getattr(getattr(manager, "_checkpoint_transport", None), "_server", None)
    handler = getattr(server, "RequestHandlerClass", None)
    if handler is not None and not getattr(handler, "quiet", False):
        server.RequestHandlerClass = type(f"Quiet{handler.__name__}", (handler,),
                                          {"quiet": True, "log_message": lambda self, *args: None})
