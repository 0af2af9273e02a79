"""The server's limits, on a server of its own (a 65k-token context, --max-tokens-default, a request
timeout, a Qwen3-style chat template that reads `enable_thinking`): a 10 MB prompt refused at once, a long
tokenization that holds up nobody, /debug/state and /metrics answering during a long prefill, a request
stopped at its deadline with its KV freed, and chat_template_kwargs reaching the template."""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from transformers import AutoTokenizer

from gapless.server.engine_client import EngineClient
from gapless.testing.server import ServerProcess
from tests.server.conftest import wait_idle_and_clean

CONTEXT = 65536
MAX_TOKENS_DEFAULT = 5
TIMEOUT_S = 8.0
# Qwen3's way: with enable_thinking false, the assistant turn opens with an empty thinking block
THINKING_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)


@pytest.fixture(scope="module")
def model_path(ckpt_factory, tmp_path_factory):
    path = tmp_path_factory.mktemp("limits") / "thinking-qwen3"
    shutil.copytree(ckpt_factory("qwen3", max_position_embeddings=CONTEXT), path)
    (path / "chat_template.jinja").write_text(THINKING_TEMPLATE)
    return path


@pytest.fixture(scope="module")
def server(model_path):
    srv = ServerProcess(
        "--model",
        str(model_path),
        "--device",
        "cpu",
        "--kv-cache-tokens",
        str(CONTEXT),
        "--chunked-prefill-size",
        "16384",
        "--max-request-bytes",
        str(16 << 20),
        "--max-tokens-default",
        str(MAX_TOKENS_DEFAULT),
        "--request-timeout",
        str(TIMEOUT_S),
    )
    yield srv
    assert srv.stop() == 0, srv.output


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def timed(call: Callable[[], httpx.Response]) -> tuple[httpx.Response, float, float]:
    """The response, and when it came back and how long it took (monotonic seconds)."""
    start = time.monotonic()
    r = call()
    end = time.monotonic()
    return r, end, end - start


def small(client: httpx.Client) -> httpx.Response:
    return client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "ignore_eos": True})


def test_a_10mb_prompt_is_refused_at_once_and_others_are_served_meanwhile(client):
    big = {"prompt": "x" * (10 << 20), "max_tokens": 1}
    with ThreadPoolExecutor(1) as pool:
        refused = pool.submit(timed, lambda: client.post("/v1/completions", json=big))
        time.sleep(0.2)
        r, _, small_s = timed(lambda: small(client))
        big_r, _, big_s = refused.result()
    assert big_r.status_code == 400, big_r.text
    err = big_r.json()["error"]
    assert err["param"] == "prompt" and "not tokenized" in err["message"]
    assert big_s < 5, f"refusing 10 MB took {big_s:.1f} s"
    assert r.status_code == 200 and small_s < 5, f"a small request took {small_s:.1f} s meanwhile"
    assert wait_idle_and_clean(client)["api_open_requests"] == 0


def test_a_long_tokenization_does_not_hold_up_other_requests(client):
    # short enough to be tokenized (the bound is the context times the longest token times 4), far
    # longer than the context once it is: a second or more of the tokenizer's time, then a 400
    big = {"prompt": "x" * 2_000_000, "max_tokens": 1}
    with ThreadPoolExecutor(1) as pool:
        refused = pool.submit(timed, lambda: client.post("/v1/completions", json=big))
        time.sleep(0.3)  # the big one is in the tokenizer by now
        r, small_end, _ = timed(lambda: small(client))
        big_r, big_end, big_s = refused.result()
    assert big_r.status_code == 400, big_r.text
    assert "tokens but this server takes at most 65535" in big_r.json()["error"]["message"]
    assert r.status_code == 200, r.text
    assert small_end < big_end, f"the small request waited for the big one's {big_s:.1f} s tokenization"


