"""Memory layers: KV pool (physical), request table (addressing), prefix cache (reuse).

Dependencies run one way inside the package: allocator <- kv_pool / radix_cache <- prefix_cache <-
integrity; req_table stands alone. Nothing here imports from outside ``gapless.memory``.
"""

from gapless.memory.allocator import PageAllocator
from gapless.memory.integrity import check_integrity
from gapless.memory.kv_pool import KVPool
from gapless.memory.prefix_cache import alloc_pages, cache_finished, cache_unfinished
from gapless.memory.radix_cache import MatchResult, NoPrefixCache, PrefixCache, RadixCache, TreeNode
from gapless.memory.req_table import ReqTable

__all__ = [
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
]
