"""Several API server processes (`--api-server-count 2`, `gapless.server.api_process`): the workers send
each message to the API server that submitted its request, both processes take connections on the one
port and answer to the token as one does (the `openai` client, concurrently), `/metrics` adds up both
processes' figures from either, a stream cut short on either frees its KV, a shutdown ends the open streams
on both and leaves no process, and an API server that dies ends the server with an error naming it."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from gapless.server import protocol as P
from gapless.testing.server import ServerProcess, alive, wait_until
from tests.server.conftest import API_KEY, same_answers, wait_idle_and_clean

# (several API server processes a test, ~35 s in all: the slow tier, which CI runs after `make test`)
pytestmark = pytest.mark.slow

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
SHUTDOWN_S = 15.0


def _delta(rid: str) -> P.ReqDelta:
    return P.ReqDelta(rid, "x", [1], 1, 1, 0)


def test_workers_send_each_message_to_the_api_server_that_asked():
    first, second = P.request_id(0, "aa"), P.request_id(1, "bb")
    assert [P.api_server_of(f"{rid}-0") for rid in (first, second)] == [0, 1]
    deltas = P.Deltas([_delta(f"{first}-0"), _delta(f"{second}-0"), _delta(f"{first}-1")])
    split = P.to_api_servers(deltas, 2)
    assert [(k, [d.rid for d in m.deltas]) for k, m in split] == [  # type: ignore[union-attr]
        (0, [f"{first}-0", f"{first}-1"]),
        (1, [f"{second}-0"]),
    ]
    assert P.to_api_servers(deltas, 1) == [(0, deltas)]  # one API server: as it came
    assert P.to_api_servers(P.ReqError(f"{second}-3", "bad"), 2)[0][0] == 1
    assert P.to_api_servers(P.Refused([f"{second}-0", f"{second}-1"], "bad"), 2)[0][0] == 1
    assert P.to_api_servers(P.StatsOut(7, {}, api_server=1), 2)[0][0] == 1
    for msg in (P.Ready("tokenizer"), P.Failed("scheduler", "trace")):  # to the one that started them
        assert P.to_api_servers(msg, 2) == [(0, msg)]
    stats = P.decode(P.encode(P.StatsReq(3, api_server=1)))
    assert stats == P.StatsReq(3, 1)  # the asking API server survives the socket


def test_the_detokenizer_sends_each_api_server_its_own_deltas_and_stats(tmp_path):
    """Over real sockets: one step's updates for requests of API servers 0 and 1 reach each as a `Deltas`
    of its own requests alone (decoded, counted as two messages out), and a stats answer reaches the API
    server that asked."""
    import zmq

    from gapless.default_model.tokenizer import build_tokenizer
    from gapless.server.workers.detokenizer import DetokenizerStage
    from gapless.server.workers.sockets import Endpoints, Sockets

    ends = Endpoints.in_dir(str(tmp_path), api_servers=2)
    ctx = zmq.Context()
    pulls = [ctx.socket(zmq.PULL) for _ in ends.apis]
    for pull, addr in zip(pulls, ends.apis):
        pull.bind(addr)
    socks = Sockets((), {}, ends.apis)
    try:
        tok = build_tokenizer()
        stage = DetokenizerStage(tok, socks)
        rids = [f"{P.request_id(k, 'ab')}-0" for k in (0, 1)]
        ids = [tok.encode("hello", add_special_tokens=False), tok.encode(" world", add_special_tokens=False)]
        done = {"finish_reason": "length", "stop": []}
        stage.take(P.Updates([P.ReqUpdate(rid, t, 2, 0, **done) for rid, t in zip(rids, ids)]))
        for k, pull in enumerate(pulls):
            assert pull.poll(5000)
            msg = P.decode(pull.recv())
            assert isinstance(msg, P.Deltas) and [d.rid for d in msg.deltas] == [rids[k]]
            assert msg.deltas[0].text == tok.decode(ids[k])
        assert stage.hops == {"hop_detokenizer_updates_in": 1, "hop_detokenizer_deltas_out": 2}
        stage.take(P.StatsOut(5, {"running_requests": 0}, api_server=1))
        assert pulls[1].poll(5000) and not pulls[0].poll(100)
        stats = P.decode(pulls[1].recv())
        assert (
            isinstance(stats, P.StatsOut)
            and stats.ticket == 5
            and stats.stats["hop_detokenizer_deltas_out"] == 2
        )
    finally:
        socks.close()
        for pull in pulls:
            pull.close(linger=0)
        ctx.term()


def test_the_count_is_a_whole_number_from_one_under_either_name():
    import argparse

    from gapless.server.serve_args import add_serve_args

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    assert parser.parse_args(["m"]).api_server_count == 1
    assert parser.parse_args(["m", "-asc", "3"]).api_server_count == 3  # vLLM's short flag
    for bad in ("0", "-1", "two"):
        with pytest.raises(SystemExit):
            parser.parse_args(["m", "--api-server-count", bad])


def _options(server: ServerProcess) -> list[str]:
    """The session server's model and options, as given (so that both answer alike)."""
    return server.proc.args[server.proc.args.index("--port") + 2 :]


@pytest.fixture(scope="module")
def two(server):
    srv = ServerProcess(*_options(server), "--api-server-count", "2")
    workers = srv.workers()
    yield srv
    assert srv.stop() == 0, srv.output
    assert wait_until(lambda: not any(alive(p) for p in workers), 10), "workers outlived the server"


def _submitted(url: str) -> dict[str, float]:
    """Each API server's count of requests taken, from /metrics (whichever process answers)."""
    text = httpx.get(f"{url}/metrics", headers=HEADERS, timeout=30).text
    found = re.findall(r'^gapless_api_server_requests_total\{api_server="(\d+)"\} (\S+)$', text, re.M)
    return {k: float(v) for k, v in found}