@pytest.mark.slow  # (~9 s)
def test_debug_state_and_metrics_answer_within_a_second_during_a_long_prefill(client):
    prompt = [7] * 16000  # one prefill step of seconds on a CPU (a chunk holds 16384 tokens)
    answers: list[tuple[str, float, bool]] = []  # (path, seconds, stale)
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            for path in ("/debug/state", "/metrics"):
                r, _, seconds = timed(lambda p=path: client.get(p))
                assert r.status_code == 200
                stale = "stats_age_s" in r.text if path == "/debug/state" else False
                answers.append((path, seconds, stale))
            time.sleep(0.1)

    watcher = threading.Thread(target=poll, daemon=True)
    start = time.monotonic()
    watcher.start()
    r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
    elapsed = time.monotonic() - start
    done.set()
    watcher.join(10)
    assert r.status_code in (200, 504), r.text  # on a slow machine the prefill may outlast the deadline
    assert elapsed > 1.5, f"the prefill took {elapsed:.2f} s: too short to show anything"
    slow = [a for a in answers if a[1] >= 1.0]
    assert not slow, f"answers that took a second or more: {slow}"
    assert any(stale for _, _, stale in answers), "no answer came while the scheduler was busy"
    assert wait_idle_and_clean(client)["integrity"] == "ok"


def test_a_stale_answer_before_the_schedulers_first_says_so():
    # the slow test above may ask first while the prefill runs: the answer is still marked stale
    engine = EngineClient.__new__(EngineClient)
    engine.last_stats, engine.last_stats_at = [{}, {"running": 3}], [None, time.monotonic() - 2]
    never, old = engine._stale_stats(0), engine._stale_stats(1)
    assert never["stats_age_s"] is None and "not checked" in never["integrity"] and never["replica"] == 0
    assert old["running"] == 3 and old["stats_age_s"] >= 2


def test_max_tokens_default_applies_where_a_request_sets_no_limit(client):
    chat = {"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True}
    r = client.post("/v1/chat/completions", json=chat)
    assert r.json()["usage"]["completion_tokens"] == MAX_TOKENS_DEFAULT, r.text
    null = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": None, "ignore_eos": True})
    assert null.json()["usage"]["completion_tokens"] == MAX_TOKENS_DEFAULT, null.text
    # OpenAI's own default for completions (16) and an explicit max_tokens stay
    unset = client.post("/v1/completions", json={"prompt": "hi", "ignore_eos": True})
    assert unset.json()["usage"]["completion_tokens"] == 16
    explicit = client.post("/v1/chat/completions", json={**chat, "max_tokens": 9})
    assert explicit.json()["usage"]["completion_tokens"] == 9


def test_chat_template_kwargs_reach_the_template(client, model_path):
    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    messages = [{"role": "user", "content": "hello"}]

    def prompt_tokens(**kwargs) -> int:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
        return len(tokenizer.encode(text, add_special_tokens=False))

    assert prompt_tokens(enable_thinking=False) > prompt_tokens()
    for kwargs in ({}, {"enable_thinking": True}, {"enable_thinking": False}):
        body = {"messages": messages, "max_tokens": 1, "chat_template_kwargs": kwargs}
        r = client.post("/v1/chat/completions", json=body)
        assert r.json()["usage"]["prompt_tokens"] == prompt_tokens(**kwargs), (kwargs, r.text)
    r = client.post(
        "/v1/chat/completions",
        json={"messages": messages, "chat_template_kwargs": {"add_generation_prompt": 0}},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"


def test_a_request_past_its_deadline_is_stopped_and_its_kv_freed(client):
    body = {"prompt": "go", "max_tokens": 60_000, "ignore_eos": True}

    def stream() -> list[str]:
        with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            return [line for line in r.iter_lines() if line.startswith("data: ")]

    with ThreadPoolExecutor(1) as pool:
        streamed = pool.submit(timed, stream)
        r, _, seconds = timed(lambda: client.post("/v1/completions", json=body))
        events, _, stream_s = streamed.result()
    assert r.status_code == 504, r.text
    assert "--request-timeout" in r.json()["error"]["message"]
    assert TIMEOUT_S <= seconds < TIMEOUT_S + 10 and TIMEOUT_S <= stream_s < TIMEOUT_S + 10
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2][6:])["error"]
    assert error["code"] == 504 and "--request-timeout" in error["message"]
    assert len(events) > 10, "the stream sent tokens before its deadline"
    state = wait_idle_and_clean(client)
    assert state["kv_used_tokens"] == 0 and state["running_requests"] == 0
    assert small(client).status_code == 200


def test_without_an_api_key_the_schema_asks_for_none(client):
    doc = client.get("/openapi.json").json()
    assert "security" not in doc and "securitySchemes" not in doc["components"]
