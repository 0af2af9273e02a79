"""The scheduler: owns every request's host state and decides what the device runs next.

One step (`step`), the same code for both loops:
  1. `schedule()` – prefill/extend first (admission under a token and a KV budget), else decode;
                    retract decode requests when KV runs out;
  2. `launch()`   – hand the built `ForwardBatch` to the device stream, without waiting;
  3. process      – wait for a launched batch's tokens, append them, check stops, free or cache KV.
The plain loop processes the batch it just launched. The overlap loop processes the previous one, so
the host's work for batch N-1 and N+1 hides under the device's work on batch N.

What makes overlap correct:
- Host state moves at schedule time (kv_len, running/prefill status, `sampled`), so batch N+1 can be
  built while N's tokens are unknown; a decode's input is the device's future-token slot of its row.
- A request counts the launched, unprocessed batches that hold it (`inflight`). It can finish (stop,
  abort, length) while a batch still holds it: its KV and row are then released exactly once, when
  that last batch is processed, and the token that batch sampled for it is dropped.
- Retraction needs exact host state, so it first drains the in-flight batch (rare: a bubble).

Split by job: `prefill` (admission, budgets, chunking), `decode` (decode batches, retraction), `kv`
(the one place KV is taken and given back), `build` (the `ForwardBatch` from host state), `results`
(tokens, stops, the end of a request); `queues` and `budget` hold the state they share.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import NamedTuple

import torch

from gapless.config import EngineConfig
from gapless.engine.detokenize import TokenDecoder
from gapless.engine.meter import BubbleMeter
from gapless.engine.request import Req
from gapless.engine.scheduler import masks
from gapless.engine.scheduler.budget import DecodeReserve
from gapless.engine.scheduler.build import BatchBuilder, ScheduledBatch
from gapless.engine.scheduler.decode import DecodePlanner
from gapless.engine.scheduler.kv import KVManager
from gapless.engine.scheduler.prefill import PrefillPlanner
from gapless.engine.scheduler.queues import Queues
from gapless.engine.scheduler.results import ResultProcessor
from gapless.engine.scheduler.verify import SpecDecode
from gapless.engine.scheduler.verify_results import VerifyResultProcessor
from gapless.engine.scheduler.window import freeing_window
from gapless.engine.stats import EngineStats
from gapless.engine.stream import DeviceStream, Pending
from gapless.lora.slots import SlotAssigner
from gapless.memory.allocator import PageAllocator
from gapless.memory.cache_base import NoPrefixCache, PrefixCache
from gapless.memory.radix_cache import RadixCache
from gapless.memory.req_table import ReqTable

__all__ = ["EngineStats", "ScheduledBatch", "Scheduler"]

log = logging.getLogger(__name__)  # at debug: each batch it schedules


class Launched(NamedTuple):
    """A batch in flight: the host's view of it, and the device job's result to come."""

    batch: ScheduledBatch
    pending: Pending


class Scheduler:
    def __init__(self, cfg: EngineConfig, stream: DeviceStream, tokenizer: TokenDecoder) -> None:
        """`tokenizer` decodes output tokens for stop strings (gapless.engine.stop)."""
        info = stream.info
        self.stream = stream
        self.overlap = cfg.overlap
        speculative = cfg.speculative_algorithm is not None
        lora = SlotAssigner(cfg.max_loras) if cfg.enable_lora else None
        self.builder = BatchBuilder(
            cfg.max_running_requests, info.vocab_size, enters_history=speculative, lora=lora
        )
        # host-side memory: the request table's mirror, the page allocator and the prefix cache
        self.req_table = ReqTable(cfg.max_running_requests, info.max_context, device=None)
        self.allocator = PageAllocator(info.num_pages, cfg.page_size)
        cache_type = RadixCache if cfg.radix_cache else NoPrefixCache
        self.cache: PrefixCache = cache_type(self.allocator, cfg.page_size)
        window = freeing_window(info.sliding_window, info.window_layers, speculative)
        self.kv = KVManager(
            self.req_table, self.allocator, self.cache, takes_slots_ahead=speculative, window=window
        )
        self.queues = Queues()
        self.stats = EngineStats()
        self.meter = BubbleMeter(keep_trace=cfg.trace_path is not None, stats=self.stats)
        reserve = DecodeReserve(
            cfg, info.max_context, self.kv.window.reserve_cap() if self.kv.window else None
        )
        self.prefill_planner = PrefillPlanner(cfg, self.queues, self.kv, reserve, self.stats, lora)
        # speculative decoding: every decode is a verify batch (gapless.engine.scheduler.verify)
        self.spec = SpecDecode(cfg, self.kv, self.builder, info.max_context) if speculative else None
        alloc = self.kv.alloc_decode if self.spec is None else self.spec.alloc
        max_context = info.max_context
        self.decode_planner = DecodePlanner(self.queues, self.kv, reserve, self.stats, max_context, alloc)
        processor = ResultProcessor if self.spec is None else VerifyResultProcessor
        self.results = processor(self.queues, self.kv, self.stats, tokenizer, info.max_context)
        self.inflight: deque[Launched] = deque()
        self._drained: list[Req] = []  # updates of batches processed early (retraction drains)

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[Req]:
        """One iteration of the loop; returns the requests that got a token or finished."""
        with self.meter.span("schedule"):  # (a retraction's drain inside is `paused` out of it)
            updated = self.results.abort_pending()
            batch = self.schedule()
        if batch is not None:  # (an inline stream's launch is the device job itself: not host time)
            with self.meter.span("launch", record=self.stream.asynchronous):
                self.launch(batch)
        keep = 1 if self.overlap and batch is not None else 0
        while len(self.inflight) > keep:
            updated += self._process_oldest()
        updated, self._drained = updated + self._drained, []
        self.meter.step_done(None if batch is None else batch.kind, idle=not self.has_work())
        return updated

    def schedule(self) -> ScheduledBatch | None:
        """The next batch: prefill/extend first, else decode; None if nothing can run now."""
        extend = self.prefill_planner.schedule()
        if extend is not None:
            self.stats.prefill_batches += 1
            self.stats.prompt_tokens += extend.num_tokens
            log.debug(
                "prefill batch: %d requests, %d tokens (%d waiting)",
                len(extend.entries),
                extend.num_tokens,
                len(self.queues.waiting),
            )
            slots, writes = torch.cat(extend.slots), self.kv.take_table_writes()
            return self.builder.extend(extend.entries, slots, writes, extend.admitted, extend.penalty_inits)
        decode = self.decode_planner.schedule(self.drain) if self.queues.running else None
        if decode is None:
            return None
        self.stats.decode_batches += 1
        log.debug("decode batch: %d requests", len(decode.reqs))
        # (a drain inside may have queued table writes: they go with this batch)
        if self.spec is not None:
            return self.spec.batch(decode.reqs, decode.slots, self.kv.take_table_writes())
        return self.builder.decode(decode.reqs, decode.slots, self.kv.take_table_writes())

    def launch(self, batch: ScheduledBatch) -> None:
        pending = masks.launch(self.stream, batch.forward, batch.masked, self.builder.vocab_size)
        for req in batch.reqs:
            req.inflight += 1
        self.inflight.append(Launched(batch, pending))

    def _process_oldest(self) -> list[Req]:
        batch, pending = self.inflight.popleft()
        samples, timing = pending.result()  # the wait for the device: no span's
        with self.meter.span("process"):
            self.meter.job(batch.kind, timing.start, timing.end, timing.idle)
            updated = self.results.process(batch, samples)
            if self.inflight:  # the next batch's grammar masks can be filled now
                masks.release(self.inflight[0].pending)
        return updated

    def drain(self) -> bool:
        """Process every launched batch now (their updates are returned by the current step); False if
        none was in flight. Called while the step schedules: the schedule span stops here and goes on
        after, so the meter counts the wait for the device as none of the host's and the processing
        once, as "process"."""
        if not self.inflight:
            return False
        with self.meter.paused():
            while self.inflight:
                self._drained += self._process_oldest()
        return True

    # ------------------------------------------------------------------ queue
    def add(self, req: Req) -> None:
        self.queues.waiting.append(req)

    def has_work(self) -> bool:
        q = self.queues
        return bool(q.waiting or q.running or q.chunked or self.inflight)

    def check_integrity(self) -> None:
        """After a workload drains: every KV page free or in the tree, nothing locked, every row free."""
        assert not self.has_work(), "requests still pending"
        self.kv.check_integrity()
