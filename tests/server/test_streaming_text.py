"""Streamed text is right: with the scripted model writing "é€ab#" one byte token at a time for é and
€, each character arrives whole, and a stop string (even across tokens) is never shown."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.server.conftest import SCRIPT_TEXT


def stream_deltas(url: str, path: str, body: dict) -> tuple[list[str], list[dict]]:
    texts, chunks = [], []
    with (
        httpx.Client(base_url=url, timeout=60) as c,
        c.stream("POST", path, json={**body, "stream": True}) as r,
    ):
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                break
            chunk = json.loads(line[6:])
            chunks.append(chunk)
            for choice in chunk.get("choices", []):
                piece = choice.get("text", choice.get("delta", {}).get("content"))
                if piece:
                    texts.append(piece)
    return texts, chunks


def complete(url: str, body: dict) -> dict:
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def model(scripted):
    return httpx.get(f"{scripted.url}/v1/models").json()["data"][0]["id"]


def test_multibyte_characters_arrive_whole(scripted, model):
    body = {"model": model, "prompt": [7, scripted.start_token], "max_tokens": 20, "temperature": 0}
    texts, chunks = stream_deltas(scripted.url, "/v1/completions", body)
    assert "".join(texts) == SCRIPT_TEXT
    assert not any("\ufffd" in t for t in texts), texts
    assert any("é" in t for t in texts) and any("€" in t for t in texts)
    # one token each ("é" is 2 byte tokens, "€" 3): held back until whole, yet nothing is lost
    assert complete(scripted.url, body)["choices"][0]["text"] == SCRIPT_TEXT
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "stop"  # EOS


@pytest.mark.parametrize("stop", ["b#", "ab", "€a", "#"])
def test_stop_string_is_never_shown(scripted, model, stop):
    body = {
        "model": model,
        "prompt": [7, scripted.start_token],
        "max_tokens": 20,
        "temperature": 0,
        "stop": [stop],
    }
    want = SCRIPT_TEXT[: SCRIPT_TEXT.index(stop)]
    texts, chunks = stream_deltas(scripted.url, "/v1/completions", body)
    assert "".join(texts) == want
    assert not any(stop in t or "\ufffd" in t for t in texts)
    assert complete(scripted.url, body)["choices"][0]["text"] == want
    reasons = [
        c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]
    ]
    assert reasons == ["stop"]


def test_chat_stream_through_the_template(scripted, model):
    """The chat template's assistant header leads into the script: the reply is "x" + SCRIPT_TEXT."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 20,
        "temperature": 0,
    }
    texts, chunks = stream_deltas(scripted.url, "/v1/chat/completions", body)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(texts) == "x" + SCRIPT_TEXT
    assert not any("\ufffd" in t for t in texts)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    r = httpx.post(f"{scripted.url}/v1/chat/completions", json={**body, "stop": ["€"]}, timeout=60)
    assert r.json()["choices"][0]["message"]["content"] == "xé"
