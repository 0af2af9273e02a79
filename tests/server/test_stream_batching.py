"""The server's messages scale with steps, not tokens: each hop (scheduler -> detokenizer -> API server)
sends one message per step carrying every request's new tokens, and a stream whose deltas piled up (its
client, or the event loop, behind) gets them merged into one chunk per choice, in one write."""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from gapless.server import protocol as P
from gapless.server.engine_client import Group
from gapless.server.openai_protocol import CompletionRequest
from gapless.server.routes.generation import Generation
from gapless.server.routes.openai import TEXT_COMPLETION, _Completion
from tests.server.conftest import debug_state, wait_idle_and_clean


def _delta(rid: str, text: str, ids: list[int], done: int, finish: str | None = None) -> P.ReqDelta:
    return P.ReqDelta(
        rid, text, ids, prompt_tokens=3, completion_tokens=done, cached_tokens=1, finish_reason=finish
    )


class _Connected:
    """A request whose client never leaves (what `Generation` watches for a disconnect)."""

    async def receive(self) -> dict:
        await asyncio.Event().wait()
        return {}


async def _writes(group: Group, *queued: tuple[int, P.ReqDelta | P.ReqError]) -> list[bytes]:
    """The writes a completion stream makes for deltas that all arrived before it could send any."""
    for item in queued:
        group.queue.put_nowait(item)
        if isinstance(item[1], P.ReqError) or item[1].finish_reason is not None:
            group.open.discard(group.rids[item[0]])
    gen = Generation(_Connected(), group, "cmpl", "m")  # type: ignore[arg-type]
    req = CompletionRequest(prompt="x", n=len(group.rids), stream=True)
    response = await gen.stream(_Completion(gen, req).chunks, gen.usage_chunk(TEXT_COMPLETION, True, 1))
    return [w async for w in response.body_iterator]  # type: ignore[misc]


