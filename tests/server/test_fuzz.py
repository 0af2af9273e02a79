"""Fuzzing the published schema against a live server: request bodies generated with hypothesis from the
request schemas /openapi.json publishes, and broken ones made from them (a field set to any JSON value or
an integer past 64 bits, an unknown field, raw bytes, bad UTF-8, deep nesting). No answer may be a 5xx,
nor may a stream end in a 5xx error event; afterwards the server answers a good request, with nothing
left open and its KV cache whole.

Each run draws fresh examples, a bounded number of them (50 an endpoint, a few seconds; GAPLESS_FUZZ_EXAMPLES
raises it for a longer hunt). A failure prints the body that failed; pytest's --hypothesis-seed repeats a
run."""

from __future__ import annotations

import json
import os
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.conftest import wait_idle_and_clean

ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/generate")
EXAMPLES = int(os.environ.get("GAPLESS_FUZZ_EXAMPLES", "50"))

PAST_64_BITS = st.integers(min_value=2**63, max_value=2**80) | st.integers(
    min_value=-(2**80), max_value=-(2**63) - 1
)
JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | PAST_64_BITS
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
RAW_BODIES = st.binary(max_size=64) | st.sampled_from(
    [
        b'{"prompt": "\xff\xfe", "messages": "\xc3"}',
        b"[" * 5_000 + b"]" * 5_000,
        b'{"prompt": ' + b"[" * 50_000 + b"1" + b"]" * 50_000 + b"}",
        b'{"prompt": "\\ud800", "text": "\\udfff"}',  # lone surrogates
        b'{"prompt": "x", "max_tokens": 1e999}',
        b'{"prompt": "x", "max_tokens": -0}',
    ]
)


def from_schema(schema: dict[str, Any], root: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Values that match `schema`, in the JSON Schema subset msgspec writes ($ref into `root`, anyOf,
    enum, typed values with integer bounds, objects with properties or additionalProperties, arrays)."""
    if "$ref" in schema:
        target = root
        for part in schema["$ref"].removeprefix("#/").split("/"):
            target = target[part]
        return st.deferred(lambda: from_schema(target, root))
    if "anyOf" in schema:
        return st.one_of([from_schema(s, root) for s in schema["anyOf"]])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if kind == "object" and "properties" in schema:
        fields = {k: from_schema(v, root) for k, v in schema["properties"].items()}
        required = set(schema.get("required", ()))
        return st.fixed_dictionaries(
            {k: v for k, v in fields.items() if k in required},
            optional={k: v for k, v in fields.items() if k not in required},
        )
    if kind == "object":
        values = from_schema(schema.get("additionalProperties", {}), root)
        return st.dictionaries(st.text(max_size=8), values, max_size=3)
    if kind == "array":
        return st.lists(from_schema(schema.get("items", {}), root), max_size=4)
    simple = {
        "string": st.text(max_size=40),
        "integer": st.integers(schema.get("minimum"), schema.get("maximum")),
        "number": st.floats(allow_nan=False, allow_infinity=False),
        "boolean": st.booleans(),
        "null": st.none(),
    }
    return simple.get(kind, JSON_VALUES)  # no type: any JSON value


@pytest.fixture(scope="module")
def request_schemas(client) -> dict[str, dict[str, Any]]:
    """Each generation endpoint's request schema as /openapi.json publishes it, refs resolvable."""
    doc = client.get("/openapi.json").json()
    out = {}
    for path in ENDPOINTS:
        ref = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        out[path] = {"$ref": ref, "components": doc["components"]}
    return out


def _tame(path: str, body: Any) -> Any:
    """Keep a valid request cheap to serve: a few tokens and choices (the schema allows 2^63 of each)."""
    if not isinstance(body, dict):
        return body
    if path == "/generate":
        params = body.get("sampling_params")
        for key in ("max_tokens", "max_new_tokens"):
            if isinstance(params, dict) and isinstance(params.get(key), int) and params[key] > 4:
                params[key] = 4
        return body
    if not isinstance(body.get("max_tokens"), int) or body["max_tokens"] > 4:
        body["max_tokens"] = 4
    if isinstance(body.get("max_completion_tokens"), int) and body["max_completion_tokens"] > 4:
        body["max_completion_tokens"] = 4
    if isinstance(body.get("n"), int) and body["n"] > 2:
        body["n"] = 2
    return body


def _with(body: Any, key: str, value: Any) -> Any:
    return {**body, key: value} if isinstance(body, dict) else body


def _cases(path: str, schema: dict[str, Any]) -> st.SearchStrategy[bytes]:
    """Bodies for `path`: valid ones, ones with a field set to anything, and raw bytes."""
    name = schema["$ref"].rsplit("/", 1)[-1]
    fields = sorted(schema["components"]["schemas"][name]["properties"])
    valid = from_schema(schema, schema).map(lambda b: _tame(path, b))
    changed = st.builds(
        _with, valid, st.sampled_from(fields) | st.text(max_size=12), JSON_VALUES | PAST_64_BITS
    )
    return (valid | changed).map(lambda b: json.dumps(b).encode()) | RAW_BODIES


def _post(client: httpx.Client, path: str, body: bytes) -> tuple[int, str]:
    """The status, and for a stream its events; a stream's error event counts as its status."""
    with client.stream("POST", path, content=body, headers={"content-type": "application/json"}) as r:
        text = r.read().decode()
    status = r.status_code
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        for line in text.splitlines():
            if line.startswith("data: {") and '"error"' in line:
                status = max(status, json.loads(line[6:])["error"]["code"] or 0)
    return status, text


@pytest.mark.parametrize("path", ENDPOINTS)
def test_no_request_the_schema_or_a_fuzzer_makes_gets_a_5xx(client, request_schemas, path):
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(_cases(path, request_schemas[path]))
    def check(body: bytes) -> None:
        status, text = _post(client, path, body)
        assert status < 500, f"{status} for {body[:300]!r}: {text[:500]}"

    check()
    state = wait_idle_and_clean(client)
    assert state["api_open_requests"] == 0 and state["kv_used_tokens"] == 0
    r = client.post("/v1/completions", json={"prompt": "still here?", "max_tokens": 2})
    assert r.status_code == 200, r.text
