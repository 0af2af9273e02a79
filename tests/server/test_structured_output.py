"""Structured output, logit_bias and min_tokens through a live server, driven with the `openai` client:
`response_format` and vLLM's `guided_*` on both OpenAI endpoints, SGLang's fields on `/generate`, every
refusal a 400 naming its field and followed by a good request."""

from __future__ import annotations

import concurrent.futures as cf
import json
import re

import jsonschema
import openai
import pytest

from tests.server.conftest import API_KEY, wait_idle_and_clean
from tests.server.test_errors import error_of, good

SCHEMA = {
    "type": "object",
    "properties": {
        "n": {"type": "integer", "minimum": 0, "maximum": 9},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 2},
        "inner": {
            "type": "object",
            "properties": {"w": {"type": "string", "maxLength": 4}},
            "required": ["w"],
            "additionalProperties": False,
        },
    },
    "required": ["n", "tags", "inner"],
    "additionalProperties": False,
}
SAMPLE = {"temperature": 1.0, "max_tokens": 60}


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def model(oai):
    return oai.models.list().data[0].id


def test_chat_response_format_json_schema(oai, model, client):
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}
    msgs = [{"role": "user", "content": "give me a thing"}]
    for seed in range(2):
        r = oai.chat.completions.create(model=model, messages=msgs, response_format=fmt, seed=seed, **SAMPLE)
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    stream = oai.chat.completions.create(
        model=model, messages=msgs, response_format=fmt, seed=0, stream=True, **SAMPLE
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    again = oai.chat.completions.create(model=model, messages=msgs, response_format=fmt, seed=0, **SAMPLE)
    assert streamed == again.choices[0].message.content
    jsonschema.validate(json.loads(streamed), SCHEMA)
    wait_idle_and_clean(client)


@pytest.mark.parametrize(
    ("extra", "valid"),
    [
        ({"guided_regex": r"[xyz]{2}\d"}, lambda t: re.fullmatch(r"[xyz]{2}\d", t)),
        ({"guided_choice": ["left", "right"]}, lambda t: t in ("left", "right")),
        ({"guided_grammar": 'root ::= "<" [0-9]+ ">"'}, lambda t: re.fullmatch(r"<[0-9]+>", t)),
        ({"guided_json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}}, None),
    ],
)
def test_completions_guided_fields(oai, model, extra, valid):
    valid = valid or (lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None)
    r = oai.completions.create(model=model, prompt="hello", seed=1, extra_body=extra, **SAMPLE)
    for c in r.choices:
        assert c.finish_reason == "stop" and valid(c.text), c.text


def test_mixed_constrained_and_free_requests(oai, model):
    """A free request's greedy tokens are the same while constrained ones share its batches."""
    free = {
        "model": model,
        "prompt": "free text",
        "max_tokens": 12,
        "temperature": 0.0,
        "extra_body": {"ignore_eos": True},
    }
    alone = oai.completions.create(**free).choices[0].text
    with cf.ThreadPoolExecutor(6) as pool:
        cons = [
            pool.submit(
                oai.completions.create,
                model=model,
                prompt="x",
                seed=i,
                extra_body={"guided_json": SCHEMA},
                **SAMPLE,
            )
            for i in range(3)
        ]
        mixed = pool.submit(oai.completions.create, **free)
        assert mixed.result().choices[0].text == alone
        for f in cons:
            jsonschema.validate(json.loads(f.result().choices[0].text), SCHEMA)


def test_generate_sglang_fields(client):
    for sp, check in (
        ({"json_schema": json.dumps(SCHEMA)}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
        ({"regex": "(cat|dog)s?"}, lambda t: re.fullmatch("(cat|dog)s?", t)),
        ({"ebnf": 'root ::= "yes" | "no"'}, lambda t: t in ("yes", "no")),
    ):
        r = client.post("/generate", json={"text": "hi", "sampling_params": {**sp, "max_new_tokens": 60}})
        assert r.status_code == 200, r.text
        assert check(r.json()["text"]), r.json()["text"]


def test_logit_bias_and_min_tokens(oai, model, client):
    # +100 on one token: greedy decoding can pick nothing else
    r = oai.completions.create(
        model=model,
        prompt="hi",
        max_tokens=5,
        temperature=0.0,
        logit_bias={"321": 100},
        extra_body={"ignore_eos": True},
    )
    ids = client.post(
        "/generate",
        json={
            "text": "hi",
            "sampling_params": {
                "max_new_tokens": 5,
                "temperature": 0.0,
                "ignore_eos": True,
                "logit_bias": {"321": 100},
            },
        },
    ).json()
    assert ids["output_ids"] == [321] * 5, ids
    assert r.usage.completion_tokens == 5
    # a stop token that would end the reply at once is held back until min_tokens
    first = ids_of(client, {"max_new_tokens": 1, "temperature": 0.0})[0]
    held = ids_of(
        client, {"max_new_tokens": 8, "temperature": 0.0, "stop_token_ids": [first], "min_tokens": 4}
    )
    assert len(held) >= 4 and first not in held[:4]


def ids_of(client, sp: dict) -> list[int]:
    r = client.post("/generate", json={"text": "hi", "sampling_params": sp})
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


BAD = [
    ("/v1/chat/completions", {"response_format": {"type": "xml"}}, "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    (
        "/v1/chat/completions",
        {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}},
        "response_format",
    ),
    ("/v1/completions", {"guided_regex": "a("}, "guided_regex"),
    ("/v1/completions", {"guided_grammar": "root ::= missing"}, "guided_grammar"),
    ("/v1/completions", {"guided_json": "{not json"}, "guided_json"),
    ("/v1/completions", {"guided_choice": []}, "guided_choice"),
    ("/v1/completions", {"guided_regex": "a", "guided_choice": ["a"]}, "guided_regex"),
    ("/v1/completions", {"logit_bias": {"100000000": 1}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"word": 1}}, "logit_bias"),
    ("/v1/completions", {"min_tokens": 50, "max_tokens": 4}, "min_tokens"),
    ("/generate", {"regex": "(("}, "regex"),
    ("/generate", {"json_schema": {"type": 5}}, "json_schema"),
]


@pytest.mark.parametrize(("path", "fields", "param"), BAD)
def test_refusals_name_the_field(client, model, path, fields, param):
    if path == "/generate":
        body = {"text": "hi", "sampling_params": fields}
    elif path == "/v1/completions":
        body = {"model": model, "prompt": "hi", "max_tokens": 4, **fields}
    else:
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}], **fields}
    err = error_of(client.post(path, json=body), 400)
    assert err["param"] == param, err
    good(client, model)
