"""The official `openai` client against a live server: completions and chat, streamed and not, usage,
n, seeds, logprobs; and 200 concurrent streams leaving the KV cache whole."""

from __future__ import annotations

import asyncio

import openai
import pytest
from transformers import AutoTokenizer

from tests.server.conftest import API_KEY, wait_idle_and_clean


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def model(oai):
    models = oai.models.list().data
    assert len(models) == 1
    return models[0].id


@pytest.fixture(scope="module")
def tokenizer(ckpt_factory):
    return AutoTokenizer.from_pretrained(str(ckpt_factory("qwen3")))


EXTRA = {"ignore_eos": True}


def test_completion_usage_and_length(oai, model, tokenizer):
    prompt = "The quick brown fox"
    out = oai.completions.create(model=model, prompt=prompt, max_tokens=7, temperature=0, extra_body=EXTRA)
    assert len(out.choices) == 1
    choice = out.choices[0]
    assert choice.finish_reason == "length"
    assert out.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert out.usage.completion_tokens == 7
    assert out.usage.total_tokens == out.usage.prompt_tokens + 7
    # the text is the decode of the 7 tokens: greedy, so /generate on the same prompt gives the ids
    assert choice.text and isinstance(choice.text, str)


def test_completion_stream_equals_non_stream(oai, model):
    kw = dict(
        model=model, prompt="Once upon a time", max_tokens=24, temperature=0.9, seed=1234, extra_body=EXTRA
    )
    full = oai.completions.create(**kw)
    chunks = list(oai.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_chat_stream_equals_non_stream_and_usage(oai, model, tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story"}]
    kw = dict(model=model, messages=messages, max_tokens=16, temperature=0.8, seed=7, extra_body=EXTRA)
    full = oai.chat.completions.create(**kw)
    assert full.choices[0].message.role == "assistant"
    assert full.choices[0].finish_reason == "length"
    prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert full.usage.prompt_tokens == len(tokenizer.encode(prompt_ids, add_special_tokens=False))
    assert full.usage.completion_tokens == 16

    chunks = list(oai.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 16


def test_max_completion_tokens(oai, model):
    out = oai.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_completion_tokens=3, extra_body=EXTRA
    )
    assert out.usage.completion_tokens == 3


def test_n2_and_seeded_sampling_repeat_across_requests(oai, model):
    kw = dict(
        model=model,
        prompt="def fibonacci(n):",
        max_tokens=12,
        temperature=1.0,
        n=2,
        seed=99,
        extra_body=EXTRA,
    )
    first = oai.completions.create(**kw)
    second = oai.completions.create(**kw)
    texts = [c.text for c in sorted(first.choices, key=lambda c: c.index)]
    assert [c.index for c in first.choices] == [0, 1]
    assert texts == [c.text for c in sorted(second.choices, key=lambda c: c.index)]
    assert texts[0] != texts[1], "the two choices of one request should be different samples"
    assert first.usage.completion_tokens == 24
    other = oai.completions.create(**{**kw, "seed": 100, "n": 1})
    assert other.choices[0].text != texts[0]


def test_sampling_extensions_are_honoured(oai, model):
    """stop_token_ids and top_k=1 (greedy) through extra_body, as vLLM's clients send them."""
    greedy = oai.completions.create(model=model, prompt="abc", max_tokens=6, temperature=0, extra_body=EXTRA)
    top1 = oai.completions.create(
        model=model,
        prompt="abc",
        max_tokens=6,
        temperature=1.5,
        extra_body={**EXTRA, "top_k": 1, "min_p": 0.1},
    )
    assert top1.choices[0].text == greedy.choices[0].text
    # stop at the greedy continuation's second token: the output ends with its first occurrence
    ids = oai.post(
        "/../generate",
        body={"text": "abc", "sampling_params": {"max_tokens": 6, "temperature": 0, "ignore_eos": True}},
        cast_to=object,
    )["output_ids"]
    stopped = oai.completions.create(
        model=model, prompt="abc", max_tokens=6, temperature=0, extra_body={"stop_token_ids": [ids[1]]}
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.usage.completion_tokens == ids.index(ids[1]) + 1


def test_logprobs(oai, model):
    out = oai.completions.create(
        model=model, prompt="Hello", max_tokens=4, temperature=0, logprobs=3, extra_body=EXTRA
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert len(top) <= 3 and chosen <= 0
        assert chosen == pytest.approx(max(top.values()))  # greedy: the chosen token is the most likely

    chat = oai.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Hello"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body=EXTRA,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 3
    assert all(
        len(c.top_logprobs) == 2 and c.logprob == pytest.approx(c.top_logprobs[0].logprob) for c in content
    )
    assert "".join(c.token for c in content) == chat.choices[0].message.content


def test_200_concurrent_streams_complete_and_kv_is_whole(server, model, client):
    aoai = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=300)

    async def one(i: int) -> tuple[int, int, int]:
        want = 1 + i % 17
        stream = await aoai.completions.create(
            model=model,
            prompt=f"Request number {i}: " + "lorem ipsum " * (i % 5),
            max_tokens=want,
            temperature=0.7,
            seed=i,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=EXTRA,
        )
        pieces, usage = 0, None
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                pieces += 1
            if chunk.usage is not None:
                usage = chunk.usage
        return want, usage.completion_tokens, pieces

    async def run() -> list[tuple[int, int, int]]:
        try:
            return await asyncio.gather(*(one(i) for i in range(200)))
        finally:
            await aoai.close()

    results = asyncio.run(run())
    assert all(got == want for want, got, _ in results), [r for r in results if r[0] != r[1]]
    assert all(pieces >= 1 for *_, pieces in results)
    state = wait_idle_and_clean(client)
    assert state["kv_used_tokens"] == 0 and state["running_requests"] == 0 and state["waiting_requests"] == 0
