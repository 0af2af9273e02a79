"""The data-parallel router's choices (`gapless.server.router`) on fabricated prompts and loads, its prefix
tree's matching and eviction, and the replicas' cores and combined stats (`gapless.server.replicas`)."""

from __future__ import annotations

import pytest

from gapless.config import EngineConfig
from gapless.server.replicas import check_devices, combine_stats, replica_cores
from gapless.server.router import PrefixTree, Router

P = list(range(100, 140))  # a 40-token "system prompt"
Q = list(range(200, 240))  # another


def test_tree_matches_the_longest_prefix_and_splits_edges():
    tree = PrefixTree()
    tree.insert([1, 2, 3, 4])
    assert (tree.match([1, 2, 3, 9]), tree.match([1, 2, 3, 4, 5]), tree.match([2]), tree.match([])) == (
        3,
        4,
        0,
        0,
    )
    tree.insert([1, 2, 5])  # splits [1, 2, 3, 4] into [1, 2] -> [3, 4] and [5]
    assert tree.size == 5
    assert tree.match([1, 2, 5, 6]) == 3 and tree.match([1, 2, 3, 4]) == 4 and tree.match([1, 2]) == 2
    tree.insert([1, 2, 3, 4])  # already there: nothing added
    assert tree.size == 5


def test_tree_evicts_least_recently_used_leaves_to_its_capacity():
    tree = PrefixTree(capacity=6)
    tree.insert([1, 2, 3])
    tree.insert([4, 5, 6])
    tree.insert([1, 2, 3])  # used again: [4, 5, 6] is now the oldest
    tree.insert([7, 8, 9])
    assert tree.size == 6
    assert (tree.match([1, 2, 3]), tree.match([4, 5, 6]), tree.match([7, 8, 9])) == (3, 0, 3)
    # a parent left without children is a leaf, evicted in its turn
    tree = PrefixTree()
    tree.insert([1, 2, 3, 4])
    tree.insert([1, 2, 5, 6])
    tree.capacity = 1
    tree.trim()
    assert tree.size == 0 and tree.match([1, 2]) == 0 and not tree.root.children


def test_cache_aware_sends_a_shared_prefix_where_it_is_cached():
    r = Router(2, "cache_aware")
    assert r.route("a", P + [1]) == 0  # all equal: the lowest index
    assert r.route("b", Q + [1]) == 1  # no hit: the less loaded
    r.done("a")
    r.done("b")
    assert [r.route(f"q{i}", Q + [2, i]) for i in range(3)] == [1, 1, 1]  # Q is on 1, however loaded
    assert r.route("p", P + [2]) == 0
    assert r.loads() == [1, 3]


def test_cache_aware_falls_back_to_the_least_loaded_below_the_threshold():
    r = Router(2, "cache_aware", cache_threshold=0.5)
    r.route("a", P)
    # 10 of 40 tokens match replica 0's tree: below half, so the less loaded (1) takes it
    assert r.route("b", P[:10] + Q[:30]) == 1
    # equal loads: a new prefix goes to the replica caching less, where there is room
    r.done("a")
    r.done("b")
    r.route("c", list(range(300, 360)))  # no hit; equal trees (40 tokens each): replica 0, now 100
    r.done("c")
    assert [t.size for t in r.trees] == [100, 40]
    assert r.route("d", list(range(500, 510))) == 1


def test_cache_aware_balances_when_the_loads_drift_apart():
    r = Router(2, "cache_aware", balance_abs_threshold=2, balance_rel_threshold=1.5)
    assert [r.route(f"p{i}", P + [i]) for i in range(4)] == [0, 0, 0, 1]  # 3 - 0 > 2: imbalanced
    assert r.loads() == [3, 1]
    assert r.route("p4", P + [4]) == 1  # both hold P now: the less loaded of the two


def test_round_robin_and_shortest_queue_ignore_the_prompt():
    rr = Router(3, "round_robin")
    assert [rr.route(f"r{i}", P) for i in range(5)] == [0, 1, 2, 0, 1]
    sq = Router(2, "shortest_queue")
    assert [sq.route(f"s{i}", P) for i in range(2)] == [0, 1]
    sq.done("s0")
    assert sq.route("s2", Q) == 0 and sq.loads() == [1, 1]


def test_done_and_aborts_free_the_load_once():
    r = Router(2)
    r.route("a", P)
    assert r.replica_of("a") == 0 and r.loads() == [1, 0]
    r.done("a")
    r.done("a")  # an abort after the finish (or the other way round): nothing more
    assert r.replica_of("a") is None and r.loads() == [0, 0]
    one = Router(1)  # one replica: everything goes there, nothing is recorded
    assert one.route("x", P) == 0 and one.replica_of("unknown") == 0 and one.loads() == [0]


def test_set_capacity_trims_the_replicas_tree():
    r = Router(2)
    r.route("a", P)
    r.set_capacity(0, 10)
    assert r.trees[0].size == 0  # the whole 40-token edge goes: a replica that small cannot hold it


def test_bad_router_options_are_refused_by_name():
    with pytest.raises(ValueError, match="load balance method must be one of cache_aware, round_robin"):
        Router(2, "random")
    with pytest.raises(ValueError, match="data_parallel_size=0: must be >= 1"):
        EngineConfig("m", data_parallel_size=0)


def test_replica_cores_split_the_machine():
    assert [replica_cores(i, 2, [0, 1, 2, 3, 4]) for i in range(2)] == [[0, 1], [2, 3, 4]]
    assert replica_cores(1, 4, [0, 1]) == [0, 1]  # fewer cores than replicas: they share
    check_devices(EngineConfig("m", data_parallel_size=2), on_cuda=False, device_count=0)
    with pytest.raises(ValueError, match=r"needs GPUs up to cuda:2; this machine has 2"):
        check_devices(EngineConfig("m", device="cuda:1", data_parallel_size=2), on_cuda=True, device_count=2)


def test_combined_stats_sum_counts_and_name_a_failing_replica():
    a = {"prompt_tokens": 30, "cached_prompt_tokens": 10, "running_requests": 1, "integrity": "ok"}
    b = {"prompt_tokens": 10, "cached_prompt_tokens": 30, "running_requests": 0, "integrity": "failed: leak"}
    out = combine_stats([a, b])
    assert out["prompt_tokens"] == 40 and out["running_requests"] == 1 and out["prefix_hit_rate"] == 0.5
    assert out["integrity"] == "replica 1: failed: leak" and out["replicas"] == [a, b]
    assert combine_stats([a]) is a  # one replica: its stats as they are


def test_data_parallel_flags_and_the_offline_refusal():
    import argparse

    from gapless.cli import add_engine_args, engine_options
    from gapless.llm import LLM

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    for flags in (["--data-parallel-size", "2"], ["--dp", "2"], ["--dp-size", "2"], ["-dp", "2"]):
        assert engine_options(parser.parse_args(flags))["data_parallel_size"] == 2, flags
    with pytest.raises(ValueError, match="data_parallel_size=2: an engine in this process is one replica"):
        LLM("tiny-random", data_parallel_size=2)  # refused before anything loads


def test_tensor_parallel_replicas_are_refused_on_cuda_only():
    with pytest.raises(ValueError, match="data_parallel_size=2: .* on CUDA every replica's ranks"):
        EngineConfig(model="m", device="cuda", data_parallel_size=2, tensor_parallel_size=2)
    assert EngineConfig(model="m", device="cpu", data_parallel_size=2, tensor_parallel_size=2).nnodes == 1
