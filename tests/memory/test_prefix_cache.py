"""cache_finished / cache_unfinished / alloc_pages: who owns which page, and every page freed once."""

import pytest
import torch

from gapless.memory.allocator import PageAllocator
from gapless.memory.cache_base import NoPrefixCache, PrefixCache, TreeNode
from gapless.memory.integrity import check_integrity
from gapless.memory.prefix_cache import HeldKV, alloc_pages, cache_finished, cache_unfinished
from gapless.memory.radix_cache import RadixCache
from gapless.memory.req_table import ReqTable


class Req:
    """A simulated request: match + lock at admission, own pages for the rest."""

    def __init__(self, a: PageAllocator, c: PrefixCache, tokens: list[int]) -> None:
        self.tokens = tokens
        m = c.match_prefix(tokens)
        c.lock(m.node)
        self.node: TreeNode = m.node
        self.cached_len = m.length
        n_new = len(tokens) - m.length
        pages = alloc_pages(a, c, -(-n_new // a.page_size))
        assert pages is not None
        self.slots = torch.cat([m.slots, a.page_slots(pages)[:n_new]])

    def held(self) -> HeldKV:
        return HeldKV(self.tokens, self.slots, self.node, self.cached_len)

    def own_pages(self, a: PageAllocator) -> torch.Tensor:
        return a.pages_of(self.slots[self.cached_len :])


def make(ps: int, radix: bool = True, num_pages: int = 32) -> tuple[PageAllocator, PrefixCache, ReqTable]:
    a = PageAllocator(num_pages, ps)
    return a, (RadixCache(a, ps) if radix else NoPrefixCache(a, ps)), ReqTable(4, 64, "cpu")


def free_pages(a: PageAllocator) -> set[int]:
    return set(a.is_free_mask.nonzero().reshape(-1).tolist())


@pytest.mark.parametrize("ps", [1, 4])
def test_finished_request_is_cached_and_its_tail_freed(ps: int) -> None:
    a, c, t = make(ps)
    r = Req(a, c, list(range(2 * ps + ps // 2 + 1)))  # two whole pages and (ps=4) a partial one
    own = set(r.own_pages(a).tolist())
    cache_finished(c, a, r.held())
    aligned = len(r.tokens) // ps * ps
    assert c.total_size == aligned and c.protected_size == 0 and c.active_locks == 0
    tree_pages = set(a.pages_of(c.all_slots()).tolist())
    assert tree_pages == set(a.pages_of(r.slots[:aligned]).tolist())
    assert own - tree_pages <= free_pages(a)  # the tail page went back
    check_integrity(a, c, t)
    # A second request reuses the cached prefix and only frees what it owns.
    r2 = Req(a, c, r.tokens + [77] * ps)
    assert r2.cached_len == aligned and torch.equal(r2.slots[:aligned], r.slots[:aligned])
    cache_finished(c, a, r2.held())
    check_integrity(a, c, t)


@pytest.mark.parametrize("ps", [1, 4])
def test_finishing_a_duplicate_frees_its_own_copy(ps: int) -> None:
    a, c, t = make(ps)
    toks = list(range(3 * ps))
    r1, r2 = Req(a, c, toks), Req(a, c, toks)  # both admitted before either was cached
    assert r1.cached_len == r2.cached_len == 0
    cache_finished(c, a, r1.held())
    dup = set(r2.own_pages(a).tolist())
    assert not dup & free_pages(a)
    cache_finished(c, a, r2.held())
    assert dup <= free_pages(a)  # r2's whole copy freed: the tree kept r1's
    assert torch.equal(c.match_prefix(toks).slots, r1.slots)
    check_integrity(a, c, t)


def test_unfinished_shares_the_prefix_and_keeps_the_partial_page() -> None:
    ps = 4
    a, c, t = make(ps)
    toks = list(range(2 * ps + 1))  # two whole pages and one token into a third
    r = Req(a, c, toks)
    tail_page = int(a.pages_of(r.slots[2 * ps :])[0])
    m = cache_unfinished(c, a, r.held())
    prefix, node, cached = m.slots, m.node, m.length
    assert cached == 2 * ps and torch.equal(prefix, r.slots[: 2 * ps])  # tree adopted the request's slots
    assert c.protected_size == 2 * ps and c.active_locks == 1 and node.lock_ref == 1
    assert tail_page not in free_pages(a)  # still being written by the request
    r.node, r.cached_len = node, cached
    r.slots[:cached] = prefix
    # The next chunk continues in the same page (and one more), then the request finishes.
    next_page = a.alloc(1)
    assert next_page is not None
    more = torch.cat([a.page_slots(torch.tensor([tail_page]))[1:], a.page_slots(next_page)[:2]])
    r.tokens = toks + list(range(100, 105))
    r.slots = torch.cat([r.slots, more])
    m = cache_unfinished(c, a, r.held())
    prefix, node, cached = m.slots, m.node, m.length
    assert cached == 3 * ps and torch.equal(prefix, r.slots[: 3 * ps]) and c.protected_size == 3 * ps
    cache_finished(c, a, HeldKV(r.tokens, r.slots, node, cached))
    assert c.total_size == 3 * ps
    check_integrity(a, c, t)


def test_unfinished_with_page_size_1_adopts_everything() -> None:
    a, c, t = make(1)
    r = Req(a, c, [4, 5, 6])
    m = cache_unfinished(c, a, r.held())
    prefix, node, cached = m.slots, m.node, m.length
    assert cached == 3 and torch.equal(prefix, r.slots) and c.protected_size == 3
    assert a.num_free_pages == a.num_usable_pages - 3
    cache_finished(c, a, HeldKV(r.tokens, r.slots, node, cached))
    check_integrity(a, c, t)


@pytest.mark.parametrize("ps", [1, 4])
def test_unfinished_switches_a_duplicate_to_the_tree_copy(ps: int) -> None:
    a, c, t = make(ps)
    toks = list(range(2 * ps))
    r1, r2 = Req(a, c, toks), Req(a, c, toks + [5] * ps)
    cache_finished(c, a, r1.held())
    dup = set(a.pages_of(r2.slots[: 2 * ps]).tolist())
    m = cache_unfinished(c, a, r2.held())
    prefix, node, cached = m.slots, m.node, m.length
    assert cached == 3 * ps
    assert torch.equal(prefix, torch.cat([r1.slots, r2.slots[2 * ps :]]))
    assert dup <= free_pages(a)  # r2's copy of the shared prefix is freed: its row now points at r1's
    assert c.protected_size == 3 * ps
    cache_finished(c, a, HeldKV(r2.tokens, prefix, node, cached))
    assert c.protected_size == 0
    check_integrity(a, c, t)


@pytest.mark.parametrize("ps", [1, 4])
def test_no_prefix_cache_frees_everything_on_finish_and_nothing_before(ps: int) -> None:
    a, c, t = make(ps, radix=False)
    r = Req(a, c, list(range(3 * ps + 1)))
    held = set(r.own_pages(a).tolist())
    assert r.cached_len == 0 and c.active_locks == 1
    m = cache_unfinished(c, a, r.held())
    prefix, node, cached = m.slots, m.node, m.length
    assert prefix.numel() == 0 and node is c.root and cached == 0
    assert not held & free_pages(a) and c.active_locks == 1
    cache_finished(c, a, HeldKV(r.tokens, r.slots, node, cached))
    assert held <= free_pages(a) and a.num_free_pages == a.num_usable_pages
    check_integrity(a, c, t)


def test_finished_rejects_mismatched_lengths() -> None:
    a, c, _ = make(1)
    r = Req(a, c, [1, 2, 3])
    with pytest.raises(ValueError):
        cache_finished(c, a, HeldKV(r.tokens, r.slots[:2], r.node, r.cached_len))
    with pytest.raises(ValueError):
        cache_unfinished(c, a, HeldKV(r.tokens[:2], r.slots, r.node, r.cached_len))


def test_alloc_pages_evicts_only_when_short() -> None:
    a, c, t = make(1, num_pages=9)
    for x in range(4):
        r = Req(a, c, [x, x])
        cache_finished(c, a, r.held())
    assert a.num_free_pages == 0 and c.total_size == 8
    pages = alloc_pages(a, c, 3)  # evicts the two least recent nodes (4 tokens)
    assert pages is not None and c.total_size == 4 and a.num_free_pages == 1
    assert c.match_prefix([0, 0]).length == 0 and c.match_prefix([3, 3]).length == 2
    assert alloc_pages(a, c, 100) is None
    a.free(pages)
    check_integrity(a, c, t)


def test_check_integrity_reports_each_kind_of_fault() -> None:
    a, c, t = make(4)
    r = Req(a, c, list(range(8)))
    with pytest.raises(AssertionError, match="leaked|locked"):
        check_integrity(a, c, t)
    cache_finished(c, a, r.held())
    check_integrity(a, c, t)
    leaked = a.alloc(1)
    with pytest.raises(AssertionError, match="leaked"):
        check_integrity(a, c, t)
    a.free(leaked)  # type: ignore[arg-type]
    m = c.match_prefix(list(range(8)))
    c.lock(m.node)
    with pytest.raises(AssertionError, match="locked"):
        check_integrity(a, c, t)
    c.unlock(m.node)
    row = t.alloc()
    with pytest.raises(AssertionError, match="rows still in use"):
        check_integrity(a, c, t)
    t.free(row)  # type: ignore[arg-type]
    check_integrity(a, c, t)
    a.free(a.pages_of(c.all_slots()[:4]))  # a cached page also on the free list
    with pytest.raises(AssertionError, match="free"):
        check_integrity(a, c, t)


@pytest.mark.parametrize("ps", [1, 4])
def test_release_uncached_frees_own_pages_and_keeps_the_prefix(ps):
    """A request that freed the start of its own KV (a sliding window's) while running: its remaining own
    pages go back, its cached prefix stays cached and unlocked, nothing of it enters the tree; the live
    check accounts for every page at each stage and catches a leak and a double owner."""
    from gapless.memory.integrity import check_live
    from gapless.memory.prefix_cache import release_uncached

    a, c, t = make(ps, num_pages=64)
    first = Req(a, c, list(range(16)))
    cache_finished(c, a, first.held())  # the prefix [0, 16) is cached
    r = Req(a, c, list(range(16)) + list(range(100, 120)))
    assert r.cached_len == 16
    own = r.slots[16:]
    check_live(a, c, [own])
    a.free(a.pages_of(own[:8]))  # the window moved past [16, 24)
    live = own[8:]
    check_live(a, c, [live])
    with pytest.raises(AssertionError, match="leaked"):
        check_live(a, c, [live[ps:]])
    with pytest.raises(AssertionError, match="two requests"):
        check_live(a, c, [live, live[:ps]])
    release_uncached(c, a, r.node, live)
    check_integrity(a, c, t)
    assert c.match_prefix(list(range(16)) + list(range(100, 120))).length == 16
