"""What a prefix cache is to the engine: the `PrefixCache` protocol, the tree node and match it deals in,
and the null cache (prefix caching off). The radix tree itself is `gapless.memory.radix_cache`.

Ownership model. Every usable KV page is, at any time, exactly one of: free in the allocator, owned by
the cache (it holds KV for a cached prefix and is freed only by ``evict``), or owned by one live request
(KV the request computed that the cache has not adopted). A request that matched a prefix *reads* the
cache's pages for it and holds a lock on the matched node so they cannot be evicted under it.

Both caches implement :class:`PrefixCache`; the engine never branches on which one it has, because it
only calls ``prefix_len`` to order waiting requests, ``match_prefix``/``lock`` at admission and the
helpers in ``prefix_cache`` afterwards.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from gapless.memory.allocator import PageAllocator

EMPTY_SLOTS = torch.empty(0, dtype=torch.int64)


class TreeNode:
    """One edge of the radix tree: a run of whole pages of tokens and the slots holding their KV.

    ``lock_ref`` counts the locks held on this node or any descendant (locks are applied along the
    path to the root), so a node with ``lock_ref > 0`` is pinned.
    """

    __slots__ = ("id", "key", "value", "parent", "children", "lock_ref", "last_access")

    def __init__(self, id: int, key: tuple[int, ...], value: torch.Tensor, parent: TreeNode | None) -> None:
        self.id = id  # creation order; also the LRU tie-break, so eviction order is deterministic
        self.key = key  # token ids, len a multiple of page_size
        self.value = value  # int64 CPU slots, same length as key
        self.parent = parent  # None for the root and for evicted nodes
        self.children: dict[object, TreeNode] = {}
        self.lock_ref = 0
        self.last_access = 0  # logical clock, not wall time, so tests are deterministic

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, len={len(self.key)}, lock_ref={self.lock_ref})"


@dataclass(frozen=True)
class MatchResult:
    """Longest cached page-aligned prefix: its slots (int64 CPU), deepest node (root if none), length."""

    slots: torch.Tensor
    node: TreeNode
    length: int


class PrefixCache(Protocol):
    """What the engine and the helpers in ``prefix_cache`` need from a prefix cache."""

    page_size: int

    def prefix_len(self, tokens: Sequence[int]) -> int: ...
    def match_prefix(self, tokens: Sequence[int]) -> MatchResult: ...
    def insert(self, tokens: Sequence[int], slots: torch.Tensor) -> int: ...
    def lock(self, node: TreeNode) -> None: ...
    def unlock(self, node: TreeNode) -> None: ...
    def evict(self, num_tokens: int) -> int: ...
    @property
    def evictable_size(self) -> int: ...
    @property
    def protected_size(self) -> int: ...
    @property
    def total_size(self) -> int: ...
    @property
    def active_locks(self) -> int: ...
    def all_slots(self) -> torch.Tensor: ...
    def reset(self) -> None: ...
    def check_invariants(self) -> None: ...


def as_tuple(tokens: Sequence[int] | torch.Tensor) -> tuple[int, ...]:
    if isinstance(tokens, torch.Tensor):
        return tuple(tokens.reshape(-1).tolist())
    return tuple(tokens)


def adapter_key(tokens: Sequence[int], adapter: int) -> Sequence[int]:
    """The prefix cache's key of `tokens` run under LoRA adapter `adapter` (0: the base model): each id
    moved into a range of the adapter's own, so no prefix is ever shared across adapters (their KV
    differs) while the tree keys, pages and matches as it does for the base model."""
    if not adapter:
        return tokens
    offset = adapter << 32  # above every token id
    return tuple(t + offset for t in tokens)


def host_slots(slots: torch.Tensor) -> torch.Tensor:
    return slots.reshape(-1).to(device="cpu", dtype=torch.int64)


def validate_insert(tokens: tuple[int, ...], slots: torch.Tensor, page_size: int) -> None:
    if len(tokens) != slots.numel():
        raise ValueError(f"insert: {len(tokens)} tokens but {slots.numel()} slots")
    if len(tokens) % page_size:
        raise ValueError(f"insert: length {len(tokens)} is not a multiple of page_size {page_size}")


class NoPrefixCache:
    """The prefix cache when prefix caching is off: it never holds anything.

    Contract, chosen so the ``prefix_cache`` helpers and the engine run the same code for both
    caches: ``prefix_len`` is always 0 and ``match_prefix`` always matches 0 tokens at the root;
    ``insert`` adopts nothing and returns ``len(tokens)``, i.e. by the ``insert`` contract the caller
    keeps ownership of every slot it passed; ``lock``/``unlock`` only count (so leaks and double
    unlocks are still caught); ``evict`` frees nothing. With it, ``cache_finished`` frees everything
    the request holds and ``cache_unfinished`` leaves the request owning all of its slots.
    """

    def __init__(self, allocator: PageAllocator, page_size: int) -> None:
        if page_size != allocator.page_size:
            raise ValueError(f"page_size {page_size} != allocator.page_size {allocator.page_size}")
        self.allocator = allocator
        self.page_size = page_size
        self.root = TreeNode(0, (), EMPTY_SLOTS, None)
        self._active_locks = 0

    def reset(self) -> None:
        self._active_locks = 0

    @property
    def evictable_size(self) -> int:
        return 0

    @property
    def protected_size(self) -> int:
        return 0

    @property
    def total_size(self) -> int:
        return 0

    @property
    def active_locks(self) -> int:
        return self._active_locks

    def prefix_len(self, tokens: Sequence[int]) -> int:
        return 0

    def match_prefix(self, tokens: Sequence[int]) -> MatchResult:
        return MatchResult(slots=EMPTY_SLOTS.clone(), node=self.root, length=0)

    def insert(self, tokens: Sequence[int], slots: torch.Tensor) -> int:
        toks = as_tuple(tokens)
        validate_insert(toks, host_slots(slots), self.page_size)
        return len(toks)

    def lock(self, node: TreeNode) -> None:
        self._active_locks += 1

    def unlock(self, node: TreeNode) -> None:
        if self._active_locks == 0:
            raise RuntimeError("unlock without a matching lock")
        self._active_locks -= 1

    def evict(self, num_tokens: int) -> int:
        return 0

    def all_slots(self) -> torch.Tensor:
        return EMPTY_SLOTS.clone()

    def check_invariants(self) -> None:
        if self._active_locks < 0:
            raise AssertionError("negative lock count")
