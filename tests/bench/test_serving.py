"""The online benchmark client: its pure parts, and end to end against a fake streaming server.

The fake server (FastAPI under uvicorn in a thread, on a free localhost port) streams one chunk per
requested token with known sleeps, so the measured TTFT and ITL have known lower bounds, and it can fail
chosen requests with HTTP 500 or by dropping the connection mid-stream.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from gapless.bench import serving
from gapless.bench.serving import arrival_times
from gapless.bench.stream_client import (
    RequestRecord,
    SSEDecoder,
    StreamError,
    is_content_chunk,
    parse_chunk,
    request_metrics,
    stats,
    summarize,
    usage_tokens,
)
from gapless.bench.workload import (
    SHAREGPT_INPUT_SIGMA,
    SHAREGPT_OUTPUT_SIGMA,
    lognormal_lengths,
    random_bounds,
    random_workload,
    sharegpt_workload,
)

# ---------------------------------------------------------------------------------------------- workloads


def test_random_bounds():
    assert random_bounds(100, 0.0) == (100, 100)
    assert random_bounds(100, 0.5) == (50, 150)
    assert random_bounds(1, 0.9) == (1, 2)  # never below 1
    for bad in ((0, 0.5), (10, 1.0), (10, -0.1)):
        with pytest.raises(ValueError):
            random_bounds(*bad)


def test_random_cli_workload_is_random_workload_with_those_bounds():
    args = serving.parse_args(["--input-len", "20", "--output-len", "10", "--range-ratio", "0.5"])
    work = serving.build_workload(args)
    assert work == random_workload(200, 10, 30, 5, 15, vocab_size=1000, seed=0)
    # an explicit bound overrides that end of the range only (defaults: 512 and 128, give or take half)
    args = serving.parse_args(["--num-prompts", "30", "--min-input", "3", "--max-output", "100"])
    assert serving.build_workload(args) == random_workload(30, 3, 768, 64, 100, vocab_size=1000, seed=0)


def test_random_cli_explicit_bounds():
    argv = ["--num-prompts", "50", "--min-input", "3", "--max-input", "6", "--min-output", "2"]
    argv += ["--max-output", "4", "--vocab-size", "7", "--seed", "2"]
    work = serving.build_workload(serving.parse_args(argv))
    assert work == random_workload(50, 3, 6, 2, 4, vocab_size=7, seed=2)
    assert work != random_workload(50, 3, 6, 2, 4, vocab_size=7, seed=0)


def test_sharegpt_workload():
    a = sharegpt_workload(1000, seed=0)
    assert a == sharegpt_workload(1000, seed=0)
    assert a != sharegpt_workload(1000, seed=1)
    ins = np.array([len(p) for p in a.prompts])
    outs = np.array(a.output_lens)
    assert ins.min() >= 4 and ins.max() <= 1024 and outs.min() >= 4 and outs.max() <= 1024
    assert all(0 <= t < 1000 for p in a.prompts for t in p)
    # its lengths are the lognormal ones below: prompt lengths first, then output lengths, same generator
    rng = random.Random(0)
    assert ins.tolist() == lognormal_lengths(rng, 1000, 161, SHAREGPT_INPUT_SIGMA, 4, 1024)
    assert outs.tolist() == lognormal_lengths(rng, 1000, 338, SHAREGPT_OUTPUT_SIGMA, 4, 1024)


@pytest.mark.parametrize("mean,sigma", [(161, SHAREGPT_INPUT_SIGMA), (338, SHAREGPT_OUTPUT_SIGMA)])
def test_sharegpt_length_shape(mean, sigma):
    x = np.array(lognormal_lengths(random.Random(0), 50_000, mean, sigma, 4, 1024))
    assert x.min() >= 4 and x.max() <= 1024
    # long-tailed: median well below the mean, a tail several times the median
    assert np.median(x) < 0.85 * x.mean()
    assert np.percentile(x, 90) > 2.5 * np.median(x)
    # the middle of the distribution (unclipped) is lognormal: log-space IQR = 1.349 sigma
    q25, q75 = np.percentile(np.log(x), [25, 75])
    assert (q75 - q25) / 1.349 == pytest.approx(sigma, rel=0.05)
    assert np.median(x) == pytest.approx(mean * math.exp(-sigma * sigma / 2), rel=0.05)
    # clipping only trims the tail: the mean stays within 10% of the requested one
    assert x.mean() == pytest.approx(mean, rel=0.1)


def test_lognormal_mean_without_clipping():
    x = lognormal_lengths(random.Random(1), 50_000, 80, 1.2, 1, 10**7)
    # the sample mean of a sigma-1.2 lognormal has standard error ~1.8 * mean / sqrt(n) ~ 0.8%
    assert np.mean(x) == pytest.approx(80, rel=0.04)
    with pytest.raises(ValueError):
        lognormal_lengths(random.Random(0), 3, 10, 1.0, 5, 4)


def test_sharegpt_cli_flags():
    argv = ["--workload", "sharegpt", "--num-prompts", "500", "--input-len", "40", "--max-input", "64"]
    argv += ["--output-len", "20", "--min-output", "10", "--max-output", "30"]
    work = serving.build_workload(serving.parse_args(argv))
    assert len(work) == 500
    assert all(4 <= len(p) <= 64 for p in work.prompts)
    assert all(10 <= n <= 30 for n in work.output_lens)


# ---------------------------------------------------------------------------------------------- arrivals


@pytest.mark.parametrize("rate,seed", [(5.0, 0), (0.5, 1), (200.0, 7)])
def test_poisson_arrivals(rate, seed):
    n = 20_001
    t = np.array(arrival_times(n, rate, seed))
    assert t[0] == 0.0 and len(t) == n and np.all(np.diff(t) >= 0)
    gaps = np.diff(t)
    # the mean gap is 1/rate: the sample mean of n exponentials has standard error (1/rate)/sqrt(n)
    assert abs(gaps.mean() - 1 / rate) < 4 * (1 / rate) / math.sqrt(len(gaps))
    # exponential, not just the right mean: std = mean, and P(gap > mean) = 1/e
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.05)
    assert np.mean(gaps > 1 / rate) == pytest.approx(math.exp(-1), abs=0.02)
    assert arrival_times(n, rate, seed) == t.tolist()  # seeded
    assert arrival_times(100, rate, seed + 1) != t[:100].tolist()


def test_arrivals_inf_and_bad_rate():
    assert arrival_times(5, math.inf) == [0.0] * 5
    assert arrival_times(0, 3.0) == []
    assert arrival_times(1, 3.0) == [0.0]
    with pytest.raises(ValueError):
        arrival_times(3, 0.0)


# ---------------------------------------------------------------------------------------------- SSE


def test_sse_decoder():
    d = SSEDecoder()
    events = []
    lines = [
        ": keep-alive comment",
        'data: {"a": 1}',
        "",
        "event: message",
        'data:{"b": 2}\r',  # no space after the colon; a stray CR
        "id: 7",
        "",
        "",  # blank line with no pending data: no event
        "data: line one",
        "data: line two",
        "",
        "data: [DONE]",
    ]
    for line in lines:
        if (e := d.feed(line)) is not None:
            events.append(e)
    assert events == ['{"a": 1}', '{"b": 2}', "line one\nline two"]
    assert d.flush() == "[DONE]"  # the stream ended inside an event
    assert d.flush() is None


def test_parse_chunk():
    assert parse_chunk("[DONE]") is None
    assert parse_chunk('{"choices": []}') == {"choices": []}
    with pytest.raises(StreamError, match="overloaded"):
        parse_chunk('{"error": {"message": "overloaded", "code": 503}}')
    with pytest.raises(StreamError, match="bad request"):
        parse_chunk('{"object": "error", "message": "bad request"}')
    with pytest.raises(StreamError, match="bad JSON"):
        parse_chunk("{not json")
    with pytest.raises(StreamError):
        parse_chunk("[1, 2]")


def test_content_chunks_and_usage():
    text = {"choices": [{"index": 0, "text": "hi", "finish_reason": None}]}
    last = {"choices": [{"index": 0, "text": "!", "finish_reason": "length"}]}
    empty_text = {"choices": [{"index": 0, "text": "", "finish_reason": None}]}  # a token with no text yet
    finish_only = {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}
    usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}}
    assert is_content_chunk(text) and is_content_chunk(last) and is_content_chunk(empty_text)
    assert not is_content_chunk(finish_only) and not is_content_chunk(usage)
    assert not is_content_chunk({"usage": None})
    assert usage_tokens(usage) == 5
    assert usage_tokens(text) is None and usage_tokens({"usage": None}) is None


# ---------------------------------------------------------------------------------------------- metrics


def test_request_metrics():
    m = request_metrics(send=10.0, chunk_times=[10.5, 10.6, 10.8, 11.1], end=11.2, output_tokens=4)
    assert m["ttft_s"] == pytest.approx(0.5)
    assert m["e2e_s"] == pytest.approx(1.2)
    assert m["itl_s"] == pytest.approx([0.1, 0.2, 0.3])
    assert m["tpot_s"] == pytest.approx(0.7 / 3)
    # usage says more tokens than chunks (the server batched its stream): TPOT is per token
    assert request_metrics(0.0, [0.5, 1.0], 1.0, 6)["tpot_s"] == pytest.approx(0.1)
    one = request_metrics(0.0, [0.3], 0.4, 1)
    assert one["itl_s"] == [] and one["tpot_s"] is None
    with pytest.raises(ValueError):
        request_metrics(0.0, [], 1.0, 0)


def test_stats():
    s = stats([float(x) for x in range(1, 101)], scale=1e3)
    assert s["mean"] == pytest.approx(50.5e3)
    # numpy's linear interpolation between order statistics
    assert s["p50"] == pytest.approx(50.5e3) and s["p90"] == pytest.approx(90.1e3)
    assert s["p99"] == pytest.approx(99.01e3)
    assert stats([]) == {"mean": None, "std": None, "p50": None, "p90": None, "p99": None}


def test_summarize_and_report():
    def ok(i, prompt_len, n, ttft, itl):
        e2e = ttft + itl * (n - 1)
        return RequestRecord(i, prompt_len, n, 0.0, 0.0, e2e, True, None, n, ttft, itl, e2e, [itl] * (n - 1))

    records = [
        ok(0, 10, 5, 0.1, 0.02),
        ok(1, 20, 3, 0.3, 0.04),
        RequestRecord(2, 7, 4, 0.0, error="HTTP 500: boom"),
        RequestRecord(3, 7, 4, 0.0, error="HTTP 500: boom"),
        RequestRecord(4, 7, 4, 0.0, error="RemoteProtocolError: dropped"),
    ]
    s = summarize(records, duration_s=2.0)
    assert (s["completed"], s["failed"]) == (2, 3)
    assert (s["input_tokens"], s["output_tokens"]) == (30, 8)
    assert s["requested_output_tokens"] == 8 and s["wrong_length_requests"] == 0
    assert s["request_throughput"] == 1.0
    assert s["input_throughput"] == 15.0 and s["output_throughput"] == 4.0
    assert s["total_token_throughput"] == 19.0
    assert s["ttft_ms"]["mean"] == pytest.approx(200.0)
    assert s["tpot_ms"]["mean"] == pytest.approx(30.0)
    assert s["itl_ms"]["mean"] == pytest.approx((4 * 20 + 2 * 40) / 6)  # all gaps pooled
    assert s["e2e_ms"]["p50"] == pytest.approx((180 + 380) / 2)
    assert s["errors"] == {"HTTP 500: boom": 2, "RemoteProtocolError: dropped": 1}
    json.dumps(s)  # plain JSON
    report = serving.format_report(s)
    assert "Successful requests:" in report and "P99 ITL (ms):" in report
    assert "FAILED x2: HTTP 500: boom" in report
    assert "WARNING" not in report

    s_wrong = summarize(
        [RequestRecord(0, 3, 9, 0.0, success=True, output_tokens=5, ttft_s=0.1, e2e_s=1.0)], 1.0
    )
    assert s_wrong["wrong_length_requests"] == 1 and "ignore_eos" in serving.format_report(s_wrong)
    # nothing succeeded: stats are n/a, not a crash
    none = summarize(records[2:], 1.0)
    assert none["completed"] == 0 and none["ttft_ms"]["mean"] is None
    assert "n/a" in serving.format_report(none)


# ---------------------------------------------------------------------------------------------- fake server

TTFT_SLEEP = 0.05  # before the first chunk
ITL_SLEEP = 0.02  # between chunks
MODEL = "fake-model"


@dataclass
class FakeState:
    fail_every: int = 0  # request n (1-based, in arrival order) gets HTTP 500 when n % fail_every == 0
    drop_every: int = 0  # ... has its connection dropped after two chunks when n % drop_every == 1
    textless: bool = False  # its tokens decode to no text: no chunk but the finish chunk and usage
    count: int = 0
    in_flight: int = 0
    peak: int = 0
    bodies: list[dict] = field(default_factory=list)
    auth: list[str | None] = field(default_factory=list)


def make_app(state: FakeState) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": MODEL, "object": "model"}, {"id": "other"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        state.bodies.append(body)
        state.auth.append(request.headers.get("authorization"))
        state.count += 1
        n = state.count
        if state.fail_every and n % state.fail_every == 0:
            return JSONResponse({"error": {"message": "injected failure"}}, status_code=500)
        drop = state.drop_every and n % state.drop_every == 1
        max_tokens = body["max_tokens"]
        # odd requests get no usage chunk: the client then counts content chunks
        send_usage = n % 2 == 0 or state.textless

        def event(obj) -> str:
            return f"data: {json.dumps(obj)}\n\n"

        def choice(text, finish):
            return {"object": "text_completion", "model": MODEL, "choices": [
                {"index": 0, "text": text, "finish_reason": finish}
            ]}  # fmt: skip

        async def stream():
            state.in_flight += 1
            state.peak = max(state.peak, state.in_flight)
            try:
                await asyncio.sleep(TTFT_SLEEP)
                for k in range(max_tokens):
                    if k:
                        await asyncio.sleep(ITL_SLEEP)
                    if not state.textless:
                        yield event(choice(f" t{k}", None))
                    if drop and k == 1:
                        raise RuntimeError("injected connection drop")
                yield event(choice("", "length"))  # a finish-only chunk: not a token
                if send_usage:
                    usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": max_tokens}
                    yield event({"object": "text_completion", "choices": [], "usage": usage})
                yield "data: [DONE]\n\n"
            finally:
                state.in_flight -= 1

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def fake_server():
    state = FakeState()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(make_app(state), log_level="critical", access_log=False, lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs=dict(sockets=[sock]), daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "fake server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}", state
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


@pytest.fixture
def fake(fake_server):
    url, state = fake_server
    state.__init__()  # fresh counters and failure settings for each test
    return url, state


def _run(url, tmp_path, *argv):
    out = tmp_path / "serving.json"
    res = serving.main(["--base-url", url, "--output-json", str(out), *argv])
    on_disk = json.loads(out.read_text())
    assert on_disk["summary"] == json.loads(json.dumps(res["summary"]))
    return on_disk


def test_end_to_end_all_succeed(fake, tmp_path):
    url, state = fake
    argv = ["--num-prompts", "12", "--input-len", "8", "--output-len", "5", "--range-ratio", "0.4"]
    argv += ["--max-concurrency", "4", "--api-key", "secret", "--seed", "3"]
    res = _run(url + "/v1/", tmp_path, *argv)  # a trailing /v1/ in the base URL is tolerated
    work = random_workload(12, 5, 11, 3, 7, vocab_size=1000, seed=3)
    s = res["summary"]
    assert (s["completed"], s["failed"], s["errors"]) == (12, 0, {})
    assert s["input_tokens"] == work.input_tokens and s["output_tokens"] == work.output_tokens
    assert s["wrong_length_requests"] == 0
    assert s["output_throughput"] == pytest.approx(work.output_tokens / s["duration_s"])

    # what the server got: token-id prompts, streaming with usage, ignore_eos, greedy, the listed model
    assert len(state.bodies) == 12 and state.peak <= 4
    assert sorted(b["prompt"] for b in state.bodies) == sorted(work.prompts)
    assert sorted(b["max_tokens"] for b in state.bodies) == sorted(work.output_lens)
    for b in state.bodies:
        assert b["model"] == MODEL and b["stream"] is True and b["stream_options"] == {"include_usage": True}
        assert b["ignore_eos"] is True and b["temperature"] == 0.0
    assert state.auth == ["Bearer secret"] * 12
    assert res["config"]["model"] == MODEL and res["config"]["request_rate"] == "inf"

    # latencies: at least the server's sleeps, and not far above them
    assert TTFT_SLEEP <= s["ttft_ms"]["mean"] / 1e3 < TTFT_SLEEP + 0.5
    assert 0.8 * ITL_SLEEP <= s["itl_ms"]["mean"] / 1e3 < ITL_SLEEP + 0.1
    assert 0.8 * ITL_SLEEP <= s["tpot_ms"]["mean"] / 1e3 < ITL_SLEEP + 0.1
    assert s["ttft_ms"]["p50"] <= s["ttft_ms"]["p90"] <= s["ttft_ms"]["p99"]

    reqs = res["requests"]
    assert [r["index"] for r in reqs] == list(range(12))
    for r in reqs:
        assert r["success"] and r["error"] is None
        assert r["prompt_len"] == len(work.prompts[r["index"]])
        assert r["output_tokens"] == r["max_tokens"] == work.output_lens[r["index"]]
        assert len(r["itl_s"]) == r["output_tokens"] - 1  # the finish-only chunk is no token
        assert r["e2e_s"] >= TTFT_SLEEP + (r["output_tokens"] - 1) * ITL_SLEEP * 0.9
        assert r["scheduled_s"] == 0.0 and r["send_s"] <= r["end_s"]
    # at most 4 in flight: the last requests waited for a slot
    assert max(r["send_s"] for r in reqs) > TTFT_SLEEP


def test_end_to_end_failures_are_counted(fake, tmp_path):
    url, state = fake
    state.fail_every, state.drop_every = 4, 4  # of 12: 3 get HTTP 500, 3 drop mid-stream, 6 succeed
    argv = ["--num-prompts", "12", "--input-len", "6", "--output-len", "4", "--range-ratio", "0"]
    argv += ["--request-rate", "40", "--model", "explicit-name", "--disable-tqdm"]
    res = _run(url, tmp_path, *argv)
    s = res["summary"]
    assert (s["completed"], s["failed"]) == (6, 6)
    assert s["output_tokens"] == 6 * 4 and s["input_tokens"] == 6 * 6
    http = {e: c for e, c in s["errors"].items() if e.startswith("HTTP 500")}
    assert sum(http.values()) == 3 and "injected failure" in next(iter(http))
    assert sum(s["errors"].values()) == 6  # the other 3: the dropped connections, whatever httpx calls it
    assert {b["model"] for b in state.bodies} == {"explicit-name"}
    failed = [r for r in res["requests"] if not r["success"]]
    assert len(failed) == 6 and all(r["error"] and r["ttft_s"] is None for r in failed)
    # Poisson arrivals at 40/s were honoured: none sent early, and sends did not wait for the responses
    # before them (each success takes >= TTFT_SLEEP + 3 ITL_SLEEP, 4x the mean gap), so some request went
    # out while the one before it was in flight. (Not a bound on the lateness: it failed at 0.3 s once,
    # on a machine running three suites on two cores.)
    reqs = res["requests"]
    assert all(r["send_s"] >= r["scheduled_s"] for r in reqs)
    assert any(b["send_s"] < a["end_s"] for a, b in zip(reqs, reqs[1:]))
    assert reqs[-1]["scheduled_s"] > 0
    assert s["duration_s"] >= reqs[-1]["scheduled_s"]
    assert res["config"]["request_rate"] == 40.0


def test_tokens_that_decode_to_no_text_are_counted_not_failed(fake, tmp_path):
    """A stream of tokens whose text is empty (a tokenizer covering less than the model's vocabulary)
    succeeds with the server's token count; its first output, the finish chunk, is its TTFT. Before,
    each such request failed: "no output tokens in stream"."""
    url, state = fake
    state.textless = True
    argv = ["--num-prompts", "4", "--input-len", "6", "--output-len", "3", "--range-ratio", "0"]
    s = _run(url, tmp_path, *argv, "--disable-tqdm")["summary"]
    assert (s["completed"], s["failed"], s["errors"]) == (4, 0, {})
    assert s["output_tokens"] == s["requested_output_tokens"] == 4 * 3
    assert s["ttft_ms"]["mean"] / 1e3 >= TTFT_SLEEP + 2 * ITL_SLEEP * 0.8  # the finish chunk, at the end


def test_module_runs_as_a_script(fake, tmp_path):
    url, _ = fake
    out = tmp_path / "s.json"
    argv = ["--base-url", url, "--num-prompts", "3", "--input-len", "4", "--output-len", "3"]
    cmd = [sys.executable, "-m", "gapless.bench.serving", *argv, "--output-json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "Serving Benchmark Result" in proc.stdout
    data = json.loads(out.read_text())
    assert set(data) == {"config", "summary", "requests", "report"}
    assert data["summary"]["completed"] == 3


def test_summary_json_is_the_output_json_without_the_requests(fake, tmp_path):
    url, _ = fake
    argv = ["--num-prompts", "4", "--input-len", "4", "--output-len", "3", "--disable-tqdm"]
    res = serving.main(["--base-url", url, "--summary-json", str(tmp_path / "summary.json"), *argv])
    small = json.loads((tmp_path / "summary.json").read_text())
    assert set(small) == {"config", "summary", "report"}
    assert small == json.loads(json.dumps({k: res[k] for k in small}))
    assert small["summary"]["completed"] == 4


def test_unreachable_server_fails_requests_not_the_run(tmp_path):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    res = serving.main(
        ["--base-url", f"http://127.0.0.1:{port}", "--model", "m", "--num-prompts", "3", "--disable-tqdm"]
    )
    assert res["summary"]["completed"] == 0 and res["summary"]["failed"] == 3
    assert "ConnectError" in next(iter(res["summary"]["errors"]))


def test_no_model_and_no_server_is_a_clear_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(SystemExit, match="pass --model"):
        serving.main(["--base-url", f"http://127.0.0.1:{port}", "--num-prompts", "1", "--disable-tqdm"])
