"""Admission and prefill: which waiting requests start, and how much of their prompts this batch computes.

An extend batch continues the chunked request first, else admits waiting requests in policy order
(`lpm`: longest cached prefix first; `fcfs`), under two budgets: a token budget per batch
(`chunked_prefill_size`; a longer prompt is prefilled in chunks, one chunked request at a time, never
ending a chunk inside an image whose tokens attend both ways: `images.chunk_tokens`) and a KV budget
that keeps back the running requests' decode reservation (`DecodeReserve`). Where the token budget is
the longest prompt (`max_model_len`, as SGLang's `--chunked-prefill-size -1` sets both), no prompt is
chunked: one that does not fit what a batch has left waits for the next.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from gapless.config import EngineConfig
from gapless.engine.batch import PenaltyInit
from gapless.engine.images import chunk_tokens
from gapless.engine.request import Extend, Req, ReqStatus
from gapless.engine.scheduler.budget import DecodeReserve
from gapless.engine.scheduler.kv import KVManager
from gapless.engine.scheduler.queues import Queues
from gapless.engine.stats import EngineStats
from gapless.lora.slots import SlotAssigner
from gapless.memory.cache_base import MatchResult

LPM_MAX_QUEUE = 128  # beyond this, matching every waiting prompt costs more than it saves: fall back to fcfs


@dataclass
class ExtendPlan:
    """An extend batch being filled: what each request computes, and the budgets left."""

    token_budget: int
    reserved: int  # KV kept back for the decode steps of the running requests
    entries: list[Extend] = field(default_factory=list)  # (request, tokens it computes)
    slots: list[torch.Tensor] = field(default_factory=list)  # their new tokens' KV slots
    # admitted requests with penalties: their sampler state is built before this batch samples
    penalty_inits: list[PenaltyInit] = field(default_factory=list)
    admitted: list[Req] = field(default_factory=list)  # requests that enter their rows in this batch

    def add(self, req: Req, slots: torch.Tensor) -> None:
        self.entries.append(Extend(req, len(slots)))
        self.slots.append(slots)
        self.token_budget -= len(slots)

    @property
    def num_tokens(self) -> int:
        return sum(e.tokens for e in self.entries)


class PrefillPlanner:
    """Plans extend batches: the chunked request's next chunk, else admissions, under the budgets."""

    def __init__(
        self,
        cfg: EngineConfig,
        queues: Queues,
        kv: KVManager,
        reserve: DecodeReserve,
        stats: EngineStats,
        lora: SlotAssigner | None = None,
    ) -> None:
        self.cfg, self.queues, self.kv, self.reserve, self.stats = cfg, queues, kv, reserve, stats
        self.lora = lora  # LoRA: admit no more distinct adapters than the device holds at once

    def schedule(self) -> ExtendPlan | None:
        """The next extend batch, or None if nothing can be prefilled now."""
        q = self.queues
        if q.chunked is None and not self._may_admit():
            return None
        budget = self.cfg.chunked_prefill_size
        assert budget is not None, "the engine sets the prefill budget (its device's) before scheduling"
        plan = ExtendPlan(budget, self.reserve.total(q.running))
        if q.chunked is not None:
            self._continue_chunked(plan, q.chunked)
        if q.chunked is None and not plan.entries:
            self._admit_waiting(plan)
        return plan if plan.entries else None

    def _continue_chunked(self, plan: ExtendPlan, req: Req) -> None:
        rest = req.seq_len - req.kv_len
        n = chunk_tokens(req.images, req.kv_len, min(rest, plan.token_budget))
        own_reserve = self.reserve.tokens(req) if n == rest else 0
        if not self._fits(n, own_reserve, plan.reserved, alone=not self.queues.running):
            return
        plan.add(req, self.kv.alloc_extend(req, n))
        if n == rest:
            self.queues.chunked = None
            self.queues.prompt_scheduled(req)

    def _may_admit(self) -> bool:
        """Whether a waiting request could take a row now: one waits, and the running set and the request
        table have room. Checked before the work per request of planning an admission (the running
        requests' reservation summed, the queue ordered), which an engine running its most requests
        with more waiting would otherwise redo every step to admit none."""
        q = self.queues
        return (
            bool(q.waiting)
            and q.num_active() < self.cfg.max_running_requests
            and self.kv.req_table.num_free > 0
        )

    def _admit_waiting(self, plan: ExtendPlan) -> None:
        q = self.queues
        for req in self._order_waiting():
            # admitted requests count at once: they join `running` (or become `chunked`) here
            if plan.token_budget <= 0 or q.num_active() >= self.cfg.max_running_requests:
                break
            if self.kv.req_table.num_free == 0:
                break
            if self.lora is not None and not self.lora.admits(req.lora, self._active_loras()):
                continue  # its adapter waits for a slot; requests of resident adapters go first
            match = self.kv.lock_prefix(req)
            ext = req.seq_len - match.length
            n = chunk_tokens(req.images, match.length, min(ext, plan.token_budget))
            own_reserve = self.reserve.tokens(req) if n == ext else 0
            waits = n < ext and bool(plan.entries) and self._whole_prompts()  # (for a batch of its own)
            alone = not plan.entries and not q.running
            if waits or not self._fits(n, own_reserve, plan.reserved, alone=alone):
                self.kv.unlock(match.node)
                break
            self._admit(plan, req, match)
            plan.add(req, self.kv.alloc_extend(req, n))
            q.waiting.remove(req)
            if n < ext:
                req.status = ReqStatus.PREFILL
                q.chunked = req
                break
            q.prompt_scheduled(req)
            plan.reserved += own_reserve

    def _whole_prompts(self) -> bool:
        """Whether the token budget is the longest prompt (no chunking asked for), so that none is chunked."""
        return self.cfg.chunked_prefill_size == self.cfg.max_model_len

    def _active_loras(self) -> list:
        """The adapters of the requests that hold rows."""
        q = self.queues
        return [r.lora for r in q.running] + ([q.chunked.lora] if q.chunked is not None else [])

    def _order_waiting(self) -> list[Req]:
        waiting = self.queues.waiting
        if self.cfg.schedule_policy == "lpm" and len(waiting) <= LPM_MAX_QUEUE and self.cfg.radix_cache:
            hits = {id(r): self.kv.prefix_len(r) for r in waiting}
            return sorted(waiting, key=lambda r: (-hits[id(r)], r.arrival))
        return sorted(waiting, key=lambda r: r.arrival)

    def _fits(self, n: int, own_reserve: int, reserved: int, alone: bool) -> bool:
        """Whether `n` new tokens' KV (in whole pages) fits beside the decode reservations. These are
        estimates: a request with nothing else running only needs its own slots (retraction covers a
        wrong guess), so an estimate can never stall an idle engine."""
        tokens, avail = self.kv.pages(n) * self.kv.page_size, self.kv.available_tokens()
        if alone:
            return tokens <= avail
        return tokens + own_reserve + reserved <= avail

    def _admit(self, plan: ExtendPlan, req: Req, match: MatchResult) -> None:
        row = self.kv.admit(req, match)
        plan.admitted.append(req)
        if req.cached_tokens is None:  # its first admission (not a retracted request's return)
            req.cached_tokens = match.length
            self.stats.cached_prompt_tokens += match.length
        if req.params.has_penalties:
            plan.penalty_inits.append(PenaltyInit(row, list(req.prompt_ids), list(req.output_ids)))
