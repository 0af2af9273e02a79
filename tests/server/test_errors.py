"""Bad input gets an OpenAI-style error with the right status, and the server keeps serving; a client
that goes away mid-stream has its request aborted and its KV freed."""

from __future__ import annotations

import json

import httpx
import pytest

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
    ({"logprobs": 9}, "logprobs"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": [10**9]}, "prompt"),  # outside the vocabulary
    ({"prompt": "word " * 600}, "prompt"),  # longer than --max-model-len 512
    ({"logit_bias": {"5": 1.0}}, "logit_bias"),
    ({"echo": True}, "echo"),
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
    body = {"model": model, "prompt": "a long answer", "max_tokens": 400, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=0.5)
    state = wait_idle_and_clean(client)
    assert state["kv_used_tokens"] == 0 and state["running_requests"] == 0
    assert _metric(client, aborted) == before + 1
    good(client, model)
