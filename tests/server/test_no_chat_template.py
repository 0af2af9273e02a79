"""A model whose tokenizer has no chat template: a chat request is a 400 naming `messages` before any
stream starts (not a 200 and an error event), and the same server goes on serving completions."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest

from gapless.testing.server import ServerProcess


@pytest.fixture(scope="module")
def server(ckpt_factory, tmp_path_factory):
    path = tmp_path_factory.mktemp("no-template") / "plain-qwen3"
    shutil.copytree(ckpt_factory("qwen3"), path)
    (path / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    srv = ServerProcess("--model", str(path), "--device", "cpu", "--kv-cache-tokens", "4096")
    yield srv
    assert srv.stop() == 0, srv.output


@pytest.mark.parametrize("stream", [False, True])
def test_a_chat_without_a_chat_template_is_a_400_before_any_stream(server, stream):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": stream}
    with httpx.Client(base_url=server.url, timeout=60) as c:
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            r.read()
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "messages" and "no chat template" in err["message"]
        r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "stream": stream})
        assert r.status_code == 200, r.text
