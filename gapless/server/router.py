"""Which data-parallel replica serves a request (`--load-balance-method`, SGLang's flag and names).

With `--data-parallel-size N` the server runs N engine replicas, each with its own prefix cache. A
request whose prompt shares a long prefix with earlier ones (a system prompt, a few-shot header, a
conversation's history) is computed once per replica that sees it: sending it where that prefix already
is saves the prefill, and sending every prefix everywhere (round robin) fills each replica's cache with
all of them, so each keeps less of each. The router lives in the tokenizer stage, the one place that
sees both a request's token ids and every abort behind it.

- `cache_aware` (the default): the router keeps an approximate copy of each replica's prefix cache, a
  token radix tree of the prompts it sent there, trimmed least recently used first to the replica's KV
  size (`PrefixTree`). A request goes to the replica whose tree holds the longest prefix of its prompt
  when that covers at least `cache_threshold` of it (ties: the less loaded). Otherwise, or when the
  loads (requests in flight) drift apart by more than `balance_abs_threshold` requests and
  `balance_rel_threshold` times, it goes to the least loaded replica (ties: the one caching least, so
  a new prefix lands where there is room). This is SGLang router's cache-aware policy, on token ids.
- `round_robin`: replica 0, 1, ..., N-1, 0, ... whatever the prompt (for comparison).
- `shortest_queue`: the replica with the fewest requests in flight (ties: the lowest index).

A replica's load is the requests the router sent it that have not finished: the replica reports the
ones that finished (`ReplicaReport`), the router itself sees the aborts.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

LOAD_BALANCE_METHODS = ("cache_aware", "round_robin", "shortest_queue")


class _Node:
    """One edge of a `PrefixTree`: its tokens, its children by their first token, and when it was last
    on a matched or inserted path."""

    __slots__ = ("children", "last_used", "parent", "tokens")

    def __init__(self, tokens: list[int], parent: _Node | None, last_used: int) -> None:
        self.tokens = tokens
        self.parent = parent
        self.children: dict[int, _Node] = {}
        self.last_used = last_used


def _common(a: Sequence[int], start: int, b: list[int]) -> int:
    """How many of `b`'s tokens equal `a`'s from `start` on."""
    n = min(len(b), len(a) - start)
    i = 0
    while i < n and a[start + i] == b[i]:
        i += 1
    return i


class PrefixTree:
    """The prompts sent to one replica, as a radix tree of token ids, holding at most `capacity` tokens
    (None: unbounded): an approximation of what that replica's prefix cache holds. The replica caches
    outputs too and evicts by its own clock, so the copy is approximate; it only steers routing."""

    def __init__(self, capacity: int | None = None) -> None:
        self.capacity = capacity
        self.size = 0  # tokens in the tree
        self._clock = itertools.count(1)
        self.root = _Node([], None, 0)

    def match(self, ids: Sequence[int]) -> int:
        """The length of the longest prefix of `ids` in the tree (read only)."""
        node, pos = self.root, 0
        while pos < len(ids) and (child := node.children.get(ids[pos])) is not None:
            common = _common(ids, pos, child.tokens)
            pos += common
            if common < len(child.tokens):
                break
            node = child
        return pos

    def insert(self, ids: Sequence[int]) -> None:
        """Add `ids` (its path becomes the most recently used), then trim the tree to its capacity."""
        now = next(self._clock)
        node, pos = self.root, 0
        while pos < len(ids):
            child = node.children.get(ids[pos])
            if child is None:
                leaf = _Node(list(ids[pos:]), node, now)
                node.children[ids[pos]] = leaf
                self.size += len(leaf.tokens)
                break
            common = _common(ids, pos, child.tokens)
            if common < len(child.tokens):
                child = self._split(child, common)
            child.last_used = now
            node, pos = child, pos + common
        self.trim()

    def _split(self, node: _Node, at: int) -> _Node:
        """Cut `node`'s edge after `at` tokens; the new upper part, which keeps the node's place."""
        parent = node.parent
        assert parent is not None
        upper = _Node(node.tokens[:at], parent, node.last_used)
        parent.children[upper.tokens[0]] = upper
        node.tokens, node.parent = node.tokens[at:], upper
        upper.children[node.tokens[0]] = node
        return upper

    def _leaves(self) -> list[_Node]:
        found, stack = [], [self.root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if not node.children and node is not self.root:
                found.append(node)
        return found

    def trim(self) -> None:
        """Drop least recently used leaves (a whole edge at a time) until the tree fits its capacity."""
        if self.capacity is None or self.size <= self.capacity:
            return
        leaves = sorted(self._leaves(), key=lambda n: n.last_used, reverse=True)
        while self.size > self.capacity and leaves:
            leaf = leaves.pop()
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.tokens[0]]
            self.size -= len(leaf.tokens)
            if parent is not self.root and not parent.children:  # the parent is a leaf now
                leaves.append(parent)
                leaves.sort(key=lambda n: n.last_used, reverse=True)


class Router:
    """Picks the replica of each request by `method` (one of `LOAD_BALANCE_METHODS`) and tracks the
    requests in flight on each. One replica: everything goes to it and nothing is tracked."""

    def __init__(
        self,
        replicas: int,
        method: str = "cache_aware",
        *,
        cache_threshold: float = 0.5,
        balance_abs_threshold: int = 16,
        balance_rel_threshold: float = 1.5,
    ) -> None:
        if method not in LOAD_BALANCE_METHODS:
            known = ", ".join(LOAD_BALANCE_METHODS)
            raise ValueError(f"load balance method must be one of {known}, not {method!r}")
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1, not {replicas}")
        self.replicas, self.method = replicas, method
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold, self.balance_rel_threshold = balance_abs_threshold, balance_rel_threshold
        self.trees = [PrefixTree() for _ in range(replicas)]
        self.in_flight: list[set[str]] = [set() for _ in range(replicas)]
        self.where: dict[str, int] = {}  # rid -> its replica, while in flight
        self.sent = [0] * replicas  # requests sent to each replica, in all
        self._turn = itertools.count()

    def loads(self) -> list[int]:
        return [len(rids) for rids in self.in_flight]

    def set_capacity(self, replica: int, tokens: int) -> None:
        """The replica's KV cache holds `tokens`: its tree keeps no more than that."""
        tree = self.trees[replica]
        tree.capacity = tokens
        tree.trim()

    def route(self, rid: str, ids: Sequence[int]) -> int:
        """The replica that serves request `rid` with prompt `ids`; it is counted in flight there."""
        if self.replicas == 1:
            return 0
        replica = self.choose(ids)
        self.in_flight[replica].add(rid)
        self.where[rid] = replica
        self.sent[replica] += 1
        if self.method == "cache_aware":
            self.trees[replica].insert(ids)
        return replica

    def choose(self, ids: Sequence[int]) -> int:
        """The replica `method` picks for a prompt `ids` now (nothing is recorded)."""
        if self.method == "round_robin":
            return next(self._turn) % self.replicas
        loads = self.loads()
        least = min(range(self.replicas), key=lambda r: (loads[r], self.trees[r].size, r))
        if self.method == "shortest_queue" or self._imbalanced(loads):
            return least
        matched = [tree.match(ids) for tree in self.trees]
        best = max(range(self.replicas), key=lambda r: (matched[r], -loads[r], -r))
        if matched[best] > 0 and matched[best] >= self.cache_threshold * len(ids):
            return best
        return least

    def _imbalanced(self, loads: list[int]) -> bool:
        low, high = min(loads), max(loads)
        return high - low > self.balance_abs_threshold and high > self.balance_rel_threshold * low

    def replica_of(self, rid: str) -> int | None:
        """Where request `rid` runs (None: it is not in flight, or there is one replica and no record)."""
        if self.replicas == 1:
            return 0
        return self.where.get(rid)

    def done(self, rid: str) -> None:
        """Request `rid` finished or was aborted (again: nothing)."""
        replica = self.where.pop(rid, None)
        if replica is not None:
            self.in_flight[replica].discard(rid)
