"""Where every unfinished request waits or runs; each is in exactly one place."""

from __future__ import annotations

from dataclasses import dataclass, field

from gapless.engine.request import Req, ReqStatus


@dataclass
class Queues:
    """The scheduler's requests: waiting for admission (new or retracted), running (decoding), or the
    one whose prompt is being prefilled in chunks. A request's `status` says which; a pooling request
    whose last chunk is in flight (`POOLING`) is in none: only that batch holds it."""

    waiting: list[Req] = field(default_factory=list)
    running: list[Req] = field(default_factory=list)
    chunked: Req | None = None

    def num_active(self) -> int:
        """Admitted requests: those that hold a request-table row."""
        return len(self.running) + (self.chunked is not None)

    def prompt_scheduled(self, req: Req) -> None:
        """Its prompt is fully scheduled: it decodes from the next batch on, reading its first token
        from the future-token slot that this batch's sampler fills; a pooling request (prefill only)
        samples nothing and ends when this batch is processed."""
        if req.pool is not None:
            req.status = ReqStatus.POOLING
            return
        req.status = ReqStatus.RUNNING
        self.running.append(req)

    def remove(self, req: Req) -> None:
        """Take `req` out of wherever it is (to finish or retract it)."""
        if req is self.chunked:
            self.chunked = None
        elif req.status is ReqStatus.RUNNING:
            self.running.remove(req)
        elif req.status is ReqStatus.WAITING:
            self.waiting.remove(req)
