"""Data-parallel replicas behind one server (`--dp 2`, `gapless.server.router`): both replicas serve, the
cache-aware router's measured prefix hit rate beats round robin's on a shared-prefix workload, greedy
tokens through two replicas equal one engine's (the `openai` client), aborts reach the replica that runs
the request, no replica leaks KV, `/metrics` labels each replica, and a replica that dies ends the server
with an error naming it and no process left."""

from __future__ import annotations

import contextlib
import os
import signal
import threading

import httpx
import openai
import pytest

from gapless.bench.router import hit_rate, replica_counts, shared_prefix_workload
from gapless.engine.preflight import ALLOW_LONG_MAX_MODEL_LEN_ENV
from gapless.testing.server import ServerProcess, alive, wait_until
from tests.server.conftest import API_KEY

# (two engine replicas behind a router, ~16 s in all: the slow tier, which CI runs after `make test`)
pytestmark = pytest.mark.slow

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
# the session server's options (tests/server/conftest.py), so greedy tokens can be compared with it, but a
# context long enough that a request cannot finish before its abort arrives (the rope is the default one:
# the context's length changes no token)
LONG = 16384
OPTIONS = (
    "--device",
    "cpu",
    "--kv-cache-tokens",
    "65536",
    "--max-model-len",
    str(LONG),
    "--api-key",
    API_KEY,
)


def _start(ckpt_factory, method: str) -> ServerProcess:
    return ServerProcess(
        "--model",
        str(ckpt_factory("qwen3")),
        *OPTIONS,
        "--dp",
        "2",
        "--load-balance-method",
        method,
        env={ALLOW_LONG_MAX_MODEL_LEN_ENV: "1"},
    )


@pytest.fixture(scope="module")
def servers(ckpt_factory):
    """A cache-aware and a round-robin server, started side by side (each start is mostly waiting)."""
    ckpt_factory("qwen3")  # built once, before two processes look for it
    started: dict[str, ServerProcess] = {}
    failed: list[str] = []

    def start(method: str) -> None:
        try:
            started[method] = _start(ckpt_factory, method)
        except RuntimeError as e:
            failed.append(str(e))

    threads = [threading.Thread(target=start, args=(m,)) for m in ("cache_aware", "round_robin")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failed:
        for srv in started.values():
            srv.stop()
        pytest.fail("\n".join(failed))
    workers = {m: srv.workers() for m, srv in started.items()}
    yield started
    for srv in started.values():
        srv.signal(signal.SIGTERM)  # both stop at once
    # the cache-aware one ends cleanly; the round-robin one lost a replica in the last test
    assert started["cache_aware"].stop() == 0, started["cache_aware"].output
    for srv in started.values():
        srv.stop()
    left = set().union(*workers.values())
    assert wait_until(lambda: not any(alive(p) for p in left), 10), "workers outlived the servers"


@pytest.fixture(scope="module")
def dp(servers):
    return servers["cache_aware"]


@pytest.fixture(scope="module")
def rr(servers):
    return servers["round_robin"]


def _state(url: str) -> dict:
    r = httpx.get(f"{url}/debug/state", headers=HEADERS, timeout=30)
    r.raise_for_status()
    return r.json()


def _idle_and_clean(url: str) -> dict:
    """Wait until no replica runs anything and every one's KV integrity check passed."""
    state: dict = {}

    def clean() -> bool:
        nonlocal state
        state = _state(url)
        return state["integrity"] == "ok" and state["api_open_requests"] == 0

    assert wait_until(clean, 30), state
    assert [r["kv_used_tokens"] for r in state["replicas"]] == [0, 0], state
    assert [r["running_requests"] for r in state["replicas"]] == [0, 0], state
    return state


# 4 system prompts of 64 tokens, 4 questions of 4 tokens each, shuffled: round robin sends every prompt
# to both replicas (checked below), so each replica computes each once; cache-aware computes each once
PREFIXES, PREFIX_LEN, PER_PREFIX, QUESTION_LEN = 4, 64, 4, 4
N = PREFIXES * PER_PREFIX
HIT_CACHE_AWARE = (N - PREFIXES) * PREFIX_LEN / (N * (PREFIX_LEN + QUESTION_LEN))  # 0.706
HIT_ROUND_ROBIN = (N - 2 * PREFIXES) * PREFIX_LEN / (N * (PREFIX_LEN + QUESTION_LEN))  # 0.471


def _serve_workload(url: str) -> tuple[float, list[float]]:
    """Send the shared-prefix workload one request at a time; the replicas' hit rate and shares."""
    work = shared_prefix_workload(PREFIXES, PREFIX_LEN, PER_PREFIX, QUESTION_LEN, output_len=2, seed=1)
    prefix_of = [tuple(p[:PREFIX_LEN]) for p in work.prompts]
    assert len({(prefix, i % 2) for i, prefix in enumerate(prefix_of)}) == 2 * PREFIXES  # see above
    before = replica_counts(url, HEADERS)
    with httpx.Client(base_url=url, headers=HEADERS, timeout=60) as c:
        for prompt in work.prompts:
            body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True}
            assert c.post("/v1/completions", json=body).status_code == 200
    return hit_rate(before, replica_counts(url, HEADERS))


