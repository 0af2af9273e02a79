"""Whether the server can still serve, and what it tells those who depend on that.

The server stops serving for one of two reasons: it failed (a worker died, or the receive loop broke:
`fail`), or it was asked to stop (SIGINT, SIGTERM: `stop`). Either way the first reason is recorded, once,
and every listener is told (the engine client ends the open requests with a 503, which an open stream
shows as an error event before its `[DONE]`; the launcher stops uvicorn). `/health` answers 503 from then
on, and new requests are refused. Only a failure makes the server exit with an error status.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

log = logging.getLogger(__name__)

SHUTTING_DOWN = "server is shutting down"


class Health:
    """Why the server no longer serves, if it does not, and its worker processes (for `/debug/state`)."""

    def __init__(self) -> None:
        self.fatal: str | None = None  # why the server no longer serves (a failure, or a shutdown)
        self.failed = False  # it stopped because something broke, not because it was asked to
        self.worker_pids: dict[str, int] = {}
        self._listeners: list[Callable[[str], None]] = []

    def on_fatal(self, listener: Callable[[str], None]) -> None:
        """Call `listener(why)` when the server stops serving (listeners run in the order they were added)."""
        self._listeners.append(listener)

    def fail(self, why: str) -> None:
        """The server cannot serve any more; only the first call (of this or `stop`) counts."""
        self._end(why, failed=True)

    def stop(self, why: str = SHUTTING_DOWN) -> None:
        """The server was asked to stop: the same for its clients as a failure, but no error."""
        self._end(why, failed=False)

    def _end(self, why: str, failed: bool) -> None:
        if self.fatal is not None:
            return
        self.fatal, self.failed = why, failed
        if failed:
            log.error("%s", why)
        else:
            log.info("%s", why)
        for listener in self._listeners:
            listener(why)
