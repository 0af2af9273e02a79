"""Property-based tests: random request lifecycles against allocator + prefix cache + request table.

The state machine plays the engine: requests match and lock a prefix, allocate pages (evicting when
short), grow, commit chunks (``cache_unfinished``), finish (``cache_finished``), and the cache is
evicted at random. After every step every usable page must be owned by exactly one of: the free
list, the tree, one live request. A plain dict model of "what was inserted and not evicted" checks
that ``match_prefix`` returns the right slots.
"""

from dataclasses import dataclass

import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from gapless.memory.allocator import PageAllocator
from gapless.memory.cache_base import NoPrefixCache, PrefixCache, TreeNode
from gapless.memory.integrity import check_integrity
from gapless.memory.prefix_cache import HeldKV, alloc_pages, cache_finished, cache_unfinished
from gapless.memory.radix_cache import RadixCache
from gapless.memory.req_table import ReqTable

MAX_CONTEXT = 48


@dataclass(eq=False)
class SimReq:
    tokens: list[int]
    slots: torch.Tensor  # one slot per position; [0, cached_len) are the tree's
    node: TreeNode
    cached_len: int
    row: int

    def held(self) -> HeldKV:
        return HeldKV(self.tokens, self.slots, self.node, self.cached_len)


def cache_state(c: PrefixCache) -> object:
    """Everything a read-only lookup must leave as it was: every node's key, slots, links, locks and LRU
    stamp, the LRU clock and heap, the eviction candidates and the size counters."""
    if not isinstance(c, RadixCache):
        return c.active_locks
    nodes = [c.root, *c._nodes()]
    return (
        [
            (
                n.id,
                n.key,
                n.value.tolist(),
                n.parent.id if n.parent is not None else None,
                n.lock_ref,
                n.last_access,
                sorted(child.id for child in n.children.values()),
            )
            for n in nodes
        ],
        c._clock,
        [(t, i, n.id) for t, i, n in c._heap],
        {n.id for n in c._leaves},
        (c.evictable_size, c.protected_size, c.active_locks),
    )


class PrefixModel:
    """What the tree should hold: every cached page-aligned prefix -> the page holding its last page.

    Insert keeps existing entries (the tree keeps its own slots); eviction is learned by dropping
    entries whose page is no longer the tree's, after which the model must still be prefix-closed
    (eviction is leaves-first) and must still hold every locked prefix.
    """

    def __init__(self, page_size: int) -> None:
        self.ps = page_size
        self.pages: dict[tuple[int, ...], int] = {}

    def present(self, tokens: list[int]) -> int:
        n = 0
        while n + self.ps <= len(tokens) and tuple(tokens[: n + self.ps]) in self.pages:
            n += self.ps
        return n

    def insert(self, tokens: list[int], slots: torch.Tensor) -> int:
        present = self.present(tokens)
        for end in range(present + self.ps, len(tokens) + 1, self.ps):
            self.pages[tuple(tokens[:end])] = int(slots[end - self.ps]) // self.ps
        return present

    def match_slots(self, tokens: list[int], a: PageAllocator) -> torch.Tensor:
        n = self.present(tokens)
        pages = [self.pages[tuple(tokens[:end])] for end in range(self.ps, n + 1, self.ps)]
        return a.page_slots(torch.tensor(pages, dtype=torch.int64))

    def sync_evictions(self, tree_pages: set[int]) -> None:
        self.pages = {k: p for k, p in self.pages.items() if p in tree_pages}
        for k in self.pages:
            assert len(k) == self.ps or k[: -self.ps] in self.pages, f"evicted a non-leaf: {k[: -self.ps]}"


