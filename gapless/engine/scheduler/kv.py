"""KV accounting: the one place a request's KV slots and request-table row are taken and given back.

A request holds slots for positions [0, kv_len) in its request-table row; [0, cached_len) of them belong
to the radix tree, pinned through `last_node` (see gapless.memory.prefix_cache). Slots are taken at
admission (a matched prefix, then each extend chunk) and per decode step; a processed prefill chunk is
shared with the tree; a finished or retracted request gives everything back in `release`. The host
mirror of the request table changes here at once; the device table only through `take_table_writes`,
in stream order, with the next batch launched. For a model whose every layer slides, decode also gives
back the request's own KV that left the window (`gapless.engine.scheduler.window`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from gapless.engine import pooling
from gapless.engine.batch import TableWrites
from gapless.engine.prompt_logprobs import reuse_limit
from gapless.engine.request import Req
from gapless.engine.scheduler.window import WindowKV
from gapless.memory.allocator import PageAllocator
from gapless.memory.cache_base import MatchResult, PrefixCache, TreeNode, adapter_key
from gapless.memory.integrity import check_integrity, check_live
from gapless.memory.prefix_cache import (
    HeldKV,
    alloc_pages,
    cache_finished,
    cache_unfinished,
    release_uncached,
)
from gapless.memory.req_table import ReqTable


@dataclass
class DecodeSlots:
    """What a decode step took, per request: its row, the position of its new token (its kv_len before
    the step) and that token's KV slot."""

    rows: np.ndarray  # [B] int64
    positions: np.ndarray  # [B] int64
    out: np.ndarray  # [B] int64


def _match_key(req: Req) -> tuple[int, ...]:
    """The tokens the prefix cache may supply to `req`, as a tuple (what the cache keys by): built once per
    length and kept on the request, as ordering the waiting queue asks for it every step. Tokens are
    only ever appended, so a kept key of the same length is still the request's."""
    # the last token is always computed, so its logits exist to sample from; a request scoring its
    # prompt computes every position it scores (gapless.engine.prompt_logprobs), a pooling one every
    # position it pools (gapless.engine.pooling)
    limit = pooling.reuse_limit(req, reuse_limit(req))
    if req.match_key is None or req.match_key[0] != limit:
        req.match_key = (limit, tuple(adapter_key(req.cache_ids(limit), _adapter(req))))
    return req.match_key[1]


def _adapter(req: Req) -> int:
    """The LoRA adapter `req` runs with, as the prefix cache keys it (0: the base model)."""
    return 0 if req.lora is None else req.lora.lora_int_id