@pytest.mark.slow
def test_cache_aware_routing_hits_more_than_round_robin_and_both_replicas_serve(dp, rr):
    aware, shares = _serve_workload(dp.url)
    robin, robin_shares = _serve_workload(rr.url)
    print(f"prefix hit rate: cache_aware {aware:.3f} (shares {shares}), round_robin {robin:.3f}")
    assert aware >= HIT_CACHE_AWARE - 0.01 and robin <= HIT_ROUND_ROBIN + 0.01, (aware, robin)
    assert aware - robin > 0.2
    assert min(shares) > 0.2 and min(robin_shares) > 0.2, (shares, robin_shares)  # both replicas serve
    _idle_and_clean(dp.url)
    _idle_and_clean(rr.url)


def test_greedy_tokens_through_two_replicas_equal_one_engine(server, dp):
    prompts = ["replicas agree", "two engines, one answer", "data parallel greedy", "route me anywhere"]
    answers = []
    for url in (server.url, dp.url):
        oai = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)
        model = oai.models.list().data[0].id
        kw = dict(model=model, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
        choices = [oai.completions.create(prompt=p, logprobs=1, **kw).choices[0] for p in prompts]
        out: list[object] = [(c.text, c.logprobs.tokens) for c in choices]
        stream = oai.completions.create(prompt=prompts[0] + "!", stream=True, **kw)
        out.append("".join(chunk.choices[0].text for chunk in stream if chunk.choices))
        answers.append(out)
    assert answers[0] == answers[1]
    shares = [r["prompt_tokens"] for r in _state(dp.url)["replicas"]]
    assert all(shares), shares
    _idle_and_clean(dp.url)


def test_aborts_reach_the_replica_running_the_request(dp):
    """Two streams land on the two replicas (the second goes to the less loaded: the first is in flight);
    both clients go away mid-stream: each replica generated some tokens and stopped long before
    max_tokens (a minute of work), and neither leaks KV."""
    before = [r["generated_tokens"] for r in _state(dp.url)["replicas"]]
    with contextlib.ExitStack() as open_streams:
        for prompt in ("cut this stream", "xylophone keeps playing"):
            c = open_streams.enter_context(httpx.Client(base_url=dp.url, headers=HEADERS, timeout=60))
            body = {"prompt": prompt, "max_tokens": LONG - 100, "ignore_eos": True, "stream": True}
            r = open_streams.enter_context(c.stream("POST", "/v1/completions", json=body))
            assert r.status_code == 200
            lines = r.iter_lines()  # kept: a closed iterator would close the stream
            assert next(line for line in lines if line.startswith("data:"))
    # leaving the block closed both connections mid-stream
    state = _idle_and_clean(dp.url)
    generated = [r["generated_tokens"] - b for r, b in zip(state["replicas"], before)]
    assert all(0 < n < LONG - 100 for n in generated), generated
    metrics = httpx.get(f"{dp.url}/metrics", headers=HEADERS).text
    for i in (0, 1):
        assert f'gapless_num_requests_running{{replica="{i}"}} 0.0' in metrics
        assert f'gapless_integrity_ok{{replica="{i}"}} 1.0' in metrics
    assert httpx.get(f"{dp.url}/health").json() == {"status": "ok"}


def test_a_dead_replica_ends_the_server_naming_it(rr):
    workers = rr.workers()
    pids = _state(rr.url)["worker_pids"]
    assert {"scheduler-0", "scheduler-1"} <= set(pids)
    os.kill(pids["scheduler-1"], signal.SIGKILL)
    assert rr.wait(30) == 1
    assert "gapless: exiting: the scheduler-1 worker exited with code -9" in rr.output, rr.output
    assert wait_until(lambda: not any(alive(p) for p in workers), 10), "processes outlived the server"
