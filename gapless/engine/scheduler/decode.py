"""Decode and retraction: one more token for every running request that may need one, and, when the KV
pool cannot give them a slot each, the request with least progress goes back to the waiting queue."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, NamedTuple

from gapless.engine.request import Req, ReqStatus
from gapless.engine.scheduler.budget import DecodeReserve
from gapless.engine.scheduler.kv import KVManager
from gapless.engine.scheduler.queues import Queues
from gapless.engine.stats import EngineStats

log = logging.getLogger(__name__)


class DecodePlan(NamedTuple):
    """A decode batch to build: its requests, and the KV `DecodePlanner.alloc` took for them."""

    reqs: list[Req]
    slots: Any  # `DecodeSlots`, or a verify's `VerifyPlan`


class DecodePlanner:
    """Plans decode batches: which running requests decode, and which to retract when KV runs out."""

    def __init__(
        self,
        queues: Queues,
        kv: KVManager,
        reserve: DecodeReserve,
        stats: EngineStats,
        max_context: int,
        alloc: Callable[[list[Req]], Any] | None = None,
    ) -> None:
        self.queues, self.kv, self.reserve, self.stats = queues, kv, reserve, stats
        self.max_context = max_context
        # the KV of one step of `reqs`, or None: a decode's slot each (`KVManager.alloc_decode`), or a
        # verify's slots for its drafts too (`gapless.engine.scheduler.verify`)
        self.alloc = alloc or kv.alloc_decode

    def schedule(self, drain: Callable[[], bool]) -> DecodePlan | None:
        """The requests of the next decode batch and what `alloc` took for them, or None if none needs
        a token. `drain` processes the batches in flight (False if there were none): retraction needs
        every request's exact tokens, so it drains first (rare: a bubble)."""
        while True:
            reqs = self._decodable()
            if not reqs:
                return None
            out = self.alloc(reqs)
            if out is not None:
                self.reserve.decay()
                return DecodePlan(reqs, out)
            if not drain():
                self._retract(self._victim())

    def _decodable(self) -> list[Req]:
        """Running requests that may need another token: not those whose in-flight token is already
        their last (max_tokens or the context limit); they finish when that batch is processed."""
        return [
            r
            for r in self.queues.running
            if r.sampled < r.params.max_tokens and len(r.prompt_ids) + r.sampled < self.max_context
        ]

    def _victim(self) -> Req:
        """The running request with least progress, else the chunked one."""
        q = self.queues
        if len(q.running) > 1:
            return min(q.running, key=lambda r: (len(r.output_ids), -len(r.prompt_ids)))
        if q.chunked is not None:
            return q.chunked
        # cannot happen: max_context is capped so that one request always fits the pool
        raise RuntimeError("KV pool cannot hold a single request")

    def _retract(self, victim: Req) -> None:
        """Send a request back to the waiting queue; its computed KV stays in the prefix cache, so
        resuming it recomputes little, and it resumes with the same output."""
        q = self.queues
        q.remove(victim)
        self.kv.release(victim)
        victim.sampled = len(victim.output_ids)
        victim.status = ReqStatus.WAITING
        q.waiting.append(victim)
        self.stats.retractions += 1
        self.reserve.after_retraction(q.running)
        log.debug("retracted %s; new_token_ratio=%.3f", victim.rid, self.reserve.ratio)
