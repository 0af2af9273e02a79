"""Page allocator for the KV pool.

KV memory is handed out in pages of ``page_size`` consecutive slots: the slot of token offset ``j`` in
page ``p`` is ``p * page_size + j``. Page 0 is reserved and never handed out, so padding tokens in a
batch always have a harmless place to write their KV (slot 0), and a zero in a request-table row never
aliases live data.

All bookkeeping is host-side (CPU tensors) and vectorised: the scheduler calls this on every step, so
no per-page Python loops.
"""

from __future__ import annotations

import torch


class PageAllocator:
    """Hands out KV pages from a LIFO free stack kept as one CPU int64 tensor.

    ``alloc`` and ``free`` are O(n) slice copies. An ``is_free`` mask shadows the stack so that double
    frees (the classic resource bug of an overlapped scheduler) are caught by one vectorised check.
    """

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1 (page 0 is reserved), got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self._offsets = torch.arange(page_size, dtype=torch.int64)
        # Stack of free page ids; the live part is _stack[:_top], the top of the stack at the end.
        self._stack = torch.empty(num_pages - 1, dtype=torch.int64)
        self._top = 0
        self._is_free = torch.zeros(num_pages, dtype=torch.bool)
        self.reset()

    def reset(self) -> None:
        """Mark every usable page free (forgets all outstanding allocations)."""
        # Descending, so a fresh allocator hands out pages 1, 2, 3, ... in order.
        self._stack.copy_(torch.arange(self.num_pages - 1, 0, -1, dtype=torch.int64))
        self._top = self.num_pages - 1
        self._is_free.fill_(True)
        self._is_free[0] = False

    @property
    def num_usable_pages(self) -> int:
        """Pages that can ever be handed out (all but the reserved page 0)."""
        return self.num_pages - 1

    @property
    def num_free_pages(self) -> int:
        return self._top

    @property
    def num_free_tokens(self) -> int:
        return self._top * self.page_size

    @property
    def is_free_mask(self) -> torch.Tensor:
        """Bool ``[num_pages]``: True where the page is free (page 0 is never free). Read-only view."""
        return self._is_free

    def alloc(self, n: int) -> torch.Tensor | None:
        """Return ``n`` page ids (int64 CPU), or None (allocating nothing) if fewer than ``n`` are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > self._top:
            return None
        # copy(), so the result never aliases the stack; numpy views, as a decode step's few hundred
        # pages cost a fifth of the time there that torch's indexing takes
        pages = self._stack.numpy()[self._top - n : self._top][::-1].copy()
        self._top -= n
        self._is_free.numpy()[pages] = False
        return torch.from_numpy(pages)

    def free(self, pages: torch.Tensor) -> None:
        """Return pages to the pool.

        Raises RuntimeError (freeing nothing) on page 0, an out-of-range id, a page that is already
        free, or a page listed twice.
        """
        pages = pages.to(device="cpu", dtype=torch.int64).reshape(-1)
        k = pages.numel()
        if k == 0:
            return
        bad = (pages < 1) | (pages >= self.num_pages)
        if bool(bad.any()):
            raise RuntimeError(f"freeing reserved or out-of-range pages: {pages[bad][:8].tolist()}")
        already = self._is_free[pages]
        if bool(already.any()):
            raise RuntimeError(f"double free of pages {pages[already][:8].tolist()}")
        if torch.unique(pages).numel() != k:
            raise RuntimeError("double free: a page is listed more than once in one free() call")
        # Pushed reversed so that alloc() hands them back in the order they were freed.
        self._stack[self._top : self._top + k] = pages.flip(0)
        self._top += k
        self._is_free[pages] = True

    def page_slots(self, pages: torch.Tensor) -> torch.Tensor:
        """All slots of ``pages``, page by page, flattened (int64, same device as ``pages``)."""
        pages = pages.to(torch.int64).reshape(-1, 1)
        return (pages * self.page_size + self._offsets.to(pages.device)).reshape(-1)

    def pages_of(self, slots: torch.Tensor) -> torch.Tensor:
        """Page ids of a page-aligned run of slots (one id per started page).

        ``slots`` must begin at a page boundary and fill its pages in order (the last page may be
        partial), which is how a request's positions map onto its pages.
        """
        return slots.to(torch.int64).reshape(-1)[:: self.page_size] // self.page_size
