"""Tensor parallelism served: `gapless serve --tp 2` through the `openai` client; two nodes
(`--nnodes 2 --node-rank 0/1`) as two processes on this machine, node 0 serving HTTP and node 1 running
its rank only; a killed rank ends the server (503 naming it, non-zero exit) and leaves no process."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import httpx
import psutil
import pytest

from gapless import LLM, SamplingParams
from gapless.testing.server import ServerProcess, alive, descendants, wait_until

# the `test` extra's client (with httpx2, which it imports): where it is absent the module skips, saying so
openai = pytest.importorskip("openai", reason="the openai client (gapless[test]) drives the server")

PROMPT = "The quick brown fox"
SERVE = ("--device", "cpu", "--kv-cache-tokens", "4096", "--dtype", "float32")


@pytest.fixture(scope="module")
def expected(ckpt_factory) -> str:
    """The greedy reply of one rank, offline: what every tensor-parallel server must write."""
    with LLM(str(ckpt_factory("qwen3")), device="cpu", dtype="float32", kv_cache_tokens=4096) as llm:
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        return llm.generate([PROMPT], params, use_tqdm=False)[0].text


def _client(url: str) -> tuple[openai.OpenAI, str]:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    return client, client.models.list().data[0].id


def _complete(url: str) -> str:
    client, model = _client(url)
    out = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    return out.choices[0].text


def _ranks(pids: set[int]) -> list[int]:
    """The rank processes among `pids`, rank 0 first (they start in rank order)."""
    found = []
    for pid in pids:
        try:
            if "gapless.engine.tp" in psutil.Process(pid).cmdline():
                found.append(pid)
        except psutil.Error:
            continue
    return sorted(found)


@pytest.mark.slow
def test_tp2_server_serves_the_openai_client(ckpt_factory, expected):
    srv = ServerProcess("--model", str(ckpt_factory("qwen3")), *SERVE, "--tp", "2")
    try:
        workers = srv.workers()
        assert len(_ranks(workers)) == 2, srv.output
        assert _complete(srv.url) == expected
        client, model = _client(srv.url)
        with pytest.raises(openai.BadRequestError, match="max_tokens"):  # a bad request, then good ones
            client.completions.create(model=model, prompt=PROMPT, max_tokens=-1)
        stream = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=6, stream=True, seed=3
        )
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert _complete(srv.url) == expected
    finally:
        assert srv.stop() == 0, srv.output
    assert wait_until(lambda: not any(alive(p) for p in workers), 15), "processes outlived the server"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_nodes_serve_one_tp2_model_and_a_killed_rank_ends_both(ckpt_factory, expected):
    model = str(ckpt_factory("qwen3"))
    # a collective with a dead peer fails at once when its sockets close, else after --dist-timeout (the
    # heartbeat then names the rank): 30 s keeps that slower path inside the 60 s the request may take
    nodes = (
        "--tp",
        "2",
        "--nnodes",
        "2",
        "--dist-init-addr",
        f"127.0.0.1:{_free_port()}",
        "--dist-timeout",
        "30",
    )
    node1 = subprocess.Popen(
        [sys.executable, "-m", "gapless", "serve", "--model", model, *SERVE, *nodes, "--node-rank", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    srv = None
    try:
        srv = ServerProcess("--model", model, *SERVE, *nodes, "--node-rank", "0")
        assert _complete(srv.url) == expected
        everything = srv.workers() | descendants(node1.pid)
        (rank1,) = _ranks(descendants(node1.pid))
        assert len(_ranks(srv.workers())) == 1
        os.kill(rank1, signal.SIGKILL)
        reply = httpx.post(f"{srv.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 4}, timeout=60)
        assert reply.status_code == 503, reply.text
        assert "tensor-parallel rank 1 stopped answering" in reply.text
        assert srv.wait(60) != 0
        assert node1.wait(30) != 0
    finally:
        if srv is not None:
            srv.stop()
        if node1.poll() is None:
            node1.kill()
        out = node1.communicate()[0]
    assert "node 1 of 2: 1 of 2 ranks" in out and "tensor-parallel rank 1 died (exit code -9)" in out, out
    assert wait_until(lambda: not any(alive(p) for p in everything), 15), "processes outlived the nodes"
