"""Speculation behind the server: several tokens per request per step flow through the scheduler worker,
the detokenizer and the stream (streamed text equals the whole reply, which equals the model's script),
its figures reach /metrics, a grammar request runs beside them, and the server keeps serving after a bad
request. Driven by the `openai` client."""

from __future__ import annotations

import re

import httpx
import openai
import pytest

from gapless.testing.server import ServerProcess

from .conftest import CYCLE


@pytest.fixture(scope="module")
def spec_server(cyclic):
    srv = ServerProcess(
        "--model",
        cyclic,
        "--device",
        "cpu",
        "--kv-cache-tokens",
        "4096",
        "--speculative-algorithm",
        "ngram",
        "--speculative-num-draft-tokens",
        "4",
        "--ngram-max",
        "3",
        "--served-model-name",
        "x",
    )
    yield srv
    assert srv.stop(timeout=60) == 0, srv.output


def test_runs_of_tokens_stream_through_the_server(spec_server):
    client = openai.OpenAI(base_url=f"{spec_server.url}/v1", api_key="none", max_retries=0)
    expected = (CYCLE * 9)[2:42]  # after "...ab": c d e a b ...
    whole = client.completions.create(model="x", prompt="xabcdeab", max_tokens=40, temperature=0)
    assert whole.choices[0].text == expected
    assert whole.usage.completion_tokens == 40
    stream = client.completions.create(
        model="x", prompt="xabcdeab", max_tokens=40, temperature=0, stream=True
    )
    pieces = [c.choices[0].text for c in stream if c.choices]
    assert "".join(pieces) == expected
    assert len(pieces) < 40, "each step should have brought several tokens"
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="x", prompt="xab", max_tokens=-1)
    # a grammar runs in the verify batches too (its request drafts nothing): the mask decides, not the script
    guided = client.completions.create(
        model="x", prompt="xab", max_tokens=12, temperature=0, extra_body={"guided_regex": "(ac|bd)+e"}
    )
    assert re.fullmatch("(ac|bd)+e", guided.choices[0].text), guided.choices[0].text
    stopped = client.completions.create(model="x", prompt="xab", max_tokens=40, temperature=0, stop=["ea"])
    assert stopped.choices[0].text == "cd" and stopped.choices[0].finish_reason == "stop"
    metrics = httpx.get(f"{spec_server.url}/metrics").text
    name = 'gapless_spec_accepted_tokens{replica="0"} '  # the one replica's series
    accepted = [line for line in metrics.splitlines() if line.startswith(name)]
    assert accepted and float(accepted[0].split()[1]) > 20
