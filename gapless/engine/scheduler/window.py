"""Freeing the KV that left the sliding window, for models whose every layer slides.

A sliding-window layer's query at position p reads keys at positions > p - window only, and a request's
queries only move forward. So once a request decodes at position p, its KV below p - window + 1 is never
read again by any layer, when every layer slides (Mistral, Mixtral and Phi-3 with a `sliding_window`;
Qwen2/Qwen3 with `use_sliding_window` on every layer). The whole pages of it that the request owns go
back to the pool as decoding advances, and the request-table entries of their positions point at slot 0
(the reserved page, see `gapless.memory.allocator`), so that no attention path, masked gathers included,
ever reads a slot another request now writes.

What stays: the prefix tree's pages (positions [0, cached_len) of a request, shared, pinned by its lock;
a prefix hit thus always finds every slot of its prefix), and the request's pages from the first one
that still holds a position inside the window. A model with global layers beside its window layers
(Gemma 2/3) frees nothing: its global layers read every position, and one slot holds a token's KV for
every layer (see the README's families section for what a second, window-only pool would take).

Under overlap the pages go back to the allocator when the batch that no longer reads them is scheduled,
while the batch in flight may still read them (its query is one position earlier). That is safe because
the device runs jobs in launch order (every stream is FIFO, `gapless.engine.stream`): any batch that
reuses a page is launched after, so it writes the page only once the batch in flight has finished with
it; and the zeroed table entries travel with the freeing batch's table writes, applied in stream order
before it runs. (Finished requests wait for their last batch for another reason: their tokens must be on
the host before their KV can enter the prefix tree.)

A request that freed part of its KV adds nothing to the prefix tree when it ends: a tree node needs the
KV of its whole prefix. A retracted one resumes by recomputing from its cached prefix, exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from gapless.engine.batch import TableWrites
from gapless.memory.allocator import PageAllocator


def freeing_window(
    sliding_window: int | None, window_layers: tuple[bool, ...], speculative: bool
) -> int | None:
    """The window behind which a request's KV can be freed, or None where none can: a layer without a
    window reads every position; speculative decoding takes slots ahead and trims them back
    (`KVManager.alloc_runs`, `trim`), which this bookkeeping does not follow."""
    if sliding_window is None or not window_layers or not all(window_layers) or speculative:
        return None
    return sliding_window


@dataclass
class FreePlan:
    """The pages one decode step can free: per page, its row, its first position and its id; per
    request that frees any, its row and the new start of what it keeps."""

    page_rows: np.ndarray
    page_pos: np.ndarray
    pages: np.ndarray
    rows: np.ndarray
    live_from: np.ndarray

    @property
    def num_pages(self) -> int:
        return len(self.pages)


class WindowKV:
    """Per request-table row, `live_from[row]`: the request's own KV at positions [cached_len,
    live_from) has been freed (page-aligned; equal to cached_len while nothing is). Host state only,
    moved by the scheduler; the device learns of it through the table writes `free` returns."""

    def __init__(self, window: int, allocator: PageAllocator, host_table: np.ndarray) -> None:
        if window < 1:
            raise ValueError(f"sliding window must be >= 1, got {window}")
        self.window = window
        self.allocator = allocator
        self.page_size = allocator.page_size
        self._table = host_table  # the request table's host mirror (numpy view of the same memory)
        self.live_from = np.zeros(host_table.shape[0], dtype=np.int64)

    def admit(self, row: int, cached_len: int) -> None:
        """A request entered `row` with a cached prefix of `cached_len` tokens: it has freed nothing."""
        self.live_from[row] = cached_len

    def shared(self, row: int, old_cached_len: int, cached_len: int) -> None:
        """A processed prefill chunk moved the tree's part of `row` from `old_cached_len` to `cached_len`.
        Only decode frees, after the last chunk, so nothing may be freed past the old tree part yet."""
        if self.live_from[row] > old_cached_len:
            raise RuntimeError(f"row {row} freed KV up to {self.live_from[row]} before its prompt was cached")
        self.live_from[row] = cached_len

    def has_freed(self, row: int, cached_len: int) -> bool:
        """Whether the request in `row` gave back any of its own KV (then its KV cannot enter the tree)."""
        return bool(self.live_from[row] > cached_len)

    def reserve_cap(self) -> int:
        """The most a running request's own KV can still grow, in tokens: past the window, each page it
        takes is paid for by one it frees, so it never holds more than the window plus two partly used
        pages (the oldest, still read, and the newest)."""
        return self.window + 2 * self.page_size

    def plan(self, rows: np.ndarray, positions: np.ndarray) -> FreePlan | None:
        """The whole own pages of the requests in `rows` that lie below the window of a query at
        `positions` (their next token's position), or None if there are none. Takes nothing yet."""
        ps = self.page_size
        dead = np.maximum(positions - self.window + 1, 0) // ps * ps  # positions below: never read again
        start = self.live_from[rows]
        counts = np.maximum(dead - start, 0) // ps
        total = int(counts.sum())
        if total == 0:
            return None
        owner = np.repeat(np.arange(len(rows)), counts)
        within = np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)
        page_rows, page_pos = rows[owner], start[owner] + within * ps
        pages = self._table[page_rows, page_pos] // ps
        some = counts > 0
        return FreePlan(page_rows, page_pos, pages, rows[some], dead[some])

    def free(self, plan: FreePlan) -> TableWrites:
        """Give `plan`'s pages back and point their positions at slot 0 in the host table; returns the
        same entries for the device table, to go with the next batch."""
        ps = self.page_size
        self.allocator.free(torch.from_numpy(plan.pages))
        self.live_from[plan.rows] = plan.live_from
        rows = np.repeat(plan.page_rows, ps)
        positions = (plan.page_pos[:, None] + np.arange(ps)).reshape(-1)
        self._table[rows, positions] = 0
        return TableWrites(
            torch.from_numpy(rows), torch.from_numpy(positions), torch.zeros(len(rows), dtype=torch.int64)
        )
