"""Streamed text is right: with the scripted model writing "é€ab#" one byte token at a time for é and
€, each character arrives whole, and a stop string (even across tokens) is never shown. The offline
engine, the server's answer and its stream agree on the text, the finish reason and the token the
request stopped at."""

from __future__ import annotations

import json

import httpx
import pytest

from gapless.llm import LLM
from gapless.sampling_params import SamplingParams
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


# The stop rule's edges (tests/engine/test_stop.py) through the real engine. The script's tokens: é (2
# byte tokens), € (3), a, b, #, then EOS. (stop strings, text, output tokens)
STOP_CASES = [
    (["€"], "é", 5),  # a stop string that is a character spread over tokens
    (["é"], "", 2),  # ...at the first generated character
    (["é€ab#"], "", 8),  # the whole text
    (["b#", "€a"], "é", 6),  # several: the earliest wins
    (["b", "€ab"], "é", 7),  # a longer one starting earlier, completed by the same token
    (["a", "€ab"], "é€", 6),  # the request stops at the first token whose text holds one
    (["ab#", "ab"], "é€", 7),  # one that is a prefix of another
    (["#x", "b#x"], SCRIPT_TEXT, 9),  # never completed: the held "b#" is shown when EOS ends it
]


@pytest.fixture(scope="module")
def offline(scripted):
    """The scripted checkpoint in this process (the server was started with `--model PATH`)."""
    args = scripted.proc.args
    with LLM(args[args.index("--model") + 1], device="cpu", kv_cache_tokens=4096) as llm:
        yield llm


@pytest.mark.parametrize("stop,text,tokens", STOP_CASES)
def test_offline_and_served_text_agree(scripted, model, offline, stop, text, tokens):
    prompt = [7, scripted.start_token]
    out = offline.generate(
        [prompt], SamplingParams(max_tokens=20, temperature=0.0, stop=stop), use_tqdm=False
    )
    assert (out[0].text, out[0].finish_reason, len(out[0].token_ids)) == (text, "stop", tokens)
    body = {"model": model, "prompt": prompt, "max_tokens": 20, "temperature": 0, "stop": stop}
    answer = complete(scripted.url, body)
    assert (answer["choices"][0]["text"], answer["choices"][0]["finish_reason"]) == (text, "stop")
    assert answer["usage"]["completion_tokens"] == tokens
    texts, chunks = stream_deltas(
        scripted.url, "/v1/completions", {**body, "stream_options": {"include_usage": True}}
    )
    assert "".join(texts) == text
    reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert [r for r in reasons if r] == ["stop"]
    assert chunks[-1]["usage"]["completion_tokens"] == tokens
