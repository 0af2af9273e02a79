"""The scheduler: owns every request's host state and decides what the device runs next.

One step (`step`), the same code for both loops:
  1. `schedule()` – prefill/extend first (admission under a token and a KV budget), else decode;
                    retract decode requests when KV runs out;
  2. `launch()`   – hand the built `ForwardBatch` to the device stream, without waiting;
  3. `process()`  – wait for a launched batch's tokens, append them, check stops, free or cache KV.
The plain loop processes the batch it just launched. The overlap loop processes the previous one, so
the host's work for batch N-1 and N+1 hides under the device's work on batch N.

What makes overlap correct:
- Host state moves at schedule time (kv_len, running/prefill status, `sampled`), so batch N+1 can be
  built while N's tokens are unknown; a decode's input is the device's future-token slot of its row.
- A request counts the launched, unprocessed batches that hold it (`inflight`). It can finish (stop,
  abort, length) while a batch still holds it: its KV and row are then released exactly once, when
  that last batch is processed, and the token that batch sampled for it is dropped.
- Retraction needs exact host state, so it first drains the in-flight batch (rare: a bubble).

KV ownership (see gapless.memory.prefix_cache): a request holds slots for positions [0, kv_len) in its
request-table row; [0, cached_len) of them belong to the radix tree, pinned through `last_node`.
Finished and retracted requests give their KV back in exactly one place: `_release`.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from gapless.config import EngineConfig
from gapless.engine.batch import ForwardBatch
from gapless.engine.detokenize import StopStrings, TokenDecoder
from gapless.engine.meter import BubbleMeter
from gapless.engine.request import Req, ReqStatus
from gapless.engine.stream import Chaos, DeviceStream, Pending
from gapless.memory.allocator import PageAllocator
from gapless.memory.integrity import check_integrity
from gapless.memory.prefix_cache import alloc_pages, cache_finished, cache_unfinished
from gapless.memory.radix_cache import NoPrefixCache, RadixCache
from gapless.memory.req_table import ReqTable
from gapless.sampling.sampler import HostSamples, SamplingBatch

log = logging.getLogger(__name__)

CLIP_MAX_NEW_TOKENS = 4096  # cap on the per-request decode reservation, as SGLang does
RETRACT_DECODE_STEPS = 20  # after a retraction, reserve at least this many steps for each running request
LPM_MAX_QUEUE = 128  # beyond this, matching every waiting prompt costs more than it saves: fall back to fcfs


@dataclass
class EngineStats:
    steps: int = 0
    prefill_batches: int = 0
    decode_batches: int = 0
    prompt_tokens: int = 0  # tokens computed in extend batches
    cached_prompt_tokens: int = 0  # prompt tokens served from the radix cache
    generated_tokens: int = 0
    retractions: int = 0
    dropped_tokens: int = 0  # sampled for a request that had finished while the batch was in flight
    finished: dict[str, int] = field(default_factory=dict)


@dataclass
class ScheduledBatch:
    """Host view of a launched batch: which requests, and which of them sample a token."""

    reqs: list[Req]
    samples: list[bool]  # False for a non-final chunk of a chunked prefill
    kv_after: list[int]  # each request's kv_len once this batch has run
    forward: ForwardBatch
    is_decode: bool


class Scheduler:
    def __init__(self, cfg: EngineConfig, stream: DeviceStream, tokenizer: TokenDecoder) -> None:
        info = stream.info
        self.cfg = cfg
        self.stream = stream
        self.overlap = cfg.overlap
        self.page_size = cfg.page_size
        self.max_context = info.max_context
        self.vocab_size = info.vocab_size
        self.req_table = ReqTable(cfg.max_running_requests, info.max_context, device=None)  # host mirror
        self.allocator = PageAllocator(info.num_pages, cfg.page_size)
        self.cache: RadixCache | NoPrefixCache = (
            RadixCache(self.allocator, cfg.page_size)
            if cfg.radix_cache
            else NoPrefixCache(self.allocator, cfg.page_size)
        )
        self.stop_strings = StopStrings(tokenizer)
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked: Req | None = None  # the one request whose prompt is being prefilled in chunks
        self.inflight: deque[tuple[ScheduledBatch, Pending]] = deque()
        self.new_token_ratio = cfg.init_new_token_ratio
        self._ratio_decay = (
            cfg.init_new_token_ratio - cfg.min_new_token_ratio
        ) / cfg.new_token_ratio_decay_steps
        self._table_writes: list[tuple[int, int, torch.Tensor]] = []  # (row, start, slots) for the next batch
        self._penalty_inits: list[tuple[int, list[int], list[int]]] = []  # rows to (re)build, next batch
        self._drained: list[Req] = []  # updates of batches processed early (retraction drains)
        self.chaos = Chaos(cfg.chaos_seed + 2) if cfg.chaos_seed is not None else None
        self.meter = BubbleMeter(keep_trace=cfg.trace_path is not None)
        self.stats = EngineStats()

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[Req]:
        """One iteration of the loop; returns the requests that got a token or finished."""
        t0 = time.perf_counter()
        if self.chaos:
            self.chaos.delay()
        updated = self.abort_pending()
        batch = self.schedule()  # (a retraction's drain, rare, lands in this span too)
        t1 = time.perf_counter()
        self.meter.host_span("schedule", t0, t1)
        if batch is not None:
            self.launch(batch)
            if self.stream.asynchronous:  # an inline stream's launch is the device job itself
                self.meter.host_span("launch", t1, time.perf_counter())
        keep = 1 if self.overlap and batch is not None else 0
        while len(self.inflight) > keep:
            updated += self._process_oldest()
        updated += self._drained
        self._drained = []
        self.meter.step_done()
        if not self.has_work():
            self.meter.went_idle()
        return updated

    def launch(self, batch: ScheduledBatch) -> None:
        for req in batch.reqs:
            req.inflight += 1
        self.inflight.append((batch, self.stream.submit(batch.forward)))

    def _process_oldest(self) -> list[Req]:
        batch, pending = self.inflight.popleft()
        tokens, timing = pending.result()
        t0 = time.perf_counter()
        self.meter.job("decode" if batch.is_decode else "extend", timing.start, timing.end)
        if self.chaos:
            self.chaos.delay()
        updated = self.process(batch, tokens)
        self.meter.host_span("process", t0, time.perf_counter())
        return updated

    def drain(self) -> None:
        """Process every launched batch now (their updates are returned by the current step)."""
        while self.inflight:
            self._drained += self._process_oldest()

    # ------------------------------------------------------------------ queue
    def add(self, req: Req) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked or self.inflight)

    def abort_pending(self) -> list[Req]:
        """Finish every request marked `aborted`, wherever it is; returns them. One still held by an
        in-flight batch gives its KV back when that batch is processed."""
        aborted = [r for r in self.waiting + self.running if r.aborted]
        if self.chunked is not None and self.chunked.aborted:
            aborted.append(self.chunked)
        for req in aborted:
            self._finish(req, "abort")
        return aborted

    # ------------------------------------------------------------------ scheduling
    def schedule(self) -> ScheduledBatch | None:
        batch = self._schedule_extend()
        if batch is None and self.running:
            batch = self._schedule_decode()
        return batch

    def _reserve(self, req: Req) -> int:
        """KV tokens kept back for a running request's future decode steps (estimated, adaptive)."""
        return int(min(req.remaining_tokens(self.max_context), CLIP_MAX_NEW_TOKENS) * self.new_token_ratio)

    def _pages(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def _available_tokens(self) -> int:
        return self.allocator.num_free_tokens + self.cache.evictable_size

    def _order_waiting(self) -> list[Req]:
        if self.cfg.schedule_policy == "lpm" and len(self.waiting) <= LPM_MAX_QUEUE and self.cfg.radix_cache:
            hits = {id(r): self.cache.match_prefix(self._match_key(r)).length for r in self.waiting}
            return sorted(self.waiting, key=lambda r: (-hits[id(r)], r.arrival))
        return sorted(self.waiting, key=lambda r: r.arrival)

    @staticmethod
    def _match_key(req: Req) -> list[int]:
        # the last token is always computed, so its logits exist to sample from
        return req.fill_ids[:-1]

    def _schedule_extend(self) -> ScheduledBatch | None:
        if self.chunked is None and not self.waiting:
            return None
        budget = self.cfg.chunked_prefill_size
        reserved = sum(self._reserve(r) for r in self.running)
        entries: list[tuple[Req, int]] = []
        slots: list[torch.Tensor] = []

        if self.chunked is not None:
            req = self.chunked
            rest = req.seq_len - req.kv_len
            n = min(rest, budget)
            if self._fits(
                self._pages(n) * self.page_size, self._reserve(req) if n == rest else 0, reserved, idle=True
            ):
                slots.append(self._alloc_extend(req, n))
                entries.append((req, n))
                budget -= n
                if n == rest:
                    self.chunked = None
                    self._start_decoding(req)
        if self.chunked is None and not entries:
            for req in self._order_waiting():
                # admitted requests count at once: they join `running` (or become `chunked`) here
                if budget <= 0 or self._num_active() >= self.cfg.max_running_requests:
                    break
                if self.req_table.num_free == 0:
                    break
                match = self.cache.match_prefix(self._match_key(req))
                self.cache.lock(match.node)
                ext = req.seq_len - match.length
                n = min(ext, budget)
                own_reserve = self._reserve(req) if n == ext else 0
                if not self._fits(self._pages(n) * self.page_size, own_reserve, reserved, idle=not entries):
                    self.cache.unlock(match.node)
                    break
                self._admit(req, match)
                slots.append(self._alloc_extend(req, n))
                entries.append((req, n))
                budget -= n
                self.waiting.remove(req)
                if n < ext:
                    req.status = ReqStatus.PREFILL
                    self.chunked = req
                    break
                self._start_decoding(req)
                reserved += own_reserve
        if not entries:
            return None
        return self._build(entries, torch.cat(slots), is_decode=False)

    def _start_decoding(self, req: Req) -> None:
        """Its prompt is fully scheduled: it decodes from the next batch on, reading its first token
        from the future-token slot that this batch's sampler fills."""
        req.status = ReqStatus.RUNNING
        self.running.append(req)

    def _fits(self, tokens: int, own_reserve: int, reserved: int, idle: bool) -> bool:
        """Whether `tokens` new KV slots fit beside the decode reservations. The reservations are estimates:
        when nothing else runs, the request only needs its own slots (retraction covers a wrong guess),
        so an estimate can never stall an idle engine."""
        avail = self._available_tokens()
        if idle and not self.running:
            return tokens <= avail
        return tokens + own_reserve + reserved <= avail

    def _num_active(self) -> int:
        return len(self.running) + (1 if self.chunked is not None else 0)

    def _admit(self, req: Req, match) -> None:
        row = self.req_table.alloc()
        assert row is not None
        req.row, req.last_node = row, match.node
        req.cached_len = req.kv_len = match.length
        if req.cached_tokens is None:
            req.cached_tokens = match.length
            self.stats.cached_prompt_tokens += match.length
        if match.length:
            self._write_table(row, 0, match.slots)
        if req.params.has_penalties:
            self._penalty_inits.append(
                (row, list(req.prompt_ids), list(req.output_ids))
            )  # copies: see #8056 test

    def _write_table(self, row: int, start: int, slots: torch.Tensor) -> None:
        """Host mirror now; the device table in stream order, with the next launched batch."""
        self.req_table.write_host(row, start, slots)
        self._table_writes.append((row, start, slots))

    def _alloc_pages(self, n: int) -> torch.Tensor:
        pages = alloc_pages(self.allocator, self.cache, n)  # evicts unlocked cache leaves as needed
        assert pages is not None, "scheduler admitted more KV than the pool holds"
        return pages

    def _alloc_extend(self, req: Req, n: int) -> torch.Tensor:
        """Slots for positions [kv_len, kv_len + n) of `req`, written to its row's host mirror."""
        start, ps = req.kv_len, self.page_size
        parts = []
        in_page = min(n, (-start) % ps)  # room left in the request's last, partly filled page
        if in_page:
            last = int(self.req_table.host_table[req.row, start - 1])
            parts.append(torch.arange(last + 1, last + 1 + in_page, dtype=torch.int64))
        rest = n - in_page
        if rest:
            parts.append(self.allocator.page_slots(self._alloc_pages(self._pages(rest)))[:rest])
        slots = torch.cat(parts) if len(parts) > 1 else parts[0]
        self.req_table.write_host(req.row, start, slots)
        req.kv_len += n
        return slots

    def _decodable(self) -> list[Req]:
        """Running requests that may need another token: not those whose in-flight token is already
        their last (max_tokens or the context limit); they finish when that batch is processed."""
        return [
            r
            for r in self.running
            if r.sampled < r.params.max_tokens and len(r.prompt_ids) + r.sampled < self.max_context
        ]

    def _schedule_decode(self) -> ScheduledBatch | None:
        ps = self.page_size
        while True:
            reqs = self._decodable()
            if not reqs:
                return None
            kv_lens = torch.tensor([r.kv_len for r in reqs], dtype=torch.int64)
            needs_page = kv_lens % ps == 0
            need = int(needs_page.sum())
            if need <= self.allocator.num_free_pages + self.cache.evictable_size // ps:
                break
            if self.inflight:  # retraction needs every request's exact tokens: process what is in flight
                self.drain()
            elif len(self.running) > 1:
                self._retract(min(self.running, key=lambda r: (len(r.output_ids), -len(r.prompt_ids))))
            elif self.chunked is not None:
                self._retract(self.chunked)
            else:  # cannot happen: max_context is capped so that one request always fits the pool
                raise RuntimeError("KV pool cannot hold a single request")
        rows = torch.tensor([r.row for r in reqs], dtype=torch.int64)
        out = torch.empty(len(reqs), dtype=torch.int64)
        if need:
            out[needs_page] = self._alloc_pages(need) * ps
        if need < len(reqs):
            partial = ~needs_page
            out[partial] = self.req_table.host_table[rows[partial], kv_lens[partial] - 1].long() + 1
        self.req_table.host_table[rows, kv_lens] = out.to(torch.int32)
        for r in reqs:
            r.kv_len += 1
        self.new_token_ratio = max(self.cfg.min_new_token_ratio, self.new_token_ratio - self._ratio_decay)
        return self._build([(r, 1) for r in reqs], out, is_decode=True)

    def _retract(self, victim: Req) -> None:
        """Send a request (the one with the least progress) back to the waiting queue; its computed KV
        stays in the prefix cache, so resuming it recomputes little."""
        if victim is self.chunked:
            self.chunked = None
        else:
            self.running.remove(victim)
        self._release(victim)
        victim.sampled = len(victim.output_ids)
        victim.status = ReqStatus.WAITING
        self.waiting.append(victim)
        self.stats.retractions += 1
        total_out = sum(len(r.output_ids) for r in self.running)
        total_max = sum(r.params.max_tokens for r in self.running) or 1
        estimate = (total_out + RETRACT_DECODE_STEPS * len(self.running)) / total_max
        self.new_token_ratio = min(1.0, max(self.new_token_ratio, estimate))
        log.debug("retracted %s; new_token_ratio=%.3f", victim.rid, self.new_token_ratio)

    def _build(
        self, entries: list[tuple[Req, int]], out_slots: torch.Tensor, is_decode: bool
    ) -> ScheduledBatch:
        """Bulk-build the device inputs of a batch from host state (no per-token Python)."""
        reqs = [r for r, _ in entries]
        ext = torch.tensor([n for _, n in entries], dtype=torch.int64)
        pre = torch.tensor([r.kv_len - n for r, n in entries], dtype=torch.int64)
        rows = torch.tensor([r.row for r in reqs], dtype=torch.int64)
        q_start = torch.cumsum(ext, 0) - ext
        total = int(ext.sum())
        if is_decode:
            input_ids: list[int] = []  # the device reads each row's future-token slot
            positions, token_rows = pre, rows
        else:
            input_ids = [t for r, n in entries for t in r.fill_ids[r.kv_len - n : r.kv_len]]
            token_rows = torch.repeat_interleave(rows, ext)
            positions = torch.arange(total) - torch.repeat_interleave(q_start - pre, ext)
        # the whole sequence is in KV once this batch runs: sample its next token
        samples = [r.kv_len == len(r.prompt_ids) + r.sampled for r in reqs]
        sample_reqs = [r for r, s in zip(reqs, samples) if s]
        sample_mask = torch.tensor(samples, dtype=torch.bool)
        sample_index = (q_start + ext - 1)[sample_mask]
        table_writes = None
        if self._table_writes:
            w_rows = torch.cat(
                [torch.full((len(s),), row, dtype=torch.int64) for row, _, s in self._table_writes]
            )
            w_pos = torch.cat([torch.arange(start, start + len(s)) for _, start, s in self._table_writes])
            w_slots = torch.cat([s for _, _, s in self._table_writes])
            table_writes = (w_rows, w_pos, w_slots)
            self._table_writes = []
        penalty_inits, self._penalty_inits = self._penalty_inits, []
        sampling = None
        if sample_reqs:
            sampling = SamplingBatch.build(
                [r.params for r in sample_reqs],
                [r.sampled for r in sample_reqs],  # counts tokens still in flight
                [r.row for r in sample_reqs],
                [r.seed for r in sample_reqs],
                "cpu",  # the stream moves the whole batch to the device
                vocab_size=self.vocab_size,
            )
            for r in sample_reqs:
                r.sampled += 1
        fwd = ForwardBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.int64),
            positions=positions,
            out_slots=out_slots,
            token_rows=token_rows,
            rows=rows,
            prefix_lens=pre,
            extend_lens=ext,
            q_start=q_start,
            max_extend_len=int(ext.max()),
            max_seq_len=int((pre + ext).max()),
            is_decode=is_decode,
            sample_index=sample_index,
            sample_rows=rows[sample_mask],
            sampling=sampling,
            table_writes=table_writes,
            penalty_inits=penalty_inits,
        )
        if is_decode:
            self.stats.decode_batches += 1
        else:
            self.stats.prefill_batches += 1
            self.stats.prompt_tokens += total
        return ScheduledBatch(reqs, samples, [r.kv_len for r in reqs], fwd, is_decode)

    # ------------------------------------------------------------------ results
    def process(self, batch: ScheduledBatch, samples: HostSamples) -> list[Req]:
        """Fold a processed batch's sampled tokens into request state; returns the requests that got a
        token or finished. A request that finished while the batch was in flight gets no token from it."""
        self.stats.steps += 1
        touched = []
        i = -1  # index of the request's sample in `samples`
        for req, sampled, kv_after in zip(batch.reqs, batch.samples, batch.kv_after):
            req.inflight -= 1
            i += sampled
            tok = samples.tokens[i] if sampled else None
            if req.finished:
                self.stats.dropped_tokens += tok is not None
                self._maybe_release(req)
                continue
            if tok is None:  # a non-final chunk: its KV enters the cache now that the forward wrote it
                self._cache_chunk(req, kv_after)
                continue
            req.output_ids.append(tok)
            if req.params.logprobs is not None and samples.logprobs is not None:
                req.output_logprobs.append(samples.logprobs[i])
                req.output_top_logprobs.append(samples.top[i][: req.params.logprobs])
            self.stats.generated_tokens += 1
            touched.append(req)
            reason = self._stop_reason(req, tok)
            if reason is not None:
                self._finish(req, reason)
        return touched

    def _cache_chunk(self, req: Req, kv_done: int) -> None:
        """Share the prompt prefix a processed chunk completed (only KV a finished forward wrote)."""
        slots = self.req_table.host_table[req.row, :kv_done].long()
        prefix, node, cached_len = cache_unfinished(
            self.cache, self.allocator, req.fill_ids[:kv_done], slots, req.last_node, req.cached_len
        )
        if cached_len > req.cached_len:
            # the tree may hold other slots for this span (another request inserted it first): read those
            new = prefix[req.cached_len : cached_len]
            if not torch.equal(new, slots[req.cached_len : cached_len]):
                self._write_table(req.row, req.cached_len, new)
        req.last_node, req.cached_len = node, cached_len

    def _stop_reason(self, req: Req, tok: int) -> str | None:
        p = req.params
        at_length = len(req.output_ids) >= p.max_tokens or req.seq_len >= self.max_context
        if p.stop:  # the stop rule (gapless.engine.stop), as the output text and the stream apply it
            req.stop_str_hit = self.stop_strings.check(req, tok, last=tok in req.stop_ids or at_length)
            if req.stop_str_hit is not None:
                return "stop"
        if tok in req.stop_ids:
            return "stop"
        return "length" if at_length else None

    def _finish(self, req: Req, reason: str) -> None:
        if req.status is ReqStatus.RUNNING:
            self.running.remove(req)
        elif req.status is ReqStatus.WAITING:
            self.waiting.remove(req)
        if self.chunked is req:
            self.chunked = None
        req.status = ReqStatus.FINISHED
        req.finish_reason = reason
        self.stats.finished[reason] = self.stats.finished.get(reason, 0) + 1
        self._maybe_release(req)

    def _maybe_release(self, req: Req) -> None:
        """Release a finished request's KV once no launched batch still uses it (exactly once)."""
        if req.row is not None and req.inflight == 0:
            self._release(req)

    def _release(self, req: Req) -> None:
        """Give back a request's KV (into the prefix cache where it can be reused) and its table row."""
        slots = self.req_table.host_table[req.row, : req.kv_len].long()
        cache_finished(
            self.cache, self.allocator, req.fill_ids[: req.kv_len], slots, req.last_node, req.cached_len
        )
        self.req_table.free(req.row)
        req.row, req.last_node, req.kv_len, req.cached_len = None, None, 0, 0

    # ------------------------------------------------------------------ checks
    def check_integrity(self) -> None:
        """After a workload drains: every KV page free or in the tree, nothing locked, every row free."""
        assert not self.has_work(), "requests still pending"
        check_integrity(self.allocator, self.cache, self.req_table)