def _events(write: bytes) -> list[dict | str]:
    out = []
    for line in write.decode().split("\n\n"):
        if line:
            data = line.removeprefix("data: ")
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_a_stream_behind_gets_its_deltas_merged_into_one_chunk_per_choice_in_one_write():
    pieces = ["Hé", "ll", "o", " w", "€", "rld"]
    queued = [(i % 2, _delta(f"r-{i % 2}", p, [i], i // 2 + 1)) for i, p in enumerate(pieces)]
    queued[-2:] = [(k, _delta(f"r-{k}", pieces[4 + k], [4 + k], 3, "length")) for k in (0, 1)]
    writes = asyncio.run(_writes(Group(["r-0", "r-1"]), *queued))
    # before: one write and one chunk per delta (6); now one write of a chunk per choice, then usage
    assert len(writes) == 3 and writes[-1] == b"data: [DONE]\n\n", writes
    chunks = _events(writes[0])
    assert [c["choices"][0]["text"] for c in chunks] == ["Héo€", "ll wrld"]  # type: ignore[index]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == ["length", "length"]  # type: ignore[index]
    (usage,) = _events(writes[1])
    assert usage["usage"]["completion_tokens"] == 6 and usage["usage"]["prompt_tokens"] == 6  # type: ignore[index]


def test_a_refusal_behind_merged_deltas_still_ends_the_stream_with_its_error():
    group = Group(["r-0"])
    queued = [(0, _delta("r-0", "ab", [1], 1)), (0, _delta("r-0", "c", [2], 2))]
    error = (0, P.ReqError("r-0", "the request ran past its time limit", status=504))
    writes = asyncio.run(_writes(group, *queued, error))
    events = [e for w in writes for e in _events(w)]
    assert events[0]["choices"][0]["text"] == "abc"  # type: ignore[index]
    assert events[1]["error"]["code"] == 504 and events[2] == "[DONE]", events  # type: ignore[index]


def test_merging_keeps_counts_and_fields_only_one_delta_has():
    first = _delta("r", "a", [1], 1)
    first.logprobs = [P.TokenLogprob("a", -0.5, [])]
    merged = P.merge_deltas(first, _delta("r", "b", [2], 2, "stop"))
    assert (merged.rid, merged.text, merged.token_ids, merged.completion_tokens) == ("r", "ab", [1, 2], 2)
    assert merged.finish_reason == "stop" and merged.logprobs == first.logprobs


def _hops(client: httpx.Client) -> dict[str, int]:
    return {k: v for k, v in debug_state(client).items() if k.startswith("hop_")}


def test_each_hop_sends_one_message_per_step_for_all_streams(server, client):
    """Eight streams at once (one request with n=8, and four more requests): every hop sends one
    message per step that produced tokens, however many requests it carries."""
    wait_idle_and_clean(client)
    before = _hops(client)
    streams = [{"prompt": [5, 6, 7], "n": 8, "max_tokens": 12}] + [
        {"prompt": [9, i], "max_tokens": 12} for i in range(4)
    ]
    body = {"ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}

    def run(request: dict) -> int:
        with client.stream("POST", "/v1/completions", json={**request, **body}) as r:
            assert r.status_code == 200
            lines = [line for line in r.iter_lines() if line.startswith("data: {")]
        return json.loads(lines[-1][6:])["usage"]["completion_tokens"]

    with ThreadPoolExecutor(len(streams)) as pool:
        assert list(pool.map(run, streams)) == [8 * 12] + [12] * 4
    wait_idle_and_clean(client)
    d = {k: v - before[k] for k, v in _hops(client).items()}
    updates = d["hop_scheduler_updates_out"]
    # one message per step with output at every hop; each request's update of a step rides in it
    assert d["hop_detokenizer_updates_in"] == d["hop_detokenizer_deltas_out"] == updates, d
    assert (
        d["hop_api_deltas_in"] == updates and d["hop_api_delta_records"] == d["hop_scheduler_request_updates"]
    )
    assert updates <= d["hop_scheduler_steps"], d
    assert d["hop_scheduler_request_updates"] == 12 * 12, d  # 12 requests, 12 steps each
    # the n=8 request's choices run together: far fewer messages than request updates
    assert updates <= 12 * 5, d


@pytest.mark.slow  # (a server of its own, ~10 s)
def test_stream_interval_sends_a_requests_tokens_in_groups_with_the_same_text(ckpt_factory, server, client):
    """`--stream-interval 4` (SGLang's and vLLM's flag): a request's first token goes out at once, then
    its tokens four at a time, its end at once; every hop carries a quarter of the updates, and the
    streamed and whole texts are those the default server (interval 1) gives."""
    from gapless.testing.server import ServerProcess

    request = {"prompt": [9, 4, 7], "max_tokens": 13, "temperature": 0, "ignore_eos": True}
    want = client.post("/v1/completions", json=request).json()["choices"][0]["text"]
    srv = ServerProcess(
        "--device", "cpu", "--model", str(ckpt_factory("qwen3")), "--max-model-len", "512",
        "--stream-interval", "4",
    )  # fmt: skip
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            before = _hops(c)
            assert c.post("/v1/completions", json=request).json()["choices"][0]["text"] == want
            with c.stream("POST", "/v1/completions", json={**request, "stream": True}) as r:
                texts = [
                    json.loads(line[6:])["choices"][0]["text"]
                    for line in r.iter_lines()
                    if line.startswith("data: {")
                ]
            assert "".join(texts) == want
            wait_idle_and_clean(c)
            d = {k: v - before[k] for k, v in _hops(c).items()}
        # per request: the first token, then at 5, 9 and 13 tokens (the end)
        assert d["hop_scheduler_request_updates"] == 2 * 4, d
        assert d["hop_api_delta_records"] == 2 * 4, d
    finally:
        assert srv.stop() == 0, srv.output


def test_reporter_updates_are_each_requests_update_whatever_the_path():
    """`UpdateReporter.updates` builds the common update (a running request's new tokens) inline: for
    every kind of request in a step (its first update, running, finished, with logprobs, prompt logprobs,
    its own skip_special_tokens and stop strings, steps without a token) and at stream intervals 1 and 3,
    it sends exactly what `update` sends for the requests `due` one, step after step."""
    from gapless.engine.request import Req, ReqStatus
    from gapless.sampling.logprobs import PromptLogprobState
    from gapless.sampling_params import SamplingParams
    from gapless.server.workers.scheduler_loop import UpdateReporter

    kinds = [
        SamplingParams(max_tokens=50),
        SamplingParams(max_tokens=50, logprobs=2),
        SamplingParams(max_tokens=50, skip_special_tokens=False, stop=["xy"]),
        SamplingParams(max_tokens=50, prompt_logprobs=1),
    ]
    seen = set()  # which kinds of update the steps made
    for interval in (1, 3):
        fast, slow = UpdateReporter(interval), UpdateReporter(interval)
        reqs = []
        for i in range(12):
            params = kinds[i % len(kinds)]
            req = Req(f"r{i}", [1, 2, 3], params, seed=0, arrival=i, cached_tokens=i % 2)
            if params.prompt_logprobs is not None:
                req.prompt_lp = PromptLogprobState(top_k=1, start=1, next=3, values=[(-0.5, 1, [(2, -0.5)])])
            reqs.append(req)
        for step in range(10):
            stepped = []
            for i, req in enumerate(reqs):
                if req.finished or (i + step) % 4 == 0:  # some requests make no token this step
                    continue
                req.output_ids.append(100 + step)
                if req.params.logprobs is not None:
                    req.output_logprobs.append(-1.0)
                    req.output_top_logprobs.append([(100 + step, -1.0)])
                if step == 3 + i % 5:
                    req.status, req.finish_reason = ReqStatus.FINISHED, "stop"
                stepped.append(req)
            want = [slow.update(r) for r in stepped if slow.due(r)]
            assert fast.updates(stepped) == want, (interval, step)
            assert fast.sent == slow.sent
            for u in want:
                seen |= {
                    "first" if u.stop is not None else "later",
                    *(["finished"] * (u.finish_reason is not None)),
                    *(["logprobs"] * (u.logprobs is not None)),
                    *(["prompt logprobs"] * (u.prompt_logprobs is not None)),
                    *(["keeps special tokens"] * (not u.skip_special_tokens)),
                    *(["several tokens"] * (len(u.token_ids) > 1)),
                }
    assert seen == {
        "first", "later", "finished", "logprobs", "prompt logprobs", "keeps special tokens", "several tokens"
    }  # fmt: skip


def test_the_scheduler_workers_own_host_work_is_metered_with_its_steps(ckpt_factory):
    """Taking messages in and sending each step's updates out is host time the device may wait on: the
    scheduler worker's loop adds it to the engine's meter (as "receive" and "report" spans), so a served
    engine's host ms per step counts it, and only while there is work."""
    from gapless import LLM, SamplingParams
    from gapless.server.workers.scheduler_loop import SchedulerLoop, SchedulerOptions

    class Socks:
        def __init__(self) -> None:
            self.inbox: list[P.Message] = []
            self.sent: list[tuple[str, P.Message]] = []

        def poll(self, timeout_ms: int) -> P.Message | None:
            return self.inbox.pop(0) if self.inbox else None

        def send(self, to: str, msg: P.Message) -> None:
            self.sent.append((to, msg))

    with LLM(str(ckpt_factory("qwen3")), device="cpu", kv_cache_tokens=256, overlap=False) as llm:
        engine = llm.engine
        meter = engine.meter
        meter.keep_trace = True
        socks = Socks()
        loop = SchedulerLoop(engine, socks, SchedulerOptions(0.0, False, 1))  # type: ignore[arg-type]
        loop.turn()  # idle, nothing queued: nothing metered
        assert meter.spans == [] and engine.stats.host_s == 0
        params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        socks.inbox += [P.SchedReq("a", [1, 2, 3], params), P.SchedReq("b", [4, 5], params)]
        while socks.inbox or engine.has_unfinished():
            loop.turn()
        names = [name for track, name, _, _ in meter.spans if track == "host"]
        assert names.count("receive") == names.count("report") == engine.stats.steps
        assert {"schedule", "process"} <= set(names)
        host = sum(end - start for track, _, start, end in meter.spans if track == "host")
        assert engine.stats.host_s == pytest.approx(host)
        assert [to for to, _ in socks.sent] == ["detokenizer"] * 3  # one Updates per step with tokens