class KVManager:
    """Takes and gives back KV for requests, over the scheduler's allocator, prefix cache and host
    request table."""

    def __init__(
        self,
        req_table: ReqTable,
        allocator: PageAllocator,
        cache: PrefixCache,
        takes_slots_ahead: bool = False,
        window: int | None = None,
    ) -> None:
        """`window`: free what a request's decode leaves behind this sliding window (every layer slides;
        `gapless.engine.scheduler.window.freeing_window`); None keeps all of a request's KV."""
        # speculative decoding takes slots ahead (`alloc_runs`); only [0, seq_len - 1) of them is surely
        # written with the request's own tokens when it is released
        self.takes_slots_ahead = takes_slots_ahead
        self.req_table = req_table
        self.allocator = allocator
        self.cache = cache
        self.page_size = allocator.page_size
        self._host_table = req_table.host_table.numpy()  # the same memory, for numpy's cheaper indexing
        self._table_writes: list[tuple[int, int, torch.Tensor]] = []  # (row, start, slots) for the next batch
        self._bulk_writes: list[TableWrites] = []  # (rows, positions, slots) for the next batch
        self.window = WindowKV(window, allocator, self._host_table) if window is not None else None

    # ------------------------------------------------------------------ sizes
    def pages(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def available_tokens(self) -> int:
        """Free, or freeable by evicting unused cached prefixes."""
        return self.allocator.num_free_tokens + self.cache.evictable_size

    def usage(self) -> dict[str, int]:
        """The pool in tokens: total, free, cached (in the prefix cache, unused by any request:
        evictable) and used by requests."""
        total = self.allocator.num_usable_pages * self.page_size
        free, cached = self.allocator.num_free_tokens, self.cache.evictable_size
        return {
            "kv_total_tokens": total,
            "kv_free_tokens": free,
            "kv_cached_tokens": cached,
            "kv_used_tokens": total - free - cached,
        }

    # ------------------------------------------------------------------ admission
    def prefix_len(self, req: Req) -> int:
        """Cached prefix length of a waiting request, read only (for ordering the queue)."""
        return self.cache.prefix_len(_match_key(req))

    def lock_prefix(self, req: Req) -> MatchResult:
        """Match a waiting request's cached prefix and pin it, so that allocating cannot evict it."""
        match = self.cache.match_prefix(_match_key(req))
        self.cache.lock(match.node)
        return match

    def unlock(self, node: TreeNode) -> None:
        self.cache.unlock(node)

    def admit(self, req: Req, match: MatchResult) -> int:
        """Give `req` a request-table row that starts with its matched (and locked) prefix; returns it."""
        row = self.req_table.alloc()
        assert row is not None
        req.row, req.last_node = row, match.node
        req.cached_len = req.kv_len = match.length
        req.match_key = None  # kept for the waiting queue's order only
        if match.length:
            self._write_table(row, 0, match.slots)
        if self.window is not None:
            self.window.admit(row, match.length)
        return row

    def alloc_extend(self, req: Req, n: int) -> torch.Tensor:
        """Slots for positions [kv_len, kv_len + n) of `req`, written to its row's host mirror."""
        assert req.row is not None, "an extend of a request without a row"
        start, ps = req.kv_len, self.page_size
        parts = []
        in_page = min(n, (-start) % ps)  # room left in the request's last, partly filled page
        if in_page:
            last = int(self.req_table.host_table[req.row, start - 1])
            parts.append(torch.arange(last + 1, last + 1 + in_page, dtype=torch.int64))
        rest = n - in_page
        if rest:
            parts.append(self.allocator.page_slots(self._alloc_pages(self.pages(rest)))[:rest])
        slots = torch.cat(parts) if len(parts) > 1 else parts[0]
        self.req_table.write_host(req.row, start, slots)
        req.kv_len += n
        return slots

    # ------------------------------------------------------------------ decode
    def alloc_decode(self, reqs: list[Req]) -> DecodeSlots | None:
        """One slot per request for position kv_len (a new page where the last one is full), in bulk
        (numpy on the host: a few small arrays cost less there than as tensors); None, taking nothing, if
        the pool cannot give the pages even by evicting."""
        ps = self.page_size
        kv_lens = np.array([r.kv_len for r in reqs], dtype=np.int64)
        rows = np.array([r.row for r in reqs], dtype=np.int64)
        needs_page = kv_lens % ps == 0 if ps > 1 else None
        need = len(reqs) if needs_page is None else int(needs_page.sum())
        window = self.window
        behind = window.plan(rows, kv_lens) if window is not None else None
        freeable = behind.num_pages if behind is not None else 0
        if need > self.allocator.num_free_pages + self.cache.evictable_size // ps + freeable:
            return None
        if window is not None and behind is not None:  # freed once the step surely runs: writes go with it
            self._bulk_writes.append(window.free(behind))
        table = self._host_table
        if needs_page is None:  # page size 1: every token starts a page
            out = self._alloc_pages(need).numpy()
        else:
            out = np.empty(len(reqs), dtype=np.int64)
            if need:
                out[needs_page] = self._alloc_pages(need).numpy() * ps
            if need < len(reqs):
                partial = ~needs_page
                out[partial] = table[rows[partial], kv_lens[partial] - 1] + 1
        table[rows, kv_lens] = out
        for r in reqs:
            r.kv_len += 1
        return DecodeSlots(rows, kv_lens, out)

    def alloc_runs(self, reqs: list[Req], counts: np.ndarray) -> TableWrites | None:
        """`counts[i]` more slots for each request, positions [kv_len, kv_len + counts[i]) (speculative
        decoding takes them ahead: the device decides which it writes), in bulk; returns the new (rows,
        positions, slots) for the device table, or None, taking nothing, if the pool cannot give the
        pages even by evicting."""
        ps = self.page_size
        kv = np.array([r.kv_len for r in reqs], dtype=np.int64)
        rows = np.array([r.row for r in reqs], dtype=np.int64)
        ends = kv + counts
        filled = -(-kv // ps) * ps  # the end of each request's last, partly filled page
        need = int((-(-ends // ps) - filled // ps).sum())
        if need > self.allocator.num_free_pages + self.cache.evictable_size // ps:
            return None
        pages = self._alloc_pages(need).numpy() if need else np.empty(0, dtype=np.int64)
        owner = np.repeat(np.arange(len(reqs)), counts)
        pos = kv[owner] + np.arange(len(owner)) - np.repeat(np.cumsum(counts) - counts, counts)
        in_last = pos < filled[owner]  # continues the last page: one past the slot before it
        new_page = np.cumsum(~in_last & (pos % ps == 0)) - 1
        table, token_rows = self._host_table, rows[owner]
        slots = table[token_rows, np.maximum(kv[owner] - 1, 0)] + pos - kv[owner] + 1
        fresh = ~in_last
        slots[fresh] = pages[new_page[fresh]] * ps + pos[fresh] % ps
        table[token_rows, pos] = slots
        for r, end in zip(reqs, ends.tolist()):
            r.kv_len = end
        return TableWrites(torch.from_numpy(token_rows), torch.from_numpy(pos), torch.from_numpy(slots))

    def trim(self, req: Req, keep: int) -> None:
        """Give back the request's own pages past position `keep` (slots taken ahead for drafts that were
        rejected); it keeps [0, keep), the partly used page included."""
        if keep >= req.kv_len:
            return
        ps = self.page_size
        first = -(-keep // ps) * ps
        if first < req.kv_len:
            starts = np.arange(first, req.kv_len, ps)
            self.allocator.free(torch.from_numpy(self._host_table[req.row, starts] // ps))
        req.kv_len = keep

    # ------------------------------------------------------------------ results
    def cache_chunk(self, req: Req, kv_done: int) -> None:
        """Share the prompt prefix a processed chunk completed (only KV a finished forward wrote)."""
        held = self._held(req, kv_done)
        match = cache_unfinished(self.cache, self.allocator, held)
        prefix, node, cached_len = match.slots, match.node, match.length
        if cached_len > req.cached_len:
            # the tree may hold other slots for this span (another request inserted it first): read those
            new = prefix[req.cached_len : cached_len]
            if not torch.equal(new, held.slots[req.cached_len : cached_len]):
                assert req.row is not None  # `_held` checked it
                self._write_table(req.row, req.cached_len, new)
        if self.window is not None and req.row is not None:
            self.window.shared(req.row, req.cached_len, cached_len)
        req.last_node, req.cached_len = node, cached_len

    def release(self, req: Req) -> None:
        """Give back a request's KV (into the prefix cache where it can be reused) and its table row."""
        if self.takes_slots_ahead:  # the slots past its last token's position hold no KV of its own tokens
            self.trim(req, min(req.kv_len, req.seq_len - 1))
        assert req.row is not None and req.last_node is not None
        if self.window is not None and self.window.has_freed(req.row, req.cached_len):
            # its early KV is gone, so none of it can enter the tree: the tree keeps what it had
            own = self.req_table.host_table[req.row, int(self.window.live_from[req.row]) : req.kv_len].long()
            release_uncached(self.cache, self.allocator, req.last_node, own)
        else:
            cache_finished(self.cache, self.allocator, self._held(req, req.kv_len))
        self.req_table.free(req.row)
        req.row, req.last_node, req.kv_len, req.cached_len = None, None, 0, 0

    # ------------------------------------------------------------------ device table
    def take_table_writes(self) -> TableWrites | None:
        """The row entries the device table still lacks, for the next batch
        to apply in stream order: matched prefixes, chunks the tree answered with its own slots, and
        positions whose KV left the window (slot 0)."""
        writes, self._table_writes = self._table_writes, []
        bulk, self._bulk_writes = self._bulk_writes, []
        if not writes and not bulk:
            return None
        if not writes and len(bulk) == 1:
            return bulk[0]
        rows = [torch.full((len(s),), row, dtype=torch.int64) for row, _, s in writes] + [
            b.rows for b in bulk
        ]
        positions = [torch.arange(start, start + len(s)) for _, start, s in writes] + [
            b.positions for b in bulk
        ]
        slots = [s.to(torch.int64) for _, _, s in writes] + [b.slots for b in bulk]
        return TableWrites(torch.cat(rows), torch.cat(positions), torch.cat(slots))

    # ------------------------------------------------------------------ checks
    def check_integrity(self) -> None:
        """With no request left: every KV page free or in the tree, nothing locked, every row free."""
        check_integrity(self.allocator, self.cache, self.req_table)

    def check_live(self, reqs: list[Req]) -> None:
        """Between steps, with `reqs` every request holding a row: each page free, in the tree, or one
        request's own (`gapless.memory.integrity.check_live`)."""
        owned = []
        for r in reqs:
            assert r.row is not None
            start = r.cached_len if self.window is None else int(self.window.live_from[r.row])
            owned.append(self.req_table.host_table[r.row, start : r.kv_len].long())
        check_live(self.allocator, self.cache, owned)

    # ------------------------------------------------------------------ internals
    def _held(self, req: Req, n: int) -> HeldKV:
        """What `req` holds for its first `n` positions (host slots, copied out of the table)."""
        assert req.row is not None and req.last_node is not None
        slots = self.req_table.host_table[req.row, :n].long()
        return HeldKV(adapter_key(req.cache_ids(n), _adapter(req)), slots, req.last_node, req.cached_len)

    def _write_table(self, row: int, start: int, slots: torch.Tensor) -> None:
        """Host mirror now; the device table in stream order, with the next launched batch."""
        self.req_table.write_host(row, start, slots)
        self._table_writes.append((row, start, slots))

    def _alloc_pages(self, n: int) -> torch.Tensor:
        pages = alloc_pages(self.allocator, self.cache, n)  # evicts unlocked cache leaves as needed
        assert pages is not None, "scheduler admitted more KV than the pool holds"
        return pages
