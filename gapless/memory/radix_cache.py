"""The radix tree prefix cache (SGLang's RadixCache): token prefixes to the KV slots that hold them,
in whole pages, with LRU eviction of unlocked leaves. What a prefix cache owns and promises, and the null
cache beside it, are in `gapless.memory.cache_base`.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator, Sequence

import torch

from gapless.memory.allocator import PageAllocator
from gapless.memory.cache_base import (
    EMPTY_SLOTS,
    MatchResult,
    TreeNode,
    as_tuple,
    host_slots,
    validate_insert,
)


def _whole_pages(tokens: Sequence[int] | torch.Tensor, page_size: int) -> tuple[int, ...]:
    toks = as_tuple(tokens)
    return toks[: len(toks) // page_size * page_size]


def _fail(msg: str) -> None:
    raise AssertionError(msg)


class RadixCache:
    """Radix tree over token ids whose edges are whole pages, with LRU eviction of unlocked leaves.

    Children are keyed by their first page (the first token when ``page_size == 1``), so a lookup is a
    dict hit per edge. Sizes are kept as two counters, ``evictable_size`` (tokens in unlocked nodes)
    and ``protected_size`` (tokens in locked nodes), updated incrementally by lock/unlock/insert/evict.
    Eviction candidates are the set of unlocked leaves, ordered by a lazy min-heap on
    ``(last_access, id)``: a stale entry (node touched again, locked, grown a child, or evicted) is
    skipped when popped, and the heap is rebuilt from the set when stale entries pile up.
    """

    def __init__(self, allocator: PageAllocator, page_size: int) -> None:
        if page_size != allocator.page_size:
            raise ValueError(f"page_size {page_size} != allocator.page_size {allocator.page_size}")
        self.allocator = allocator
        self.page_size = page_size
        self._page_offsets = torch.arange(page_size, dtype=torch.int64)
        self.reset()

    def reset(self) -> None:
        """Forget the whole tree without freeing its pages: pair it with ``allocator.reset()``.

        To drop cached prefixes while keeping the allocator consistent, use
        ``evict(cache.evictable_size)`` instead.
        """
        self._ids = itertools.count()
        self._clock = 0
        self.root = TreeNode(next(self._ids), (), EMPTY_SLOTS, None)
        self._evictable_size = 0
        self._protected_size = 0
        self._active_locks = 0
        self._leaves: set[TreeNode] = set()  # unlocked leaves: exactly the eviction candidates
        self._heap: list[tuple[int, int, TreeNode]] = []

    # ---- sizes ----

    @property
    def evictable_size(self) -> int:
        return self._evictable_size

    @property
    def protected_size(self) -> int:
        return self._protected_size

    @property
    def total_size(self) -> int:
        return self._evictable_size + self._protected_size

    @property
    def active_locks(self) -> int:
        """``lock()`` calls not yet matched by ``unlock()`` (a leak detector: 0 once requests drain)."""
        return self._active_locks

    # ---- lookup and insertion ----

    def prefix_len(self, tokens: Sequence[int]) -> int:
        """``match_prefix(tokens).length`` without its side effects: no split, no LRU touch.

        For ordering waiting requests by their cached prefix (LPM), which looks at many prompts per
        step and admits few: only an admitted request's match may reshape the tree or count as a use.
        """
        return sum(m for _, m in self._walk(_whole_pages(tokens, self.page_size)))

    def match_prefix(self, tokens: Sequence[int]) -> MatchResult:
        """Longest cached prefix of ``tokens``, rounded down to whole pages. Does not lock.

        If the match ends inside a node, that node is split so the returned node ends exactly at
        ``length`` (locking it then pins exactly the matched prefix). Touches the path for LRU.
        """
        node, length, values = self._descend(_whole_pages(tokens, self.page_size), self._tick())
        slots = torch.cat(values) if values else EMPTY_SLOTS.clone()
        return MatchResult(slots=slots, node=node, length=length)

    def insert(self, tokens: Sequence[int], slots: torch.Tensor) -> int:
        """Cache ``tokens`` -> ``slots``; return how many leading tokens were already cached.

        Ownership: for the returned leading part ``[0, P)`` the tree keeps its own slots and the
        caller still owns the ``slots[:P]`` it passed (freeing them if they are duplicates is the
        caller's job); the tree adopts ``slots[P:]`` and will free them when it evicts them.
        ``len(tokens) == len(slots)`` and a multiple of ``page_size``, else ValueError.
        """
        toks = as_tuple(tokens)
        slots = host_slots(slots)
        validate_insert(toks, slots, self.page_size)
        tick = self._tick()
        node, present, _ = self._descend(toks, tick)
        if present < len(toks):
            leaf = TreeNode(next(self._ids), toks[present:], slots[present:].clone(), node)
            leaf.last_access = tick
            node.children[self._child_key(leaf.key, 0)] = leaf
            self._evictable_size += len(leaf.key)
            self._leaves.discard(node)  # no longer a leaf
            self._add_leaf(leaf)
        return present

    # ---- pinning ----

    def lock(self, node: TreeNode) -> None:
        """Pin ``node`` and its ancestors against eviction (locking the root is a counted no-op)."""
        self._check_attached(node)
        self._active_locks += 1
        while node is not self.root:
            if node.lock_ref == 0:
                self._evictable_size -= len(node.key)
                self._protected_size += len(node.key)
                self._leaves.discard(node)
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]

    def unlock(self, node: TreeNode) -> None:
        """Undo one ``lock(node)``; RuntimeError if that would take a lock count below zero."""
        self._check_attached(node)
        # Ancestors' lock_ref >= node's, so checking the node (and the total) suffices.
        if self._active_locks == 0 or (node is not self.root and node.lock_ref == 0):
            raise RuntimeError(f"unlock of {node} that is not locked")
        self._active_locks -= 1
        while node is not self.root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable_size += len(node.key)
                self._protected_size -= len(node.key)
                if not node.children:
                    self._add_leaf(node)
            node = node.parent  # type: ignore[assignment]

    # ---- eviction ----

    def evict(self, num_tokens: int) -> int:
        """Free least-recently-used unlocked leaves until ``num_tokens`` are freed or none are left.

        Whole nodes go, so this may free more than asked. A parent left as an unlocked leaf becomes a
        candidate in turn. Pages go back to the allocator in one call. Returns tokens freed.
        """
        freed = 0
        pages: list[torch.Tensor] = []
        while freed < num_tokens and self._heap:
            t, _, node = heapq.heappop(self._heap)
            if node not in self._leaves or node.last_access != t:
                continue  # stale entry
            self._leaves.remove(node)
            parent = node.parent
            assert parent is not None
            del parent.children[self._child_key(node.key, 0)]
            node.parent = None
            pages.append(self.allocator.pages_of(node.value))
            freed += len(node.key)
            self._evictable_size -= len(node.key)
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                self._add_leaf(parent)
        if pages:
            self.allocator.free(torch.cat(pages))
        return freed

    # ---- inspection ----

    def all_slots(self) -> torch.Tensor:
        """Every slot the tree owns (int64 CPU), in no particular order."""
        values = [n.value for n in self._nodes()]
        return torch.cat(values) if values else EMPTY_SLOTS.clone()

    def check_invariants(self) -> None:
        """Walk the tree and raise AssertionError on any broken invariant.

        Checked: parent/child links and child keys; every key non-empty, page-aligned and as long as
        its value; values are int64 runs of whole pages (page-aligned, consecutive within a page); no
        page twice, page 0 never, no tree page free in the allocator; ``lock_ref >= 0`` and a node's
        ``lock_ref >= sum of its children's`` (each lock adds 1 along a whole root path, so a node
        counts its children's locks plus those taken on it directly); both size counters; the
        candidate set is exactly the unlocked leaves, each with a live heap entry.
        """
        if self.root.parent is not None or self.root.key or self.root.lock_ref:
            _fail("root must have no parent, an empty key and lock_ref 0")
        evictable = protected = 0
        leaves: set[TreeNode] = set()
        values: list[torch.Tensor] = []
        stack = [self.root]
        while stack:
            node = stack.pop()
            for ck, child in node.children.items():
                self._check_edge(node, ck, child)
                if child.lock_ref > 0:
                    protected += len(child.key)
                else:
                    evictable += len(child.key)
                    if not child.children:
                        leaves.add(child)
                values.append(child.value)
                stack.append(child)
            child_locks = sum(c.lock_ref for c in node.children.values())
            if node is not self.root and node.lock_ref < child_locks:
                _fail(f"{node} lock_ref {node.lock_ref} < its children's total {child_locks}")
        self._check_counters(evictable, protected, leaves)
        self._check_pages(values)

    def _check_edge(self, parent: TreeNode, child_key: object, child: TreeNode) -> None:
        """One edge: its links, its key and how it is filed, its slots, its lock count."""
        ps, k = self.page_size, len(child.key)
        if child.parent is not parent:
            _fail(f"{child} has a wrong parent link")
        if k == 0 or k % ps:
            _fail(f"{child} key length {k} is not a positive multiple of page_size {ps}")
        if child_key != self._child_key(child.key, 0):
            _fail(f"{child} is filed under a key that is not its first page")
        v = child.value
        if v.dtype != torch.int64 or v.device.type != "cpu" or tuple(v.shape) != (k,):
            _fail(f"{child} value must be int64 CPU of shape ({k},), got {v.dtype} {tuple(v.shape)}")
        pv = v.view(-1, ps)
        if bool((pv[:, 0] % ps != 0).any()) or bool((pv - pv[:, :1] != self._page_offsets).any()):
            _fail(f"{child} value is not a run of whole pages: {v[:16].tolist()}")
        if child.lock_ref < 0:
            _fail(f"{child} has negative lock_ref")

    def _check_counters(self, evictable: int, protected: int, leaves: set[TreeNode]) -> None:
        """The incremental sizes and eviction candidates agree with what the walk found."""
        if (evictable, protected) != (self._evictable_size, self._protected_size):
            _fail(
                f"size counters (evictable={self._evictable_size}, protected={self._protected_size}) "
                f"!= walked (evictable={evictable}, protected={protected})"
            )
        if leaves != self._leaves:
            _fail(f"eviction candidates {self._leaves} != unlocked leaves {leaves}")
        live = {(t, i) for t, i, _ in self._heap}
        for leaf in leaves:
            if (leaf.last_access, leaf.id) not in live:
                _fail(f"{leaf} has no live heap entry")

    def _check_pages(self, values: list[torch.Tensor]) -> None:
        """Each tree page once, never page 0 or out of range, and not free in the allocator."""
        if not values:
            return
        pages = self.allocator.pages_of(torch.cat(values))
        if torch.unique(pages).numel() != pages.numel():
            _fail("a page appears twice in the tree")
        if bool((pages < 1).any()) or bool((pages >= self.allocator.num_pages).any()):
            _fail("the tree holds page 0 or an out-of-range page")
        free = self.allocator.is_free_mask[pages]
        if bool(free.any()):
            _fail(f"tree pages are free in the allocator: {pages[free][:8].tolist()}")

    # ---- internals ----

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _child_key(self, key: tuple[int, ...], start: int) -> object:
        if self.page_size == 1:
            return key[start]
        return key[start : start + self.page_size]

    def _match_len(self, key: tuple[int, ...], toks: tuple[int, ...], pos: int) -> int:
        """Page-aligned common prefix length of ``key`` and ``toks[pos:]``; the first page is known equal."""
        n = len(key)
        if toks[pos : pos + n] == key:  # common case: the whole edge matches (one C-level compare)
            return n
        ps = self.page_size
        n = min(n, len(toks) - pos)
        i = ps
        while i + ps <= n and key[i : i + ps] == toks[pos + i : pos + i + ps]:
            i += ps
        return i

    def _walk(self, toks: tuple[int, ...]) -> Iterator[tuple[TreeNode, int]]:
        """The edges ``toks`` (page-aligned) follows down from the root, each with how many of its
        tokens match; only the last may match partly. Reads only: the caller may split that last edge."""
        node, pos = self.root, 0
        while pos < len(toks):
            child = node.children.get(self._child_key(toks, pos))
            if child is None:
                return
            m = self._match_len(child.key, toks, pos)
            partly = m < len(child.key)
            yield child, m
            if partly:
                return
            node, pos = child, pos + m

    def _descend(self, toks: tuple[int, ...], tick: int) -> tuple[TreeNode, int, list[torch.Tensor]]:
        """Follow ``toks`` (page-aligned) down the tree, splitting where the match ends mid-edge, and
        touch the path for LRU.

        Returns the deepest matched node, the matched length and the matched nodes' values.
        """
        node, pos = self.root, 0
        values: list[torch.Tensor] = []
        for child, m in self._walk(toks):
            if m < len(child.key):
                child = self._split(child, m)
            self._touch(child, tick)
            values.append(child.value)
            node, pos = child, pos + m
        return node, pos, values

    def _split(self, child: TreeNode, m: int) -> TreeNode:
        """Cut ``child`` at page-aligned offset ``m``; the new upper node is returned.

        The original object stays the lower part, so a request holding it still holds the node
        ending where its match ended. The upper part copies ``lock_ref`` (every lock through the
        lower part passes through it), so both size counters are unchanged.
        """
        parent = child.parent
        assert parent is not None
        mid = TreeNode(next(self._ids), child.key[:m], child.value[:m].clone(), parent)
        mid.lock_ref = child.lock_ref
        mid.last_access = child.last_access
        child.key = child.key[m:]
        child.value = child.value[m:].clone()
        child.parent = mid
        mid.children[self._child_key(child.key, 0)] = child
        parent.children[self._child_key(mid.key, 0)] = mid
        return mid

    def _touch(self, node: TreeNode, tick: int) -> None:
        node.last_access = tick
        if node in self._leaves:
            self._push(node)

    def _add_leaf(self, node: TreeNode) -> None:
        self._leaves.add(node)
        self._push(node)

    def _push(self, node: TreeNode) -> None:
        heapq.heappush(self._heap, (node.last_access, node.id, node))
        if len(self._heap) > 2 * len(self._leaves) + 64:  # compact stale entries (amortised O(1))
            self._heap = [(n.last_access, n.id, n) for n in self._leaves]
            heapq.heapify(self._heap)

    def _check_attached(self, node: TreeNode) -> None:
        if node is not self.root and node.parent is None:
            raise RuntimeError(f"{node} has been evicted (match and lock before anything can evict)")

    def _nodes(self) -> list[TreeNode]:
        out: list[TreeNode] = []
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out
