"""Where a request's KV pages change hands: the one place finished requests are freed.

A live request holds KV slots for positions ``[0, len)`` of its tokens (a :class:`HeldKV`). Positions
``[0, cached_len)`` are the tree's slots (from ``match_prefix``; the request holds a lock on that node);
positions ``[cached_len, len)`` are the request's own, in whole pages starting at a page boundary (the
last page may be partly filled). Both helpers work unchanged for :class:`RadixCache` and
:class:`NoPrefixCache`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gapless.memory.allocator import PageAllocator
from gapless.memory.cache_base import MatchResult, PrefixCache, TreeNode


@dataclass(frozen=True)
class HeldKV:
    """The KV one live request holds, as the module docstring describes: ``slots[i]`` holds the KV of
    ``tokens[i]``; ``[0, cached_len)`` are the tree's slots, pinned through a lock on ``node``."""

    tokens: Sequence[int]
    slots: torch.Tensor
    node: TreeNode
    cached_len: int


def _insert_aligned(cache: PrefixCache, held: HeldKV) -> tuple[torch.Tensor, int, int]:
    """Insert the page-aligned part of a request's KV; returns (host slots, aligned length A, P) where
    P is how much of it the cache already held."""
    slots = held.slots.reshape(-1).to(device="cpu", dtype=torch.int64)
    n = len(held.tokens)
    if slots.numel() != n:
        raise ValueError(f"{n} tokens but {slots.numel()} slots")
    aligned = n // cache.page_size * cache.page_size
    present = cache.insert(held.tokens[:aligned], slots[:aligned])
    if present < held.cached_len:
        raise RuntimeError(f"cache lost part of a locked prefix ({present} < cached_len {held.cached_len})")
    return slots, aligned, present


def cache_finished(cache: PrefixCache, allocator: PageAllocator, held: HeldKV) -> None:
    """Release a finished (or retracted) request: cache what can be cached, free the rest, unlock.

    ``held.tokens``/``held.slots`` cover every position whose KV was computed. The page-aligned part
    ``[0, A)`` is inserted; the tree adopts ``[P, A)`` where ``P`` is what it already had. The
    request's own pages that the tree did not adopt are freed: duplicates ``[cached_len, P)`` and the
    unaligned tail ``[A, len)`` (with ``page_size > 1`` one partial page, wholly the request's).
    With :class:`NoPrefixCache` ``P == A`` and ``cached_len == 0``, so everything is freed. Each page
    the request owned is freed exactly once; afterwards the request owns nothing.
    """
    slots, aligned, present = _insert_aligned(cache, held)
    allocator.free(
        torch.cat([allocator.pages_of(slots[held.cached_len : present]), allocator.pages_of(slots[aligned:])])
    )
    cache.unlock(held.node)


def release_uncached(cache: PrefixCache, allocator: PageAllocator, node: TreeNode, own: torch.Tensor) -> None:
    """Release a request whose own KV cannot enter the cache (part of it was freed while it ran, so no
    prefix of it past its cached one is whole): free its own pages, the slots ``own`` (a run starting at
    a page boundary), and unlock its cached prefix, which stays in the cache as it was."""
    allocator.free(allocator.pages_of(own))
    cache.unlock(node)


def cache_unfinished(cache: PrefixCache, allocator: PageAllocator, held: HeldKV) -> MatchResult:
    """Share a running request's computed prefix (after a prefill chunk) and re-pin it.

    Inserts the page-aligned part ``[0, A)``, re-matches it and moves the request's lock from
    ``held.node`` to the new match, which it returns: the engine rewrites its request-table row
    ``[0, match.length)`` with ``match.slots`` (the tree's slots), and the request now holds ``match.node``.
    The request's own pages in ``[cached_len, new_cached_len)`` that the tree did not adopt (the
    duplicates of a prefix someone else cached first) are freed, since the row no longer points at
    them. The unaligned tail ``[A, len)`` and its partial page stay the request's: it keeps writing
    into that page. With :class:`NoPrefixCache` nothing changes hands and the match is the root's, of
    length 0.
    """
    slots, aligned, _ = _insert_aligned(cache, held)
    cached_len = held.cached_len
    match = cache.match_prefix(held.tokens[:aligned])
    new_len = match.length
    if new_len < cached_len:
        raise RuntimeError(f"re-match shrank the cached prefix ({new_len} < {cached_len})")
    # Own pages the row stops pointing at: those where the tree's slot differs from the request's.
    own = allocator.pages_of(slots[cached_len:new_len])
    tree = allocator.pages_of(match.slots[cached_len:new_len])
    allocator.free(own[own != tree])
    cache.lock(match.node)  # lock the new path before unlocking the old, shared part never dips to 0
    cache.unlock(held.node)
    return match


def alloc_pages(allocator: PageAllocator, cache: PrefixCache, n: int) -> torch.Tensor | None:
    """``allocator.alloc(n)``, evicting from the cache first if too few pages are free.

    Lock every prefix a request being admitted has matched *before* calling this, or its pages may be
    evicted under it. Returns None (allocating nothing) if even eviction cannot make room.
    """
    short = n - allocator.num_free_pages
    if short > 0:
        cache.evict(short * allocator.page_size)
    return allocator.alloc(n)
