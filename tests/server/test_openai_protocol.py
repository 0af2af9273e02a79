"""`parse_request`, the one place a request body is checked and turned into engine requests, without a
server: what each endpoint's body becomes, and which error wins when a body has several."""

from __future__ import annotations

import json
import logging

import pytest

from gapless.sampling_params import SamplingParams
from gapless.server.errors import BadRequest
from gapless.server.health import Health
from gapless.server.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    parse_request,
)
from gapless.server.protocol import ChatMessage
from gapless.server.served_model import RUN_TO_CONTEXT_END, ServedModel

SERVED = ServedModel.of_checkpoint("tiny", "/models/tiny", vocab_size=1000, max_context=64)


def parse(kind, served=SERVED, **body):
    req, sub = parse_request(json.dumps(body).encode(), kind, served)
    return req, sub.engine_requests()


def refusal(kind, body: bytes | dict, served=SERVED) -> BadRequest:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with pytest.raises(BadRequest) as e:
        parse_request(raw, kind, served)
    return e.value


def test_completion_becomes_one_request_per_prompt_and_choice_with_seeds_apart():
    req, engine = parse(CompletionRequest, model="tiny", prompt=["a", [5, 6]], n=2, seed=7, max_tokens=3)
    assert req.n == 2
    assert [p for p, _ in engine] == ["a", "a", [5, 6], [5, 6]]
    assert [sp.seed for _, sp in engine] == [7, 8, 7, 8]
    assert all(sp.max_tokens == 3 for _, sp in engine)


def test_chat_becomes_messages_and_defaults_run_to_the_context_end():
    content = [{"type": "text", "text": "hi"}, {"type": "text", "text": " there"}]
    _, engine = parse(
        ChatCompletionRequest, model="/models/tiny", messages=[{"role": "user", "content": content}]
    )
    [(prompt, params)] = engine
    assert prompt == [ChatMessage("user", "hi there")]
    assert params.max_tokens == RUN_TO_CONTEXT_END and params.logprobs is None


def test_generate_takes_sampling_params_names_and_needs_no_model():
    _, engine = parse(GenerateRequest, input_ids=[[1, 2], [3]], sampling_params={"max_new_tokens": 4})
    assert engine == [([1, 2], SamplingParams(max_tokens=4)), ([3], SamplingParams(max_tokens=4))]


def test_errors_come_in_order_json_then_shape_then_model_then_values():
    assert refusal(CompletionRequest, b"{").status == 422
    shape = refusal(CompletionRequest, {"model": "nope", "prompt": "x", "max_tokens": "many"})
    assert (shape.status, shape.param) == (400, "max_tokens")
    model = refusal(CompletionRequest, {"model": "nope", "prompt": [], "suffix": "x"})
    assert (model.status, model.param) == (404, "model")
    # values: the unsupported options and sampling values before the prompt
    value = refusal(CompletionRequest, {"model": "tiny", "prompt": [], "suffix": "x"})
    assert (value.status, value.param) == (400, "suffix")
    assert (
        refusal(CompletionRequest, {"model": "tiny", "prompt": [], "temperature": -1}).param == "temperature"
    )
    assert refusal(CompletionRequest, {"model": "tiny", "prompt": []}).param == "prompt"
    assert refusal(GenerateRequest, {"text": "", "sampling_params": {"bogus": 1}}).param == "sampling_params"


def test_health_fails_once_and_tells_its_listeners_in_order():
    health, heard = Health(), []
    health.on_fatal(lambda why: heard.append(("first", why)))
    health.on_fatal(lambda why: heard.append(("second", why)))
    health.fail("worker died")
    health.fail("and again")
    assert health.fatal == "worker died"
    assert heard == [("first", "worker died"), ("second", "worker died")]


def test_a_request_without_a_limit_gets_the_server_default_and_openai_defaults_stay():
    served = ServedModel.of_checkpoint("tiny", "/models/tiny", 1000, 64, max_tokens_default=7)
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    cases = [
        (ChatCompletionRequest, chat, 7),
        (ChatCompletionRequest, {**chat, "max_tokens": 3}, 3),
        (CompletionRequest, {"prompt": "x", "max_tokens": None}, 7),
        (CompletionRequest, {"prompt": "x"}, 16),  # OpenAI's default for completions
        (GenerateRequest, {"text": "x"}, 16),  # SamplingParams' default
    ]
    for kind, body, want in cases:
        [(_, params)] = parse(kind, served, **body)[1]
        assert params.max_tokens == want, (kind.__name__, body)
    [(_, params)] = parse(ChatCompletionRequest, **chat)[1]
    assert params.max_tokens == RUN_TO_CONTEXT_END


def test_chat_template_kwargs_travel_with_the_chat():
    kwargs = {"enable_thinking": False, "extra": {"nested": [1, 2]}}
    body = {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": kwargs}
    _, sub = parse_request(json.dumps(body).encode(), ChatCompletionRequest, SERVED)
    assert sub.chat_template_kwargs == kwargs


def test_token_ids_are_checked_in_every_prompt_before_anything_else_happens():
    assert refusal(CompletionRequest, {"prompt": [[1], [2, 1000]]}).param == "prompt"  # vocab is 1000
    long = refusal(CompletionRequest, {"prompt": [[1], [1] * 64]})  # the context is 64 tokens
    assert long.param == "prompt" and "at most 63" in str(long)
    assert refusal(GenerateRequest, {"input_ids": [[1], [-1]]}).param == "input_ids"
    _, engine = parse(CompletionRequest, prompt=[[1], [2] * 63], max_tokens=1)
    assert len(engine) == 2


def test_ignored_fields_are_logged_once_at_debug_level(caplog):
    caplog.set_level(logging.DEBUG, logger="gapless.server.request_body")
    for _ in range(3):
        parse(CompletionRequest, prompt="x", frobnicate=1, user_tag_for_test="me")
    logged = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert sum("'frobnicate'" in m for m in logged) == 1, logged
    assert sum("'user_tag_for_test'" in m for m in logged) == 1, logged
