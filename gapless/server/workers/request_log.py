"""The scheduler's per-request log lines (`--log-requests`): one when a request is refused, one when it
finishes, with its token counts, its time to first token and its time in all."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gapless.engine.request import Req

log = logging.getLogger(__name__)


class RequestLog:
    """The clocks of the requests the scheduler queued: when each was queued and made its first token."""

    def __init__(self) -> None:
        self.clocks: dict[str, list[float]] = {}  # rid -> [queued at, first token at]

    def refused(self, rid: str, why: Exception) -> None:
        log.info("request %s: refused: %s", rid, why)

    def queued(self, rid: str) -> None:
        self.clocks[rid] = [time.perf_counter()]

    def stepped(self, reqs: Iterable[Req]) -> None:
        """Note the first token of each of a step's requests; log the line of each that finished."""
        now = time.perf_counter()
        for req in reqs:
            self._stepped(req, now)

    def _stepped(self, req: Req, now: float) -> None:
        clock = self.clocks.get(req.rid)
        if clock is None:
            return
        if len(clock) == 1 and req.output_ids:
            clock.append(now)
        if req.finished:
            del self.clocks[req.rid]
            first = f"{clock[1] - clock[0]:.3f} s" if len(clock) > 1 else "-"
            log.info(
                "request %s: %d prompt tokens (%d cached), %d output tokens, finish %s, first token %s, "
                "%.3f s in all",
                req.rid,
                len(req.prompt_ids),
                req.cached_tokens or 0,
                len(req.output_ids),
                req.finish_reason,
                first,
                now - clock[0],
            )
