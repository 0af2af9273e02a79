"""RadixCache: page-aligned match/insert/split, locking, LRU eviction, counters and invariants."""

import pytest
import torch

from gapless.memory.allocator import PageAllocator
from gapless.memory.cache_base import NoPrefixCache
from gapless.memory.radix_cache import RadixCache


def make(page_size: int, num_pages: int = 64) -> tuple[PageAllocator, RadixCache]:
    a = PageAllocator(num_pages, page_size)
    return a, RadixCache(a, page_size)


def fresh_slots(a: PageAllocator, n_tokens: int) -> torch.Tensor:
    """Slots for ``n_tokens`` (a multiple of page_size) on newly allocated pages."""
    pages = a.alloc(n_tokens // a.page_size)
    assert pages is not None
    return a.page_slots(pages)


def put(a: PageAllocator, c: RadixCache, tokens: list[int]) -> torch.Tensor:
    """Insert ``tokens`` with fresh slots, freeing the duplicates of what was already cached."""
    slots = fresh_slots(a, len(tokens))
    present = c.insert(tokens, slots)
    a.free(a.pages_of(slots[:present]))
    c.check_invariants()
    return slots


@pytest.mark.parametrize("ps", [1, 4])
def test_empty_tree_matches_nothing(ps: int) -> None:
    _, c = make(ps)
    m = c.match_prefix(list(range(12)))
    assert m.length == 0 and m.node is c.root and m.slots.numel() == 0 and m.slots.dtype == torch.int64
    assert c.total_size == c.evictable_size == c.protected_size == 0
    assert c.insert([], torch.empty(0, dtype=torch.int64)) == 0
    c.check_invariants()


@pytest.mark.parametrize("ps", [1, 4])
def test_insert_then_full_and_partial_match(ps: int) -> None:
    a, c = make(ps)
    toks = list(range(100, 100 + 3 * ps))
    slots = put(a, c, toks)
    assert c.total_size == c.evictable_size == 3 * ps
    m = c.match_prefix(toks + [7, 7, 7, 7, 7])
    assert m.length == 3 * ps and torch.equal(m.slots, slots)
    # A match ending inside the edge (at a page boundary) splits it.
    m2 = c.match_prefix(toks[: 2 * ps] + [1] * ps)
    assert m2.length == 2 * ps and torch.equal(m2.slots, slots[: 2 * ps])
    assert len(m2.node.key) == 2 * ps and list(m2.node.children.values())[0].key == tuple(toks[2 * ps :])
    assert c.total_size == 3 * ps
    c.check_invariants()
    # And the full match still returns the same slots, now across two nodes.
    m3 = c.match_prefix(toks)
    assert m3.length == 3 * ps and torch.equal(m3.slots, slots) and m3.node.parent is m2.node


def test_match_rounds_down_to_whole_pages() -> None:
    a, c = make(4)
    toks = list(range(8))
    slots = put(a, c, toks)
    m = c.match_prefix(toks[:7])
    assert m.length == 4 and torch.equal(m.slots, slots[:4])
    m = c.match_prefix(toks[:6] + [99, 99])  # mismatch inside the 2nd page: only page 1 counts
    assert m.length == 4
    assert c.match_prefix(toks[:3]).length == 0
    assert c.match_prefix([0, 1, 2, 5]).length == 0  # first page differs in its last token
    c.check_invariants()


@pytest.mark.parametrize("ps", [1, 4])
def test_insert_returns_already_cached_length_and_keeps_tree_slots(ps: int) -> None:
    a, c = make(ps)
    base = list(range(2 * ps))
    tree_slots = put(a, c, base)
    other = fresh_slots(a, 3 * ps)
    present = c.insert(base + [50] * ps, other)
    assert present == 2 * ps
    a.free(a.pages_of(other[:present]))  # caller still owned the duplicate part
    m = c.match_prefix(base + [50] * ps)
    assert m.length == 3 * ps
    assert torch.equal(m.slots, torch.cat([tree_slots, other[2 * ps :]]))  # tree kept its own slots
    assert c.insert(base, fresh_slots(a, 2 * ps)) == 2 * ps  # fully present: nothing adopted
    assert c.total_size == 3 * ps


@pytest.mark.parametrize("ps", [1, 4])
def test_insert_diverging_mid_edge_splits_and_branches(ps: int) -> None:
    a, c = make(ps)
    x = put(a, c, [1] * ps + [2] * ps + [3] * ps)
    y = put(a, c, [1] * ps + [2] * ps + [4] * ps)
    assert c.total_size == 4 * ps
    assert len(c.root.children) == 1
    mid = next(iter(c.root.children.values()))
    assert mid.key == tuple([1] * ps + [2] * ps) and len(mid.children) == 2
    assert torch.equal(c.match_prefix([1] * ps + [2] * ps + [3] * ps).slots, x)
    assert torch.equal(c.match_prefix([1] * ps + [2] * ps + [4] * ps).slots[2 * ps :], y[2 * ps :])


def test_insert_validates_lengths() -> None:
    a, c = make(4)
    with pytest.raises(ValueError):
        c.insert([1, 2, 3, 4], torch.arange(4, 7))  # 4 tokens, 3 slots
    with pytest.raises(ValueError):
        c.insert([1, 2, 3], torch.arange(4, 7))  # not a whole page
    with pytest.raises(ValueError):
        NoPrefixCache(a, 4).insert([1, 2], torch.arange(2))


def test_tensor_tokens_are_accepted() -> None:
    a, c = make(1)
    slots = put(a, c, [5, 6, 7])
    m = c.match_prefix(torch.tensor([5, 6, 9]))
    assert m.length == 2 and torch.equal(m.slots, slots[:2])


@pytest.mark.parametrize("ps", [1, 4])
def test_lock_moves_sizes_between_counters(ps: int) -> None:
    a, c = make(ps)
    put(a, c, [1] * (3 * ps))
    put(a, c, [1] * ps + [2] * ps)
    m = c.match_prefix([1] * (3 * ps))
    c.lock(m.node)
    assert (c.protected_size, c.evictable_size) == (3 * ps, ps) and c.active_locks == 1
    c.lock(m.node)
    assert c.protected_size == 3 * ps and m.node.lock_ref == 2
    m2 = c.match_prefix([1] * ps + [2] * ps)
    c.lock(m2.node)
    assert (c.protected_size, c.evictable_size) == (4 * ps, 0)
    c.check_invariants()
    for node in (m.node, m2.node, m.node):
        c.unlock(node)
        c.check_invariants()
    assert (c.protected_size, c.evictable_size, c.active_locks) == (0, 4 * ps, 0)
    with pytest.raises(RuntimeError):
        c.unlock(m.node)
    with pytest.raises(RuntimeError):
        c.unlock(c.root)
    c.lock(c.root)  # a request that matched nothing locks the root: counted, pins nothing
    assert c.active_locks == 1 and c.protected_size == 0
    c.unlock(c.root)
    c.check_invariants()


def test_split_of_a_locked_node_keeps_the_lock_on_both_halves() -> None:
    a, c = make(1)
    put(a, c, [1, 2, 3, 4])
    m = c.match_prefix([1, 2, 3, 4])
    c.lock(m.node)
    upper = c.match_prefix([1, 2, 9]).node  # splits the locked edge
    assert upper.key == (1, 2) and upper.lock_ref == 1 and m.node.key == (3, 4) and m.node.parent is upper
    assert c.protected_size == 4 and c.evictable_size == 0
    c.check_invariants()
    assert c.evict(100) == 0  # everything is pinned
    c.unlock(m.node)  # the original node object still unlocks the whole path
    assert c.protected_size == 0 and c.evictable_size == 4
    c.check_invariants()


@pytest.mark.parametrize("ps", [1, 4])
def test_eviction_is_lru_over_leaves(ps: int) -> None:
    a, c = make(ps)
    free0 = a.num_free_pages
    seqs = {name: [tok] * (2 * ps) for name, tok in (("A", 1), ("B", 2), ("C", 3))}
    slots = {name: put(a, c, s) for name, s in seqs.items()}
    c.match_prefix(seqs["A"])  # A becomes most recently used
    assert c.evict(1) == 2 * ps  # whole node: B, the least recently used
    assert c.match_prefix(seqs["B"]).length == 0
    assert bool(a.is_free_mask[a.pages_of(slots["B"])].all())
    assert c.evict(2 * ps) == 2 * ps  # then C
    assert c.match_prefix(seqs["C"]).length == 0 and c.match_prefix(seqs["A"]).length == 2 * ps
    assert c.evict(10**6) == 2 * ps and c.total_size == 0
    assert a.num_free_pages == free0
    c.check_invariants()


@pytest.mark.parametrize("ps", [1, 4])
def test_prefix_len_is_a_match_without_split_or_lru_touch(ps: int) -> None:
    a, c = make(ps)
    seqs = {name: [tok] * (3 * ps) for name, tok in (("A", 1), ("B", 2))}
    for s in seqs.values():
        put(a, c, s)
    nodes = len(c._nodes())
    probe = seqs["A"][: 2 * ps] + [7] * ps  # ends inside A's edge: a match would split it
    assert c.prefix_len(probe) == 2 * ps and c.prefix_len(seqs["A"] + [5]) == 3 * ps
    assert c.prefix_len([9] * ps) == 0 and c.prefix_len(seqs["B"][: 2 * ps - 1]) == ps  # whole pages only
    assert len(c._nodes()) == nodes  # no split
    c.check_invariants()
    assert c.evict(1) == 3 * ps and c.match_prefix(seqs["A"]).length == 0  # A is still the LRU one
    assert c.prefix_len(probe) == 0 == c.match_prefix(probe).length


def test_evict_frees_at_least_the_request_in_lru_order_and_stops() -> None:
    a, c = make(1)
    for t in range(5):
        put(a, c, [t, t])
    assert c.evict(3) == 4  # two oldest nodes (0 and 1), two tokens each
    assert [c.match_prefix([t, t]).length for t in range(5)] == [0, 0, 2, 2, 2]
    assert c.evict(0) == 0 and c.total_size == 6


def test_parent_becomes_a_candidate_after_its_children_go() -> None:
    a, c = make(1)
    put(a, c, [1, 2, 3, 4])
    put(a, c, [1, 2, 5, 6])
    put(a, c, [9, 9])
    c.match_prefix([9, 9])  # newest, so the [1,2] subtree goes first
    assert c.evict(5) == 6  # [3,4], [5,6], then their parent [1,2]
    assert c.match_prefix([1, 2]).length == 0 and c.match_prefix([9, 9]).length == 2
    c.check_invariants()


@pytest.mark.parametrize("ps", [1, 4])
def test_locked_nodes_survive_eviction(ps: int) -> None:
    a, c = make(ps)
    keep = put(a, c, [1] * ps + [2] * ps)
    put(a, c, [1] * ps + [3] * ps)
    put(a, c, [4] * ps)
    m = c.match_prefix([1] * ps + [2] * ps)
    c.lock(m.node)
    assert c.evict(10**6) == 2 * ps  # [3]-leaf and [4]; the shared [1] parent is locked via [2]
    assert c.total_size == c.protected_size == 2 * ps and c.evictable_size == 0
    assert torch.equal(c.match_prefix([1] * ps + [2] * ps).slots, keep)
    c.unlock(m.node)
    assert c.evict(10**6) == 2 * ps and c.total_size == 0
    c.check_invariants()


def test_lock_of_an_evicted_node_is_refused() -> None:
    a, c = make(1)
    put(a, c, [1, 2])
    node = c.match_prefix([1, 2]).node
    c.evict(2)
    with pytest.raises(RuntimeError, match="evicted"):
        c.lock(node)


def test_lru_stays_right_after_many_touches_and_heap_compaction() -> None:
    a, c = make(1, num_pages=256)
    for t in range(40):
        put(a, c, [t, 1000 + t])
    order = list(range(40))
    gen = torch.Generator().manual_seed(1)
    for _ in range(400):  # far more heap pushes than leaves: forces compaction
        t = int(torch.randint(0, 40, (), generator=gen))
        c.match_prefix([t, 1000 + t])
        order.remove(t)
        order.append(t)
    c.check_invariants()
    assert len(c._heap) <= 2 * len(c._leaves) + 64
    for t in order:  # evicting one node at a time follows the access order exactly
        assert t in c.root.children
        assert c.evict(1) == 2
        assert t not in c.root.children  # children are keyed by first token (page_size 1)


def test_all_slots_and_reset() -> None:
    a, c = make(4)
    s1 = put(a, c, list(range(8)))
    s2 = put(a, c, list(range(4)) + [9] * 8)
    assert sorted(c.all_slots().tolist()) == sorted(s1.tolist() + s2[4:].tolist())
    c.reset()
    assert c.total_size == 0 and c.all_slots().numel() == 0 and c.match_prefix(list(range(8))).length == 0
    a.reset()
    c.check_invariants()


def test_page_size_must_match_the_allocator() -> None:
    a = PageAllocator(8, 4)
    with pytest.raises(ValueError):
        RadixCache(a, 1)
    with pytest.raises(ValueError):
        NoPrefixCache(a, 2)


def test_check_invariants_catches_corruption() -> None:
    a, c = make(4)
    slots = put(a, c, list(range(8)))
    c._evictable_size += 1
    with pytest.raises(AssertionError, match="counters"):
        c.check_invariants()
    c._evictable_size -= 1
    a.free(a.pages_of(slots[4:]))  # a tree page wrongly freed behind the tree's back
    with pytest.raises(AssertionError, match="free in the allocator"):
        c.check_invariants()
    a.alloc(1)
    node = next(iter(c.root.children.values()))
    node.value = node.value.flip(0)  # no longer whole pages in order
    with pytest.raises(AssertionError, match="whole pages"):
        c.check_invariants()


def test_no_prefix_cache_contract() -> None:
    a = PageAllocator(8, 2)
    c = NoPrefixCache(a, 2)
    m = c.match_prefix([1, 2, 3, 4])
    assert m.length == 0 and m.node is c.root and m.slots.numel() == 0 and c.prefix_len([1, 2, 3, 4]) == 0
    assert c.insert([1, 2, 3, 4], torch.arange(4, 8)) == 4  # adopts nothing: caller keeps all
    assert c.total_size == c.evictable_size == c.protected_size == 0 and c.evict(100) == 0
    assert c.all_slots().numel() == 0
    c.lock(m.node)
    assert c.active_locks == 1
    c.unlock(m.node)
    with pytest.raises(RuntimeError):
        c.unlock(m.node)
    c.check_invariants()