class MemoryMachine(RuleBasedStateMachine):
    @initialize(
        page_size=st.sampled_from([1, 4]),
        radix=st.sampled_from([True, True, True, False]),
        tight=st.booleans(),  # a tight pool exercises eviction and failed admission, a roomy one sharing
    )
    def setup(self, page_size: int, radix: bool, tight: bool) -> None:
        self.ps = page_size
        self.radix = radix
        tokens = 40 if tight else 160
        self.a = PageAllocator(num_pages=tokens // page_size + 1, page_size=page_size)
        self.c: PrefixCache = RadixCache(self.a, page_size) if radix else NoPrefixCache(self.a, page_size)
        self.t = ReqTable(max_rows=4, max_context=MAX_CONTEXT, device="cpu")
        self.model = PrefixModel(page_size)
        self.reqs: list[SimReq] = []
        self.history: list[list[int]] = []  # past prompts, to make shared prefixes likely

    # ---- helpers ----

    def tree_pages(self) -> set[int]:
        return set(self.a.pages_of(self.c.all_slots()).tolist())

    def sync(self) -> None:
        """Call after anything that may have evicted (before pages can be reused by an insert)."""
        if self.radix:
            self.model.sync_evictions(self.tree_pages())

    def check_match(self, tokens: list[int]) -> None:
        m = self.c.match_prefix(tokens)
        if self.radix:
            expected = self.model.match_slots(tokens, self.a)
            assert m.length == expected.numel() and torch.equal(m.slots, expected), (tokens, m, expected)
        else:
            assert m.length == 0

    def pick(self, i: int) -> SimReq:
        return self.reqs[i % len(self.reqs)]

    # ---- rules ----

    @rule(
        base=st.integers(0, 1000),
        cut=st.integers(0, 40),
        extra=st.lists(st.integers(0, 2), max_size=14),
    )
    def start_request(self, base: int, cut: int, extra: list[int]) -> None:
        tokens = (self.history[base % len(self.history)][:cut] if self.history else []) + extra
        self.admit(tokens)

    @precondition(lambda self: self.reqs)
    @rule(i=st.integers(0, 7), extra=st.lists(st.integers(0, 2), max_size=4))
    def fork_request(self, i: int, extra: list[int]) -> None:
        """Same prompt as a live request whose KV is not yet cached: it computes a duplicate copy."""
        self.admit(self.pick(i).tokens + extra)

    def admit(self, tokens: list[int]) -> None:
        tokens = tokens[:MAX_CONTEXT] or [0]
        row = self.t.alloc()
        if row is None:
            return
        self.check_match(tokens)
        m = self.c.match_prefix(tokens)
        self.c.lock(m.node)
        n_new = len(tokens) - m.length
        pages = alloc_pages(self.a, self.c, -(-n_new // self.ps))
        self.sync()
        if pages is None:  # no room even after eviction: the request is not admitted
            event("admission failed: out of pages")
            self.c.unlock(m.node)
            self.t.free(row)
            return
        req = SimReq(tokens, torch.cat([m.slots, self.a.page_slots(pages)[:n_new]]), m.node, m.length, row)
        self.t.write_host(row, 0, req.slots)
        self.reqs.append(req)
        self.history = (self.history + [tokens])[-8:]

    @precondition(lambda self: self.reqs)
    @rule(i=st.integers(0, 7), extra=st.lists(st.integers(0, 2), min_size=1, max_size=9))
    def extend_request(self, i: int, extra: list[int]) -> None:
        """Decode steps / a next prefill chunk: fill the partial page first, then new pages."""
        req = self.pick(i)
        n, k = len(req.tokens), min(len(extra), MAX_CONTEXT - len(req.tokens))
        if k == 0:
            return
        fill = min(k, (self.ps - n % self.ps) % self.ps)
        if fill:
            event("extend into a partial page")
        pages = alloc_pages(self.a, self.c, -(-(k - fill) // self.ps))
        self.sync()
        if pages is None:
            return
        in_tail = torch.empty(0, dtype=torch.int64)
        if fill:
            tail_page_start = int(req.slots[n - n % self.ps])
            in_tail = torch.arange(tail_page_start + n % self.ps, tail_page_start + n % self.ps + fill)
        new = torch.cat([in_tail, self.a.page_slots(pages)[: k - fill]])
        self.t.write_host(req.row, n, new)
        req.tokens = req.tokens + extra[:k]
        req.slots = torch.cat([req.slots, new])

    @precondition(lambda self: self.reqs)
    @rule(i=st.integers(0, 7))
    def commit_chunk(self, i: int) -> None:
        req = self.pick(i)
        aligned = len(req.tokens) // self.ps * self.ps
        expected_present = self.model.insert(req.tokens[:aligned], req.slots[:aligned]) if self.radix else 0
        free_before = self.a.num_free_pages
        m = cache_unfinished(self.c, self.a, req.held())
        prefix, node, cached = m.slots, m.node, m.length
        if self.a.num_free_pages > free_before:
            event("commit freed a duplicate prefix")
        assert cached == (aligned if self.radix else 0)
        assert expected_present >= req.cached_len
        if self.radix:
            assert torch.equal(prefix, self.model.match_slots(req.tokens[:aligned], self.a))
        req.slots = torch.cat([prefix, req.slots[cached:]])
        req.node, req.cached_len = node, cached
        self.t.write_host(req.row, 0, prefix)

    @precondition(lambda self: self.reqs)
    @rule(i=st.integers(0, 7))
    def finish_request(self, i: int) -> None:
        req = self.pick(i)
        self.finish(req)

    def finish(self, req: SimReq) -> None:
        aligned = len(req.tokens) // self.ps * self.ps
        if self.radix:
            self.model.insert(req.tokens[:aligned], req.slots[:aligned])
        own = set(self.a.pages_of(req.slots[req.cached_len :]).tolist())
        free_before = self.a.num_free_pages
        cache_finished(self.c, self.a, req.held())
        aligned_own = len(own) - (1 if len(req.tokens) % self.ps else 0)
        if self.a.num_free_pages - free_before > len(own) - aligned_own:
            event("finish freed a duplicate prefix")
        self.t.free(req.row)
        self.reqs.remove(req)
        # Each page the request owned is now either free or adopted by the tree.
        free = set(self.a.is_free_mask.nonzero().reshape(-1).tolist())
        assert own <= free | self.tree_pages()

    @rule(num_tokens=st.integers(0, 40))
    def evict(self, num_tokens: int) -> None:
        before = self.c.evictable_size
        freed = self.c.evict(num_tokens)
        event(f"evict freed {'some' if freed else 'nothing'}")
        self.sync()
        assert freed >= min(num_tokens, before) and self.c.evictable_size == before - freed

    @rule(
        base=st.integers(0, 1000),
        cut=st.integers(0, 40),
        extra=st.lists(st.integers(0, 2), max_size=8),
    )
    def match_only(self, base: int, cut: int, extra: list[int]) -> None:
        tokens = (self.history[base % len(self.history)][:cut] if self.history else []) + extra
        self.check_match(tokens)

    @rule(
        base=st.integers(0, 1000),
        cut=st.integers(0, 40),
        extra=st.lists(st.integers(0, 2), max_size=8),
    )
    def lookup_only(self, base: int, cut: int, extra: list[int]) -> None:
        """The scheduler's LPM ordering: the length a match would give, and nothing in the cache moves."""
        tokens = (self.history[base % len(self.history)][:cut] if self.history else []) + extra
        before = cache_state(self.c)
        n = self.c.prefix_len(tokens)
        assert cache_state(self.c) == before
        self.c.check_invariants()
        assert n == (self.model.present(tokens) if self.radix else 0)
        assert n == self.c.match_prefix(tokens).length

    @rule()
    def drain(self) -> None:
        for req in list(self.reqs):
            self.finish(req)
        check_integrity(self.a, self.c, self.t)

    # ---- invariants, after every step ----

    @invariant()
    def pages_have_exactly_one_owner(self) -> None:
        self.c.check_invariants()
        owners = [self.a.is_free_mask.nonzero().reshape(-1), self.a.pages_of(self.c.all_slots())]
        owners += [self.a.pages_of(r.slots[r.cached_len :]) for r in self.reqs]
        counts = torch.bincount(torch.cat(owners), minlength=self.a.num_pages)
        assert int(counts[0]) == 0, "page 0 handed out"
        assert bool((counts[1:] == 1).all()), f"pages with != 1 owner: {(counts != 1).nonzero().tolist()}"

    @invariant()
    def counters_and_locks_match_the_requests(self) -> None:
        assert self.c.active_locks == len(self.reqs)
        if not self.radix:
            assert self.c.total_size == 0
            return
        # The tree is a trie over pages: a locked token is a distinct locked page-aligned prefix.
        locked = {tuple(r.tokens[:i]) for r in self.reqs for i in range(self.ps, r.cached_len + 1, self.ps)}
        assert self.c.protected_size == self.ps * len(locked)
        assert self.c.total_size == self.ps * len(self.model.pages)
        assert self.c.evictable_size == self.c.total_size - self.c.protected_size
        for r in self.reqs:
            assert torch.equal(
                r.slots[: r.cached_len], self.model.match_slots(r.tokens[: r.cached_len], self.a)
            )

    @invariant()
    def host_rows_mirror_the_requests(self) -> None:
        for r in self.reqs:
            assert torch.equal(self.t.host_table[r.row, : len(r.slots)].long(), r.slots)

    def teardown(self) -> None:
        if not hasattr(self, "c"):
            return
        for req in list(self.reqs):
            self.finish(req)
        check_integrity(self.a, self.c, self.t)
        self.c.evict(self.c.evictable_size)
        assert self.c.total_size == 0 and self.a.num_free_pages == self.a.num_usable_pages
        check_integrity(self.a, self.c, self.t)


TestMemoryMachine = MemoryMachine.TestCase
TestMemoryMachine.settings = settings(
    max_examples=200,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@settings(max_examples=150, deadline=None)
@given(
    page_size=st.sampled_from([1, 4]),
    ops=st.lists(st.tuples(st.booleans(), st.lists(st.integers(0, 2), max_size=20)), min_size=1, max_size=30),
)
def test_match_prefix_agrees_with_a_dict_model(page_size: int, ops: list[tuple[bool, list[int]]]) -> None:
    """Inserts (no eviction) and matches in random order: every match equals the model's answer, and the
    read-only lookup before it gives the same length and changes nothing."""
    a = PageAllocator(num_pages=400, page_size=page_size)
    c = RadixCache(a, page_size)
    model = PrefixModel(page_size)
    for is_insert, tokens in ops:
        if is_insert:
            tokens = tokens[: len(tokens) // page_size * page_size]
            pages = a.alloc(len(tokens) // page_size)
            assert pages is not None
            slots = a.page_slots(pages)
            present = c.insert(tokens, slots)
            assert present == model.insert(tokens, slots)
            a.free(a.pages_of(slots[:present]))
        else:
            before = cache_state(c)
            length = c.prefix_len(tokens)
            assert cache_state(c) == before
            m = c.match_prefix(tokens)
            assert length == m.length
            expected = model.match_slots(tokens, a)
            assert m.length == expected.numel() and torch.equal(m.slots, expected)
            full = tokens[: len(tokens) // page_size * page_size]
            assert m.length == model.present(full) and tuple(m.node.key) == tuple(
                full[m.length - len(m.node.key) : m.length]
            )
        c.check_invariants()
    assert c.total_size == page_size * len(model.pages)
