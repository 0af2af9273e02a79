"""Memory layers: KV pool (physical), request table (addressing), prefix cache (reuse).

Dependencies run one way inside the package: allocator <- cache_base (what a prefix cache is, and the
null one) <- radix_cache, and cache_base <- prefix_cache; integrity reads the allocator, a prefix cache
and the request table; kv_pool and req_table stand alone. Nothing here imports from outside
``gapless.memory``.
"""

from gapless.memory.allocator import PageAllocator
from gapless.memory.cache_base import MatchResult, NoPrefixCache, PrefixCache, TreeNode
from gapless.memory.integrity import check_integrity, check_live
from gapless.memory.kv_pool import KVPool
from gapless.memory.prefix_cache import (
    HeldKV,
    alloc_pages,
    cache_finished,
    cache_unfinished,
    release_uncached,
)
from gapless.memory.radix_cache import RadixCache
from gapless.memory.req_table import ReqTable

__all__ = [
    "HeldKV",
    "KVPool",
    "MatchResult",
    "NoPrefixCache",
    "PageAllocator",
    "PrefixCache",
    "RadixCache",
    "ReqTable",
    "TreeNode",
    "alloc_pages",
    "cache_finished",
    "cache_unfinished",
    "check_integrity",
    "check_live",
    "release_uncached",
]
