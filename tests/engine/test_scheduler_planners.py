"""The scheduler's planners on fakes: admission, chunking, retraction and the decode set, against a fake KV
manager and request table (no model, no KV pool: milliseconds each). The end-to-end tests (test_engine,
test_overlap) run the same planners under a real engine; these pin their rules one at a time."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gapless.config import EngineConfig
from gapless.engine.request import Extend, Req, ReqStatus
from gapless.engine.scheduler.budget import DecodeReserve
from gapless.engine.scheduler.decode import DecodePlanner
from gapless.engine.scheduler.kv import DecodeSlots
from gapless.engine.scheduler.prefill import PrefillPlanner
from gapless.engine.scheduler.queues import Queues
from gapless.engine.stats import EngineStats
from gapless.memory.cache_base import MatchResult
from gapless.sampling_params import SamplingParams

CONTEXT = 1000


class FakeReqTable:
    """Request-table rows, handed out lowest first."""

    def __init__(self, rows: int) -> None:
        self.free = list(range(rows))

    @property
    def num_free(self) -> int:
        return len(self.free)

    def alloc(self) -> int:
        return self.free.pop(0)


class FakeKV:
    """What the planners ask of `KVManager`, over a pool of `tokens` single-token pages and a prefix cache
    that knows, per prompt, how many of its tokens it holds (`cached`). It counts what it hands out, so a
    test can see every lock given back and every slot released."""

    page_size = 1

    def __init__(self, tokens: int, rows: int = 8, cached: dict[tuple[int, ...], int] | None = None) -> None:
        self.free_tokens = tokens
        self.req_table = FakeReqTable(rows)
        self.cached = cached or {}
        self.locks = 0
        self.released: list[Req] = []

    def pages(self, tokens: int) -> int:
        return tokens

    def available_tokens(self) -> int:
        return self.free_tokens

    def prefix_len(self, req: Req) -> int:
        return self.cached.get(tuple(req.prompt_ids), 0)

    def lock_prefix(self, req: Req) -> MatchResult:
        self.locks += 1
        n = self.prefix_len(req)
        return MatchResult(torch.arange(n), None, n)  # type: ignore[arg-type]

    def unlock(self, node: object) -> None:
        self.locks -= 1

    def admit(self, req: Req, match: MatchResult) -> int:
        self.locks -= 1  # the admitted request holds its prefix from now on
        req.row = self.req_table.alloc()
        req.cached_len = req.kv_len = match.length
        return req.row

    def alloc_extend(self, req: Req, n: int) -> torch.Tensor:
        assert n <= self.free_tokens, "a planner allocated past the pool"
        self.free_tokens -= n
        req.kv_len += n
        return torch.arange(n)

    def alloc_decode(self, reqs: list[Req]) -> DecodeSlots | None:
        if len(reqs) > self.free_tokens:
            return None
        self.free_tokens -= len(reqs)
        pos = np.array([r.kv_len for r in reqs], dtype=np.int64)
        for r in reqs:
            r.kv_len += 1
        return DecodeSlots(np.array([r.row for r in reqs], dtype=np.int64), pos, pos)

    def release(self, req: Req) -> None:
        self.free_tokens += req.kv_len
        assert req.row is not None
        self.req_table.free.append(req.row)
        req.row, req.kv_len = None, 0
        self.released.append(req)


def make_cfg(**kw) -> EngineConfig:
    kw = {"chunked_prefill_size": 64, "max_running_requests": 8, "schedule_policy": "fcfs", **kw}
    return EngineConfig(model="fake", **kw)


def make_req(i: int, prompt_len: int, max_tokens: int = 16, output: int = 0) -> Req:
    req = Req(f"r{i}", [100 * i + t for t in range(prompt_len)], SamplingParams(max_tokens=max_tokens), 0, i)
    req.output_ids = [7] * output
    return req


class Planners:
    """A prefill and a decode planner sharing queues, a fake KV manager and a decode reservation."""

    def __init__(self, kv: FakeKV, **cfg) -> None:
        self.cfg = make_cfg(**cfg)
        self.kv, self.queues, self.stats = kv, Queues(), EngineStats()
        self.reserve = DecodeReserve(self.cfg, CONTEXT)
        self.prefill = PrefillPlanner(self.cfg, self.queues, kv, self.reserve, self.stats)  # type: ignore[arg-type]
        self.decode = DecodePlanner(self.queues, kv, self.reserve, self.stats, CONTEXT)  # type: ignore[arg-type]

    def wait(self, *reqs: Req) -> None:
        self.queues.waiting.extend(reqs)

    def run(self, *reqs: Req) -> None:
        """`reqs` as running requests, each holding its sequence's KV in a row."""
        for r in reqs:
            r.row, r.kv_len = self.kv.req_table.alloc(), r.seq_len
            r.sampled, r.status = len(r.output_ids), ReqStatus.RUNNING
            self.kv.free_tokens -= r.kv_len
            self.queues.running.append(r)

    def entries(self) -> list[tuple[str, int]] | None:
        plan = self.prefill.schedule()
        return None if plan is None else [(e.req.rid, e.tokens) for e in plan.entries]


