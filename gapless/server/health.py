"""Whether the server can still serve, and what it tells those who depend on that.

A server whose worker died (or whose receive loop failed) cannot finish any request: `fail` records why,
once, and tells every listener (the engine client fails the open requests with a 503, the launcher
stops uvicorn). `/health` answers 503 from then on, and new requests are refused.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

log = logging.getLogger(__name__)


class Health:
    """The server's fatal error, if any, and its worker processes (reported by `/debug/state`)."""

    def __init__(self) -> None:
        self.fatal: str | None = None
        self.worker_pids: dict[str, int] = {}
        self._listeners: list[Callable[[str], None]] = []

    def on_fatal(self, listener: Callable[[str], None]) -> None:
        """Call `listener(why)` when the server fails (listeners run in the order they were added)."""
        self._listeners.append(listener)

    def fail(self, why: str) -> None:
        """The server cannot serve any more; only the first call counts."""
        if self.fatal is not None:
            return
        self.fatal = why
        log.error("%s", why)
        for listener in self._listeners:
            listener(why)
