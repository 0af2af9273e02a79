"""Whole-memory integrity check for a drained engine: nothing leaked, nothing double-owned."""

from __future__ import annotations

import torch

from gapless.memory.allocator import PageAllocator
from gapless.memory.cache_base import PrefixCache
from gapless.memory.req_table import ReqTable


def _pages(mask: torch.Tensor, limit: int = 16) -> list[int]:
    return mask.nonzero().reshape(-1)[:limit].tolist()


def check_live(allocator: PageAllocator, cache: PrefixCache, owned: list[torch.Tensor]) -> None:
    """Raise AssertionError unless every usable page is exactly one of: free, held (whole) by the cache,
    or owned by one live request. `owned`: per live request, the slots of its own KV (those not the
    cache's, nor freed while it ran), a run starting at a page boundary. For checks between steps of a
    running engine, where `check_integrity` only holds once it drains."""
    cache.check_invariants()
    ps = allocator.page_size
    counts = torch.bincount(cache.all_slots() // ps, minlength=allocator.num_pages)
    in_cache = counts > 0
    own = torch.zeros(allocator.num_pages, dtype=torch.int64)
    for slots in owned:
        own += torch.bincount(allocator.pages_of(slots), minlength=allocator.num_pages)
    if bool((own > 1).any()):
        raise AssertionError(f"pages owned by two requests, or twice by one: {_pages(own > 1)}")
    free = allocator.is_free_mask
    owned_mask = own > 0
    clash = (owned_mask & (free | in_cache)) | (free & in_cache)
    if bool(clash[0]) or bool(owned_mask[0]) or bool(clash.any()):
        raise AssertionError(f"pages both owned, free or cached (or page 0 owned): {_pages(clash)}")
    neither = ~(free | in_cache | owned_mask)
    neither[0] = False
    if bool(neither.any()):
        raise AssertionError(
            f"{int(neither.sum())} pages leaked (not free, cached or owned): {_pages(neither)}"
        )


def check_integrity(allocator: PageAllocator, cache: PrefixCache, req_table: ReqTable) -> None:
    """Raise AssertionError unless memory is exactly as it should be with no request running.

    Holds when: the cache's own invariants hold; every usable page is either free or held (whole) by
    the cache, exactly once; page 0 is neither; no lock is outstanding on the cache; every
    request-table row is free. Any page a request forgot to free shows up as "in neither".
    """
    cache.check_invariants()
    ps = allocator.page_size
    slots = cache.all_slots()
    counts = torch.bincount(slots // ps, minlength=allocator.num_pages)
    in_cache = counts > 0
    partial = in_cache & (counts != ps)
    if bool(partial.any()):
        raise AssertionError(f"cache pages not held whole, or held twice: {_pages(partial)}")
    free = allocator.is_free_mask
    if bool(in_cache[0]) or bool(free[0]):
        raise AssertionError("reserved page 0 is in the cache or free list")
    both = free & in_cache
    if bool(both.any()):
        raise AssertionError(f"pages both free and held by the cache: {_pages(both)}")
    neither = ~(free | in_cache)
    neither[0] = False
    if bool(neither.any()):
        raise AssertionError(
            f"{int(neither.sum())} pages leaked (neither free nor cached), e.g. {_pages(neither)}"
        )
    if cache.active_locks or cache.protected_size:
        raise AssertionError(
            f"cache still locked: {cache.active_locks} locks, {cache.protected_size} protected tokens"
        )
    if req_table.num_free != req_table.max_rows:
        busy = [r for r in range(req_table.max_rows) if not req_table.is_free(r)]
        raise AssertionError(f"request-table rows still in use: {busy[:16]}")