# ---------------------------------------------------------------- admission


def test_admission_fills_the_token_budget_and_chunks_the_request_that_overflows_it():
    p = Planners(FakeKV(1000), chunked_prefill_size=8)
    a, b, c = make_req(1, 5), make_req(2, 5), make_req(3, 5)
    p.wait(a, b, c)
    assert p.entries() == [("r1", 5), ("r2", 3)]  # 8 tokens: b's prompt is cut, c waits
    assert p.queues.running == [a] and p.queues.chunked is b and b.status is ReqStatus.PREFILL
    assert p.queues.waiting == [c] and a.kv_len == 5 and b.kv_len == 3
    assert p.entries() == [("r2", 2)]  # the chunked request's rest, alone
    assert p.queues.chunked is None and p.queues.running == [a, b]
    assert p.entries() == [("r3", 5)]
    assert p.entries() is None and p.kv.locks == 0


def test_a_budget_that_holds_the_longest_prompt_chunks_none():
    """SGLang's `--chunked-prefill-size -1` (the budget `max_model_len`, `engine.preflight`): a prompt that
    does not fit what the batch has left waits for the next batch, whole, rather than being cut to fill
    this one. A budget above `max_model_len` chunks as ever."""
    p = Planners(FakeKV(1000), chunked_prefill_size=8, max_model_len=8)
    a, b, c = make_req(1, 5), make_req(2, 5), make_req(3, 3)
    p.wait(a, b, c)
    assert p.entries() == [("r1", 5)]  # b waits (fcfs: c behind it too); with a budget under 8, b is cut
    assert p.queues.chunked is None and p.queues.waiting == [b, c] and p.kv.locks == 0
    assert p.entries() == [("r2", 5), ("r3", 3)]
    assert p.entries() is None and p.kv.locks == 0
    p = Planners(FakeKV(1000), chunked_prefill_size=8, max_model_len=6)
    p.wait(make_req(1, 5), make_req(2, 5))
    assert p.entries() == [("r1", 5), ("r2", 3)]


def test_a_long_prompt_is_prefilled_in_budget_sized_chunks_up_to_its_last_token():
    p = Planners(FakeKV(1000), chunked_prefill_size=8)
    req = make_req(1, 21)
    p.wait(req)
    chunks = []
    while (plan := p.prefill.schedule()) is not None:
        assert plan.entries == [Extend(req, plan.entries[0].tokens)]
        chunks.append(plan.entries[0].tokens)
        running = req in p.queues.running
        assert running == (req.kv_len == 21), "it decodes only once its whole prompt is scheduled"
    assert chunks == [8, 8, 5] and req.status is ReqStatus.RUNNING and req.cached_tokens == 0


def test_a_cached_prefix_is_not_recomputed_and_is_counted_once():
    prompt = make_req(1, 12)
    p = Planners(FakeKV(1000, cached={tuple(prompt.prompt_ids): 8}))
    p.wait(prompt)
    assert p.entries() == [("r1", 4)]
    assert prompt.kv_len == 12 and prompt.cached_tokens == 8 and p.stats.cached_prompt_tokens == 8


def test_lpm_admits_the_longest_cached_prefix_first_and_fcfs_by_arrival():
    def first_admitted(policy: str) -> str:
        a, b = make_req(1, 10), make_req(2, 10)
        kv = FakeKV(1000, cached={tuple(b.prompt_ids): 6})
        p = Planners(kv, schedule_policy=policy, chunked_prefill_size=4)  # room for one
        p.wait(a, b)
        entries = p.entries()
        assert entries is not None and len(entries) == 1
        return entries[0][0]

    assert first_admitted("lpm") == "r2"
    assert first_admitted("fcfs") == "r1"


def test_admission_stops_at_max_running_requests_and_at_the_last_free_row():
    p = Planners(FakeKV(1000), max_running_requests=2)
    p.wait(*(make_req(i, 3) for i in range(4)))
    assert p.entries() == [("r0", 3), ("r1", 3)]
    assert p.entries() is None, "the running set is full: nothing is planned"
    p.queues.running.pop()  # one finishes: its place is free again
    p.kv.req_table.free.append(1)
    assert p.entries() == [("r2", 3)]

    q = Planners(FakeKV(1000, rows=1))
    q.wait(make_req(1, 3), make_req(2, 3))
    assert q.entries() == [("r1", 3)]
    assert q.entries() is None and len(q.queues.waiting) == 1, "no request-table row left"