def _metric(url: str, pattern: str) -> float:
    """The value of the /metrics series whose name and labels match `pattern` (0 if none)."""
    text = httpx.get(f"{url}/metrics", headers=HEADERS, timeout=30).text
    found = re.search(rf"^{pattern} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def test_two_api_servers_answer_alike_to_the_token(two, session_answers):
    assert "2 API server processes" in two.output
    assert same_answers(two.url) == session_answers


def test_both_take_connections_and_the_metrics_add_up(two, server):
    """Rounds of concurrent requests, each on a connection of its own, until both API servers took some:
    every answer is the one-API-server session's, and either API server's /metrics counts all of them."""
    finished = r'gapless_requests_total\{finish_reason="length",model="[^"]+"\}'
    model = httpx.get(f"{two.url}/v1/models", headers=HEADERS, timeout=30).json()["data"][0]["id"]
    before, finished_before = _submitted(two.url), _metric(two.url, finished)

    async def ask(url: str, prompt: list[int]) -> str:
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0) as c:
            r = await c.completions.create(
                model=model, prompt=prompt, max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
            )
            return r.choices[0].text

    async def round_of(url: str, base: int) -> list[str]:
        return await asyncio.gather(*(ask(url, [900 + base + i, 901]) for i in range(12)))

    sent = 0
    for k in range(10):
        got = asyncio.run(round_of(two.url, 12 * k))
        assert got == asyncio.run(round_of(server.url, 12 * k))
        sent += 12
        taken = {name: n - before.get(name, 0.0) for name, n in _submitted(two.url).items()}
        if len(taken) == 2 and min(taken.values()) > 0:
            break
    assert set(taken) == {"0", "1"} and min(taken.values()) > 0, taken
    assert sum(taken.values()) == sent
    assert _metric(two.url, finished) - finished_before == sent
    assert _metric(two.url, "gapless_api_requests_in_flight") == 0  # summed over both
    # /debug/state names the API server that answered, and both list every worker, the other API's too
    # (each answered by the scheduler for it, not its last counters: idle, so checked)
    seen: dict[int, dict] = {}
    for _ in range(200):
        state = _state(two.url)
        assert state["integrity"] == "ok", state
        seen[state["api_server"]] = state["worker_pids"]
        if len(seen) == 2:
            break
    assert set(seen) == {0, 1} and seen[0] == seen[1] and "api-1" in seen[0], seen


def _state(url: str) -> dict:
    with httpx.Client(headers=HEADERS, timeout=30) as c:  # a new connection each time
        return c.get(f"{url}/debug/state").json()


class _Streams:
    """Long streams opened on connections of their own until each API server took at least one (by its
    count in /metrics); `close()` cuts them, `read_all()` reads them to their end."""

    def __init__(self, url: str, most: int = 24) -> None:
        self.client = httpx.Client(
            timeout=60, headers=HEADERS, limits=httpx.Limits(max_keepalive_connections=0)
        )
        self.open: list[tuple[httpx.Response, Iterator[str]]] = []
        before = _submitted(url)
        body = {"prompt": [5, 6], "max_tokens": 400, "ignore_eos": True, "stream": True}
        for _ in range(most):
            r = self.client.send(
                self.client.build_request("POST", f"{url}/v1/completions", json=body), stream=True
            )
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")  # running
            self.open.append((r, lines))
            taken = {k: n - before.get(k, 0.0) for k, n in _submitted(url).items()}
            if len(taken) == 2 and min(taken.values()) > 0:
                return
        raise AssertionError(f"one API server took all {most} streams: {taken}")

    def close(self) -> None:
        for r, _ in self.open:
            r.close()
        self.client.close()

    def read_all(self) -> list[list[str]]:
        """Every stream's remaining data lines."""
        out = [[line for line in lines if line.startswith("data: ")] for _, lines in self.open]
        self.close()
        return out


def test_streams_cut_short_on_either_api_server_free_their_kv(two):
    streams = _Streams(two.url)
    streams.close()  # each API server aborts its own
    with httpx.Client(base_url=two.url, headers=HEADERS, timeout=60) as c:
        state = wait_idle_and_clean(c)
    assert state["running_requests"] == 0 and state["kv_used_tokens"] == 0, state


def test_shutdown_ends_the_streams_of_every_api_server_and_every_process(server):
    srv = ServerProcess(*_options(server), "--api-server-count", "2")
    workers = srv.workers()
    try:
        streams = _Streams(srv.url)
        srv.signal(signal.SIGTERM)
        ends = streams.read_all()
        assert srv.wait(SHUTDOWN_S) == 0, srv.output
    finally:
        srv.stop()
    assert not [p for p in workers if alive(p)], "processes outlived the server"
    for lines in ends:
        assert lines[-1] == "data: [DONE]", lines[-3:]
        assert '"server is shutting down"' in lines[-2], lines[-3:]


def test_a_dead_api_server_ends_the_server_with_an_error(server):
    srv = ServerProcess(*_options(server), "--api-server-count", "2")
    workers = srv.workers()
    try:
        pids = _state(srv.url)["worker_pids"]
        os.kill(pids["api-1"], signal.SIGKILL)
        start = time.monotonic()
        assert srv.wait(SHUTDOWN_S) == 1, srv.output
        assert time.monotonic() - start < SHUTDOWN_S
    finally:
        srv.stop()
    assert "the api-1 worker exited with code -9" in srv.output
    assert wait_until(lambda: not any(alive(p) for p in workers), 10), "processes outlived the server"
