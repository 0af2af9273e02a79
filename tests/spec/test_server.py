"""Speculation behind the server, with a draft model (`--speculative-draft-model`; n-gram drafts take the
same path through the scheduler worker, and are tested offline): several tokens per request per step flow
through the scheduler worker, the detokenizer and the stream (streamed text equals the whole reply, which
equals the model's script and offline decoding without speculation), its figures reach /metrics, a
grammar request runs beside them, and the server keeps serving after a bad request. Driven by the
`openai` client, against one server start."""

from __future__ import annotations

import re
import shutil

import httpx
import openai
import pytest

from gapless import LLM, SamplingParams
from gapless.testing.server import ServerProcess

from .conftest import CYCLE, ids


@pytest.fixture(scope="module")
def draft_server(cyclic, tmp_path_factory):
    """One server for the module: the cyclic model drafted for by a checkpoint of its own (a copy of the
    model at another path, so its drafts are right and runs of them are accepted)."""
    draft = tmp_path_factory.mktemp("draft") / "model"
    shutil.copytree(cyclic, draft)
    srv = ServerProcess(
        *("--model", cyclic, "--device", "cpu", "--kv-cache-tokens", "4096", "--served-model-name", "x"),
        *("--speculative-algorithm", "draft", "--speculative-draft-model", str(draft)),
        *("--speculative-num-draft-tokens", "4"),
    )
    yield srv
    assert srv.stop(timeout=60) == 0, srv.output


def test_runs_of_tokens_stream_through_the_server(draft_server):
    client = openai.OpenAI(base_url=f"{draft_server.url}/v1", api_key="none", max_retries=0)
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
    metrics = httpx.get(f"{draft_server.url}/metrics").text
    name = 'gapless_spec_accepted_tokens{replica="0"} '  # the one replica's series
    accepted = [line for line in metrics.splitlines() if line.startswith(name)]
    assert accepted and float(accepted[0].split()[1]) > 20


def _metric(url: str, name: str) -> float:
    """The one replica's value of `name` on /metrics."""
    prefix = f'{name}{{replica="0"}} '
    lines = [line for line in httpx.get(f"{url}/metrics").text.splitlines() if line.startswith(prefix)]
    assert len(lines) == 1, f"{name} missing from /metrics"
    return float(lines[0].split()[1])


def test_a_served_draft_model(cyclic, draft_server):
    """`gapless serve --speculative-algorithm draft --speculative-draft-model PATH`: streamed and whole
    completions through the `openai` client are the text of offline greedy decoding without speculation
    (`LLM`), and /metrics counts the drafted and accepted tokens. A bad request on the way, and the
    server serves the next."""
    prompts = [ids("xabcdeab"), ids("fghij") + ids("xf")]
    with LLM(cyclic, device="cpu", kv_cache_tokens=2048, overlap=False) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0), use_tqdm=False)
        expected = [(o.text, len(o.token_ids)) for o in outs]
    client = openai.OpenAI(base_url=f"{draft_server.url}/v1", api_key="none", max_retries=0)
    drafted = _metric(draft_server.url, "gapless_spec_drafted_tokens")
    accepted = _metric(draft_server.url, "gapless_spec_accepted_tokens")
    ask = dict(model="x", max_tokens=16, temperature=0)
    for prompt, (text, count) in zip(prompts, expected):
        whole = client.completions.create(prompt=prompt, **ask)
        assert (whole.choices[0].text, whole.usage.completion_tokens) == (text, count)
        with pytest.raises(openai.BadRequestError, match="temperature"):
            client.completions.create(prompt=prompt, **{**ask, "temperature": -1})
        stream = client.completions.create(prompt=prompt, stream=True, **ask)
        assert "".join(c.choices[0].text for c in stream if c.choices) == text
    drafted = _metric(draft_server.url, "gapless_spec_drafted_tokens") - drafted
    accepted = _metric(draft_server.url, "gapless_spec_accepted_tokens") - accepted
    assert drafted > 0 and accepted > 0.5 * drafted, (drafted, accepted)
