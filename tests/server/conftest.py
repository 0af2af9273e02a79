"""Live servers for the server tests: `python -m gapless serve` in a child process, on a free port."""

from __future__ import annotations

import json

import httpx
import pytest

from gapless.default_model.tokenizer import build_tokenizer
from gapless.testing.scripted import byte_token_ids, make_scripted_checkpoint
from gapless.testing.server import ServerProcess, alive, wait_until

API_KEY = "test-key"
MAX_REQUEST_BYTES = 65536
# the scripted model's output after the token `x`: "é€ab#", one token per byte for é and €
SCRIPT_TEXT = "é€ab#"


def _serve(*args: str) -> ServerProcess:
    return ServerProcess("--device", "cpu", "--kv-cache-tokens", "65536", *args)


@pytest.fixture(scope="session")
def server(ckpt_factory):
    srv = _serve(
        "--model",
        str(ckpt_factory("qwen3")),
        "--api-key",
        API_KEY,
        "--max-request-bytes",
        str(MAX_REQUEST_BYTES),
        "--max-model-len",
        "512",
    )
    workers = srv.workers()
    yield srv
    assert srv.stop() == 0, srv.output
    assert wait_until(lambda: not any(alive(p) for p in workers), 10), "workers outlived the server"


@pytest.fixture(scope="session")
def scripted(tmp_path_factory):
    """A server whose model greedily writes SCRIPT_TEXT after the prompt's last token `x` (and "x" +
    SCRIPT_TEXT as a chat reply), then EOS."""
    tok = build_tokenizer()
    start = tok.convert_tokens_to_ids("x")
    chain = [start, *byte_token_ids("é€".encode()), *(tok.convert_tokens_to_ids(c) for c in "ab#")]
    # a chat prompt ends with the template's assistant header: its last token leads into the script too
    header = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    chat_end = tok.encode(header, add_special_tokens=False)[-1]
    assert chat_end not in chain
    chain.insert(0, chat_end)
    path = make_scripted_checkpoint(tmp_path_factory.mktemp("scripted"), dict(zip(chain[:-1], chain[1:])))
    srv = _serve("--model", str(path))
    srv.start_token = start
    yield srv
    assert srv.stop() == 0, srv.output


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as c:
        yield c


def debug_state(client: httpx.Client) -> dict:
    r = client.get("/debug/state")
    r.raise_for_status()
    return r.json()


def wait_idle_and_clean(client: httpx.Client, timeout: float = 30.0) -> dict:
    """Wait until the engine has nothing running and its integrity check passed; returns its state."""
    state: dict = {}

    def clean() -> bool:
        nonlocal state
        state = debug_state(client)
        return state["integrity"] == "ok" and state["api_open_requests"] == 0

    assert wait_until(clean, timeout, 0.2), state
    return state


# prompts no other test sends: the session's server has no prefix of them cached, so two servers compute
# each request alike (a cached prefix changes the sums' order, and a logprob's last bits)
_SAME_ANSWER_REQUESTS = [
    (
        "/v1/completions",
        {"prompt": [811, 812, 813], "max_tokens": 8, "logprobs": 2, "temperature": 0, "ignore_eos": True},
    ),
    ("/v1/completions", {"prompt": "layouts alike", "max_tokens": 6, "seed": 7, "n": 3, "ignore_eos": True}),
    ("/v1/completions", {"prompt": "layout stops", "max_tokens": 12, "temperature": 0, "stop": ["e", "th"]}),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "layout chat"}], "max_tokens": 6, "seed": 1},
    ),
]


def same_answers(url: str) -> list[object]:
    """What the server at `url` answers to a few requests (greedy and seeded, n > 1, stop strings, a chat,
    logprobs, a refusal), whole and streamed, without what differs between two servers of one model and
    options (ids, times, prefix cache hits): two such servers must answer alike, to the token."""
    out: list[object] = []
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as c:
        for path, body in _SAME_ANSWER_REQUESTS:
            r = c.post(path, json=body)
            assert r.status_code == 200, r.text
            usage = dict(r.json()["usage"])
            del usage["prompt_tokens_details"]  # the prefix cache's hits differ between the servers
            out += [r.json()["choices"], usage, _stream_text(c, path, body)]
        bad = c.post("/v1/completions", json={"prompt": [814], "max_tokens": -1})  # refused, then served
        out.append((bad.status_code, bad.json()["error"]["param"]))
        good = {"prompt": [814], "max_tokens": 2, "temperature": 0}
        out.append(c.post("/v1/completions", json=good).json()["choices"])
        wait_idle_and_clean(c)
    return out


@pytest.fixture(scope="session")
def session_answers(server) -> list[object]:
    """`same_answers` of the session's server, asked once (asked again, its prefix cache would hold them)."""
    return same_answers(server.url)


def _stream_text(c: httpx.Client, path: str, body: dict) -> tuple[str, list[object]]:
    """A streamed answer's whole text per choice and its finish reasons (chunk boundaries may differ)."""
    texts: dict[int, str] = {}
    finishes: list[object] = []
    with c.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:])["choices"]:
                piece = choice.get("text", choice.get("delta", {}).get("content")) or ""
                texts[choice["index"]] = texts.get(choice["index"], "") + piece
                if choice["finish_reason"] is not None:
                    finishes.append((choice["index"], choice["finish_reason"]))
    return "|".join(texts[i] for i in sorted(texts)), sorted(finishes)
