"""Live servers for the server tests: `python -m gapless serve` in a child process, on a free port."""

from __future__ import annotations

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