def test_admission_keeps_back_the_running_requests_decode_reservation():
    """A prompt that fits the free KV but not beside what the running requests may still decode waits;
    with nothing running, only its own slots must fit (retraction covers a wrong estimate)."""
    kv = FakeKV(100)
    p = Planners(kv, init_new_token_ratio=1.0, min_new_token_ratio=1.0)
    p.run(make_req(1, 10, max_tokens=50))  # reserves 50 of the 90 left
    newcomer = make_req(2, 30, max_tokens=30)
    p.wait(newcomer)
    assert p.entries() is None, "30 tokens + its own 30 + the running 50 do not fit 90"
    assert kv.locks == 0, "the refused request's prefix lock is given back"

    alone = Planners(FakeKV(40), init_new_token_ratio=1.0, min_new_token_ratio=1.0)
    alone.wait(make_req(3, 30, max_tokens=30))
    assert alone.entries() == [("r3", 30)], "alone, it needs only its own 30 slots"
    too_big = Planners(FakeKV(20))
    too_big.wait(make_req(4, 30))
    assert too_big.entries() is None and too_big.kv.free_tokens == 20


def test_the_admitted_reservation_counts_against_the_next_admission_in_the_same_batch():
    p = Planners(FakeKV(100), init_new_token_ratio=1.0, min_new_token_ratio=1.0)
    p.wait(make_req(1, 10, max_tokens=40), make_req(2, 10, max_tokens=40), make_req(3, 10, max_tokens=40))
    # first: 10 + 40 <= 100; second: 10 + 40 + 40 reserved <= 90; third: 10 + 40 + 80 > 80
    assert p.entries() == [("r1", 10), ("r2", 10)]


# ---------------------------------------------------------------- decode and retraction


def test_the_decode_set_leaves_out_requests_whose_last_token_is_in_flight():
    p = Planners(FakeKV(2000))
    going, at_max = make_req(1, 4, max_tokens=8), make_req(2, 4, max_tokens=8)
    near_context = make_req(3, CONTEXT - 2, max_tokens=100)
    p.run(going, at_max, near_context)
    at_max.sampled = 8  # its 8th token is launched, not yet processed
    near_context.sampled = 2  # prompt + 2 sampled fills the context
    plan = p.decode.schedule(lambda: pytest.fail("no drain: nothing to retract"))
    assert plan is not None and plan.reqs == [going]
    assert list(plan.slots.positions) == [4] and going.kv_len == 5
    at_max.sampled = near_context.sampled = 0
    going.sampled = 8
    plan = p.decode.schedule(lambda: False)
    assert plan is not None and plan.reqs == [at_max, near_context]


def test_no_decode_batch_without_running_requests_that_need_a_token():
    p = Planners(FakeKV(1000))
    assert p.decode.schedule(lambda: False) is None
    done = make_req(1, 4, max_tokens=2, output=2)
    p.run(done)
    assert p.decode.schedule(lambda: False) is None


def test_retraction_drains_first_then_sends_back_the_request_with_least_progress():
    kv = FakeKV(1000)
    p = Planners(kv)
    ahead, behind, long_prompt = make_req(1, 4, output=5), make_req(2, 4, output=1), make_req(3, 9, output=1)
    p.run(ahead, behind, long_prompt)
    kv.free_tokens = 2  # three decode slots needed, two free
    calls = []

    def drain() -> bool:
        calls.append(1)
        return len(calls) == 1  # the first call processes the in-flight batch; then nothing is left

    plan = p.decode.schedule(drain)
    # least output first; at a tie, the longer prompt (it frees more KV)
    assert len(calls) == 2 and kv.released == [long_prompt]
    assert plan is not None and plan.reqs == [ahead, behind]
    assert long_prompt.status is ReqStatus.WAITING and p.queues.waiting == [long_prompt]
    assert long_prompt.row is None and long_prompt.sampled == 1 and p.stats.retractions == 1
    assert p.reserve.ratio > 0.9, "a retraction raises the reservation ratio (from 0.7)"


def test_retraction_goes_on_until_the_rest_fit():
    kv = FakeKV(1000)
    p = Planners(kv)
    reqs = [make_req(i, 4, output=i) for i in range(4)]
    p.run(*reqs)
    kv.free_tokens = 0
    # each retraction frees its 4 + i tokens: r0 frees 4, enough for the 3 left
    plan = p.decode.schedule(lambda: False)
    assert kv.released == [reqs[0]] and plan is not None and plan.reqs == reqs[1:]


def test_the_chunked_request_is_retracted_when_one_request_runs():
    kv = FakeKV(1000, rows=4)
    p = Planners(kv, chunked_prefill_size=8)
    running, chunked = make_req(1, 4, output=3), make_req(2, 20)
    p.run(running)
    p.wait(chunked)
    assert p.entries() == [("r2", 8)] and p.queues.chunked is chunked
    kv.free_tokens = 0
    plan = p.decode.schedule(lambda: False)
    assert kv.released == [chunked] and p.queues.chunked is None and p.queues.waiting == [chunked]
    assert plan is not None and plan.reqs == [running]
