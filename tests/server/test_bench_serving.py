"""`python -m gapless.bench.serving` against the real server: every request completes with exactly its
output length, and the report's token counts match what the server's metrics counted."""

from __future__ import annotations

from gapless.bench import serving
from tests.server.conftest import API_KEY, wait_idle_and_clean


def _counter(client, name: str) -> float:
    lines = [line for line in client.get("/metrics").text.splitlines() if line.startswith(name + "{")]
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines)


def test_serving_benchmark_against_the_server(server, client, tmp_path):
    before = _counter(client, "gapless_generation_tokens_total")
    out = tmp_path / "serving.json"
    result = serving.main(
        [
            "--base-url",
            server.url,
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
            "--disable-tqdm",
            "--output-json",
            str(out),
        ]
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
