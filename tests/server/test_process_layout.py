"""The process layouts (`--process-layout`, `gapless.server.layout`): `auto` picks `merged` (tokenizer and
detokenizer in one process) below 4 cores, and the merged layout serves exactly the tokens and text the
split one does: greedy and seeded sampling, chats, stop strings, streams, logprobs, refusals."""

from __future__ import annotations

import json

import httpx
import pytest

from gapless.server.layout import choose_layout
from gapless.testing.server import ServerProcess, alive, wait_until
from tests.server.conftest import API_KEY, wait_idle_and_clean

# prompts no other test sends: the session's server has no prefix of them cached, so both servers compute
# each request alike (a cached prefix changes the sums' order, and a logprob's last bits)
_REQUESTS = [
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


def test_auto_merges_below_four_cores():
    assert [choose_layout("auto", cores) for cores in (1, 2, 3, 4, 16)] == ["merged"] * 3 + ["split"] * 2
    assert choose_layout("split", 1) == "split" and choose_layout("merged", 64) == "merged"
    with pytest.raises(ValueError, match="process layout must be one of auto, split, merged"):
        choose_layout("single")


def _answers(url: str) -> list[object]:
    """What the server answers to _REQUESTS, whole and streamed, without the ids and times that differ."""
    out: list[object] = []
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as c:
        for path, body in _REQUESTS:
            r = c.post(path, json=body)
            assert r.status_code == 200, r.text
            usage = dict(r.json()["usage"])
            del usage["prompt_tokens_details"]  # the prefix cache's hits differ between the servers
            out += [r.json()["choices"], usage, _stream(c, path, body)]
        bad = c.post("/v1/completions", json={"prompt": [814], "max_tokens": -1})  # refused, then served
        out.append((bad.status_code, bad.json()["error"]["param"]))
        good = {"prompt": [814], "max_tokens": 2, "temperature": 0}
        out.append(c.post("/v1/completions", json=good).json()["choices"])
        wait_idle_and_clean(c)
    return out


def _stream(c: httpx.Client, path: str, body: dict) -> tuple[str, list[object]]:
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


def test_merged_layout_serves_the_same_tokens_as_split(server):
    """The session's server runs the layout `auto` picks here; a second one, the other layout, on the
    same model and options: both answer every request alike, to the token."""
    other = "split" if choose_layout("auto") == "merged" else "merged"
    names = {
        "merged": {"scheduler", "tokenizer+detokenizer"},
        "split": {"scheduler", "tokenizer", "detokenizer"},
    }
    args = server.proc.args[server.proc.args.index("--port") + 2 :]  # its model and options, as given
    srv = ServerProcess(*args, "--process-layout", other)
    workers = srv.workers()
    try:
        assert f"process layout {other} (--process-layout)" in srv.output
        headers = {"Authorization": f"Bearer {API_KEY}"}
        for s, layout in ((server, choose_layout("auto")), (srv, other)):
            pids = httpx.get(f"{s.url}/debug/state", headers=headers, timeout=30).json()["worker_pids"]
            assert set(pids) == names[layout], pids
        assert _answers(srv.url) == _answers(server.url)
    finally:
        assert srv.stop() == 0, srv.output
    assert wait_until(lambda: not any(alive(p) for p in workers), 10), "workers outlived the server"
