"""Bad input gets an OpenAI-style error with the right status, and the server keeps serving; a client
that goes away mid-stream has its request aborted and its KV freed."""

from __future__ import annotations

import dataclasses
import http.client
import json
import re

import httpx
import pytest

from gapless.sampling_params import SamplingParams
from tests.server.conftest import API_KEY, MAX_REQUEST_BYTES, debug_state, wait_idle_and_clean


@pytest.fixture(scope="module")
def model(client):
    return client.get("/v1/models").json()["data"][0]["id"]


def good(client: httpx.Client, model: str) -> None:
    r = client.post(
        "/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 2, "ignore_eos": True}
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"] and "type" in err
    return err


BAD_PARAMS = [
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": "many"}, "max_tokens"),
    ({"n": 0}, "n"),
    ({"stop": [""]}, "stop"),
    ({"logprobs": 21}, "logprobs"),  # above --max-logprobs (20)
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": [10**9]}, "prompt"),  # outside the vocabulary
    ({"prompt": "word " * 600}, "prompt"),  # longer than --max-model-len 512
    ({"logit_bias": {"5": 101.0}}, "logit_bias"),  # OpenAI's bound is [-100, 100]
    ({"suffix": "x"}, "suffix"),
]


@pytest.mark.parametrize(("fields", "param"), BAD_PARAMS)
def test_invalid_parameters_are_400_naming_the_field(client, model, fields, param):
    body = {"model": model, "prompt": "hello", "max_tokens": 2, **fields}
    err = error_of(client.post("/v1/completions", json=body), 400)
    assert err["param"] == param, err
    good(client, model)


def test_chat_invalid_messages(client, model):
    for body in (
        {"model": model, "messages": []},
        {"model": model, "messages": [{"role": "wizard", "content": "hi"}]},
        {"model": model, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        {"model": model, "messages": "hi"},
    ):
        error_of(client.post("/v1/chat/completions", json=body), 400)
    good(client, model)


def test_bad_key_is_401_on_every_endpoint_but_health(server, model):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {API_KEY}"}):
        with httpx.Client(base_url=server.url, headers=headers, timeout=30) as c:
            for method, path in (
                ("GET", "/v1/models"),
                ("GET", "/metrics"),
                ("POST", "/v1/completions"),
                ("POST", "/v1/chat/completions"),
                ("POST", "/generate"),
                ("GET", "/debug/state"),
            ):
                error_of(c.request(method, path, json={"model": model, "prompt": "x"}), 401)
            assert c.get("/health").status_code == 200


def test_models_card_names_the_kv_cache(client):
    card = client.get("/v1/models").json()["data"][0]
    assert re.fullmatch(r"(float32|bfloat16|float16|fp8_e4m3|fp8_e5m2), \d+ B/token", card["kv_cache"]), card


def test_unknown_model_is_404(client, model):
    err = error_of(client.post("/v1/completions", json={"model": "gpt-17", "prompt": "x"}), 404)
    assert "gpt-17" in err["message"]
    error_of(client.post("/v1/chat/completions", json={"model": "gpt-17", "messages": []}), 404)
    good(client, model)


def test_body_too_large_is_413(client, model):
    body = json.dumps({"model": model, "prompt": "x" * (MAX_REQUEST_BYTES + 10)})
    error_of(client.post("/v1/completions", content=body, headers={"content-type": "application/json"}), 413)

    def chunks():  # no Content-Length: the limit is enforced while reading
        for _ in range(MAX_REQUEST_BYTES // 1024 + 2):
            yield b" " * 1024
        yield json.dumps({"model": model, "prompt": "x"}).encode()

    error_of(client.post("/v1/completions", content=chunks()), 413)
    good(client, model)


@pytest.mark.parametrize("body", [b"{", b"not json", b'{"model": "m", "prompt": "x",}', b""])
def test_malformed_json_is_422(client, model, body):
    error_of(client.post("/v1/completions", content=body, headers={"content-type": "application/json"}), 422)
    good(client, model)


def test_unknown_route_is_an_openai_error(client):
    error_of(client.get("/v1/nothing"), 404)


def test_metrics_exposition(client, model):
    good(client, model)
    text = client.get("/metrics").text
    for name in (
        "gapless_num_requests_running",
        "gapless_num_requests_waiting",
        "gapless_kv_used_tokens",
        "gapless_prefix_cache_hit_rate",
        "gapless_prompt_tokens_total",
        "gapless_generation_tokens_total",
        "gapless_time_to_first_token_seconds_bucket",
        "gapless_inter_token_latency_seconds_bucket",
        "gapless_e2e_request_latency_seconds_bucket",
        "gapless_device_idle_fraction",
        "gapless_integrity_ok",
    ):
        assert name in text, name


def _metric(client: httpx.Client, name: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_disconnect_mid_stream_aborts_and_frees_kv(server, client, model, endpoint):
    aborted = 'gapless_requests_total{finish_reason="abort"'
    before = _metric(client, aborted)
    body = {"model": model, "max_tokens": 400, "ignore_eos": True, "stream": True}
    body |= (
        {"prompt": "tell me everything"}
        if "chat" not in endpoint
        else {"messages": [{"role": "user", "content": "tell me everything"}]}
    )
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as c:
        with c.stream("POST", endpoint, json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [line for line, _ in zip(lines, range(6)) if line.startswith("data:")]
            assert got and "[DONE]" not in got[-1]
            assert debug_state(client)["running_requests"] == 1
        # leaving the block closes the connection mid-stream
    state = wait_idle_and_clean(client)
    assert state["kv_used_tokens"] == 0 and state["running_requests"] == 0
    assert _metric(client, aborted) == before + 1
    good(client, model)


def test_generate_native_endpoint(client):
    r = client.post(
        "/generate",
        json={
            "input_ids": [[5, 6, 7], [8, 9]],
            "sampling_params": {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True},
        },
    )
    out = r.json()
    assert r.status_code == 200 and len(out) == 2
    assert [o["meta_info"]["prompt_tokens"] for o in out] == [3, 2]
    assert all(len(o["output_ids"]) == 3 and o["meta_info"]["finish_reason"] == "length" for o in out)
    error_of(client.post("/generate", json={"text": "x", "sampling_params": {"bogus": 1}}), 400)
    error_of(client.post("/generate", json={"sampling_params": {}}), 400)


def test_disconnect_while_waiting_for_a_non_streamed_answer_aborts(server, client, model):
    aborted = 'gapless_requests_total{finish_reason="abort"'
    before = _metric(client, aborted)
    # 500 tokens take the tiny model ~0.5 s on an idle 2-core machine: the client gives up long before
    body = {"model": model, "prompt": "a long answer", "max_tokens": 500, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=0.1)
    state = wait_idle_and_clean(client)
    assert state["kv_used_tokens"] == 0 and state["running_requests"] == 0
    assert _metric(client, aborted) == before + 1
    good(client, model)


# ------------------------------------------------------------------ hardening (issue 18)
BIG = 2**64  # past what msgpack and int64 carry: once a 500 that left an open request behind
BIG_SCHEMA = {
    "type": "json_schema",
    "json_schema": {"name": "n", "schema": {"type": "integer", "maximum": BIG}},
}


def _same_connection(server, method: str, path: str, body: bytes, headers: dict) -> tuple[int, bytes]:
    """Send a request and then a good one on one keep-alive connection; the first's status and body.
    Fails if the server closed or reset the connection after the first."""
    conn = http.client.HTTPConnection(server.url.removeprefix("http://"), timeout=60)
    auth = {"Authorization": f"Bearer {API_KEY}"}
    try:
        conn.request(method, path, body=body, headers={**auth, **headers})
        first = conn.getresponse()
        status, payload = first.status, first.read()
        assert first.getheader("connection", "").lower() != "close", "the server closed the connection"
        sock = conn.sock
        good_body = json.dumps({"prompt": "hi", "max_tokens": 1}).encode()
        conn.request(
            "POST", "/v1/completions", body=good_body, headers={**auth, "content-type": "application/json"}
        )
        second = conn.getresponse()
        assert second.status == 200, second.read()
        second.read()
        assert conn.sock is sock, "the request after a bad one needed a new connection"
    finally:
        conn.close()
    return status, payload


@pytest.mark.parametrize(
    ("path", "fields", "param"),
    [
        ("/v1/completions", {"max_tokens": BIG}, "max_tokens"),
        ("/v1/completions", {"seed": BIG}, "seed"),
        ("/v1/completions", {"n": BIG}, "n"),
        ("/v1/completions", {"top_k": BIG}, "top_k"),
        ("/v1/completions", {"logprobs": BIG}, "logprobs"),
        ("/v1/completions", {"stop_token_ids": [1, BIG]}, "stop_token_ids[1]"),
        ("/v1/completions", {"prompt": [5, BIG]}, "prompt"),
        ("/v1/completions", {"prompt": ["hi", [BIG]]}, "prompt"),
        ("/v1/chat/completions", {"max_completion_tokens": BIG}, "max_completion_tokens"),
        ("/v1/chat/completions", {"chat_template_kwargs": {"x": [1, {"y": BIG}]}}, "chat_template_kwargs"),
        ("/v1/chat/completions", {"guided_json": {"": -BIG}}, "guided_json"),  # (a fuzzer's find: a 500)
        ("/v1/completions", {"response_format": BIG_SCHEMA}, "response_format"),
        ("/generate", {"sampling_params": {"max_new_tokens": BIG}}, "sampling_params.max_new_tokens"),
        ("/generate", {"sampling_params": {"seed": -BIG}}, "sampling_params.seed"),
    ],
)
def test_integers_past_64_bits_are_400_naming_the_field(server, client, path, fields, param):
    body = {"prompt": "hi", "max_tokens": 2} if path == "/v1/completions" else {}
    if path == "/v1/chat/completions":
        body = {"messages": [{"role": "user", "content": "hi"}]}
    if path == "/generate":
        body = {"text": "hi"}
    status, payload = _same_connection(
        server, "POST", path, json.dumps(body | fields).encode(), {"content-type": "application/json"}
    )
    assert status == 400, payload
    assert json.loads(payload)["error"]["param"] == param
    assert wait_idle_and_clean(client)["api_open_requests"] == 0


@pytest.mark.parametrize(
    "raw",
    [
        b'{"prompt": "caf\xe9", "max_tokens": 2}',  # Latin-1, not UTF-8
        b'{"prompt": "\xff\xfe", "max_tokens": 2}',
        b"[" * 50_000 + b"]" * 50_000,
        b'{"prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
        b'{"prompt": "x", "chat": ' + b'{"a":' * 20_000 + b"1" + b"}" * 20_001,
    ],
)
def test_undecodable_bodies_are_4xx_and_keep_the_connection(server, client, raw):
    status, payload = _same_connection(
        server, "POST", "/v1/completions", raw, {"content-type": "application/json"}
    )
    assert 400 <= status < 500, payload
    assert json.loads(payload)["error"]["message"]
    assert wait_idle_and_clean(client)["api_open_requests"] == 0


@pytest.mark.parametrize(
    "prompts",
    [
        ["hello there", [10**9]],  # a token id outside the vocabulary: checked by the API server
        ["hello there", "word " * 600],  # longer than the context once tokenized: by the tokenizer
        [[5, 6, 7], [5] * 600],  # token ids longer than the context
    ],
)
def test_a_bad_later_prompt_refuses_the_whole_request_before_anything_runs(client, prompts):
    before = wait_idle_and_clean(client)
    body = {"prompt": prompts, "max_tokens": 50, "ignore_eos": True, "n": 2}
    err = error_of(client.post("/v1/completions", json=body), 400)
    assert err["param"] == "prompt"
    after = wait_idle_and_clean(client)
    assert after["generated_tokens"] == before["generated_tokens"], "a refused request generated tokens"
    assert after["prompt_tokens"] == before["prompt_tokens"], "a refused request was prefilled"
    assert _metric(client, "gapless_api_requests_in_flight") == 0


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/generate"])
def test_a_refusal_after_tokenizing_is_an_http_error_even_when_streamed(client, model, endpoint):
    """A stream starts only once its first tokens are in: a prompt the tokenizer refuses is a 400, not a
    200 with an error event."""
    body = (
        {"prompt": "word " * 600, "stream": True}
        if endpoint == "/v1/completions"
        else {"text": "word " * 600, "stream": True}
    )
    with client.stream("POST", endpoint, json=body) as r:
        r.read()
        err = error_of(r, 400)
    assert "512" in err["message"]
    good(client, model)


def test_401_names_the_scheme(server):
    r = httpx.get(f"{server.url}/v1/models", timeout=30)
    error_of(r, 401)
    assert r.headers["www-authenticate"] == "Bearer"


@pytest.mark.parametrize(
    "content_type",
    ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", "application/xml"],
)
def test_bodies_that_are_not_json_are_415(client, model, content_type):
    body = json.dumps({"model": model, "prompt": "x", "max_tokens": 1})
    err = error_of(client.post("/v1/completions", content=body, headers={"content-type": content_type}), 415)
    assert "application/json" in err["message"]
    r = client.post(
        "/v1/completions", content=body, headers={"content-type": "application/json; charset=utf-8"}
    )
    assert r.status_code == 200, r.text


def test_a_text_part_without_text_names_the_missing_field(client, model):
    content = [{"type": "text", "text": "hi"}, {"type": "text"}]
    body = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": content}]}
    err = error_of(client.post("/v1/chat/completions", json=body), 400)
    assert err["param"] == "messages[1].content[1].text"
    assert "messages[1].content[1].text" in err["message"] and "missing" in err["message"]
    good(client, model)


def test_model_may_be_left_out_or_given_as_the_checkpoint_path(client, ckpt_factory, model):
    path = str(ckpt_factory("qwen3"))
    for name in (None, path, path + "/", model):
        body = {"prompt": "hi", "max_tokens": 2, **({"model": name} if name else {})}
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200, (name, r.text)
        assert r.json()["model"] == (name or model)
        chat = {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2,
            **({"model": name} if name else {}),
        }
        assert client.post("/v1/chat/completions", json=chat).status_code == 200


def test_openapi_schema_is_published_behind_the_key(server, client):
    error_of(httpx.get(f"{server.url}/openapi.json", timeout=30), 401)
    doc = client.get("/openapi.json").json()
    assert doc["security"] == [{"bearer": []}]
    assert {"/v1/completions", "/v1/chat/completions", "/generate"} <= set(doc["paths"])
    schemas = doc["components"]["schemas"]
    # the native endpoint's sampling fields are SamplingParams' own, plus SGLang's max_new_tokens
    fields = set(schemas["SamplingParamsIn"]["properties"])
    assert fields == {f.name for f in dataclasses.fields(SamplingParams)} | {"max_new_tokens"}
    assert schemas["CompletionRequest"]["properties"]["seed"]["anyOf"][0]["maximum"] == 2**63 - 1
    assert "chat_template_kwargs" in schemas["ChatCompletionRequest"]["properties"]
