"""Tensor parallelism served: `gapless serve --tp 2` through the `openai` client, a killed rank ending the
server (503, non-zero exit, no process left), and two nodes (`--nnodes 2 --node-rank 0/1`) as two
processes on this machine, node 0 serving HTTP and node 1 running its rank only."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import httpx
import openai
import psutil
import pytest

from gapless import LLM, SamplingParams
from gapless.testing.server import ServerProcess, alive, descendants, wait_until

PROMPT = "The quick brown fox"
SERVE = ("--device", "cpu", "--kv-cache-tokens", "4096", "--dtype", "float32")


@pytest.fixture(scope="module")
def expected(ckpt_factory) -> str:
    """The greedy reply of one rank, offline: what every tensor-parallel server must write."""
    with LLM(str(ckpt_factory("qwen3")), device="cpu", dtype="float32", kv_cache_tokens=4096) as llm:
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        out = llm.generate([PROMPT], params, use_tqdm=False)
    return out[0].text


def _complete(url: str) -> str:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id
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


def test_tp2_server_answers_the_openai_client_and_a_killed_rank_ends_it(ckpt_factory, expected):
    srv = ServerProcess("--model", str(ckpt_factory("qwen3")), *SERVE, "--tp", "2")
    try:
        assert _complete(srv.url) == expected
        workers = srv.workers()
        ranks = _ranks(workers)
        assert len(ranks) == 2, srv.output
        os.kill(ranks[1], signal.SIGKILL)
        body = {"prompt": PROMPT, "max_tokens": 4}  # (the model field may be left out)
        reply = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60)
        assert reply.status_code == 503, reply.text
        assert "tensor-parallel rank 1 died (exit code -9)" in reply.text
        assert srv.wait(60) != 0
        assert "tensor-parallel rank 1 died" in srv.output
    finally:
        srv.stop()
    assert wait_until(lambda: not any(alive(p) for p in workers), 15), "processes outlived the server"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_serve_one_tp2_model(ckpt_factory, expected):
    model = str(ckpt_factory("qwen3"))
    nodes = ("--tp", "2", "--nnodes", "2", "--dist-init-addr", f"127.0.0.1:{_free_port()}")
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
        node1_ranks = _ranks(descendants(node1.pid))
        assert len(node1_ranks) == 1 and len(_ranks(srv.workers())) == 1
        everything = srv.workers() | descendants(node1.pid)
        assert srv.stop() == 0, srv.output
        assert node1.wait(30) == 0  # node 0's stop reached node 1's rank
    finally:
        if srv is not None:
            srv.stop()
        if node1.poll() is None:
            node1.kill()
        out = node1.communicate()[0]
    assert "node 1 of 2: 1 of 2 ranks" in out, out
    assert wait_until(lambda: not any(alive(p) for p in everything), 15), "processes outlived the nodes"
