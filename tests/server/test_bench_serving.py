"""`python -m gapless.bench.serving` against the real server: every request completes with exactly its
output length, and the report's token counts match what the server's metrics counted, also for a model
whose vocabulary its tokenizer covers only in part (most of its tokens decode to no text)."""

from __future__ import annotations

import httpx
import pytest

from gapless.bench import serving
from gapless.default_model.tokenizer import VOCAB_SIZE, build_tokenizer
from gapless.testing import make_checkpoint
from tests.server.conftest import API_KEY, _serve, wait_idle_and_clean


def _counter(client, name: str) -> float:
    lines = [line for line in client.get("/metrics").text.splitlines() if line.startswith(name + "{")]
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines)


def _bench(url: str, *argv: str) -> dict:
    return serving.main(["--base-url", url, "--disable-tqdm", *argv])


def test_serving_benchmark_against_the_server(server, client, tmp_path):
    before = _counter(client, "gapless_generation_tokens_total")
    out = tmp_path / "serving.json"
    result = _bench(
        server.url,
        *[
            "--api-key",
            API_KEY,
            "--num-prompts",
            "24",
            "--request-rate",
            "40",
            "--input-len",
            "32",
            "--output-len",
            "12",
            "--seed",
            "3",
            "--output-json",
            str(out),
        ],
    )
    summary = result["summary"]
    assert summary["completed"] == 24 and summary["failed"] == 0, summary["errors"]
    assert summary["wrong_length_requests"] == 0
    assert summary["output_tokens"] == summary["requested_output_tokens"]
    assert _counter(client, "gapless_generation_tokens_total") - before == summary["output_tokens"]
    for key in ("ttft_ms", "tpot_ms", "e2e_ms"):
        assert 0 < summary[key]["p50"] <= summary[key]["p99"]
    assert out.exists()
    wait_idle_and_clean(client)


@pytest.mark.slow  # (a server of its own, ~8 s)
def test_every_token_counts_when_the_tokenizer_covers_less_than_the_vocabulary(tmp_path):
    """A random model of 32,000 ids with the 1,000-id trained tokenizer: nearly every token it samples
    decodes to no text, so most streams carry no text at all. Each request still completes with its
    whole output length, counted from the server's usage (before: "no output tokens in stream"). The
    server's ready line names the prefill budget chosen for the CPU."""
    path = make_checkpoint(tmp_path / "ckpt", "qwen3", vocab_size=32000)
    build_tokenizer(save_dir=path)  # the trained tokenizer alone, over the filled one
    srv = _serve("--model", str(path), "--max-model-len", "256")
    try:
        assert "chunked_prefill_size 2048;" in srv.output
        argv = ["--num-prompts", "16", "--input-len", "8", "--output-len", "4", "--range-ratio", "0"]
        summary = _bench(srv.url, *argv, "--vocab-size", str(VOCAB_SIZE))["summary"]
        assert (summary["completed"], summary["failed"]) == (16, 0), summary["errors"]
        assert summary["output_tokens"] == summary["requested_output_tokens"] == 16 * 4
        # the server keeps serving: a plain request after the run
        with httpx.Client(base_url=srv.url, timeout=60) as client:
            r = client.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 2, "ignore_eos": True})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    finally:
        assert srv.stop() == 0, srv.output
