"""Tool calling and reasoning: `tool_choice` required and named through the `openai` client on the
random model (only the grammar makes the arguments valid), a scripted model that thinks and then writes a
Hermes-style call (`--tool-call-parser hermes --reasoning-parser qwen3`, `auto`, streamed and not), the
four parsers and both reasoning parsers on text, tool messages through the chat template, and the
refusals."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from gapless.default_model.tokenizer import build_tokenizer
from gapless.server import protocol as P
from gapless.server.reasoning import split_reasoning
from gapless.server.tools import ToolPlan, parse_tool_calls
from gapless.server.workers.tokenizer import PromptTokenizer
from gapless.testing.scripted import _byte_to_unicode, make_scripted_checkpoint
from gapless.testing.server import ServerProcess
from tests.server.conftest import API_KEY
from tests.server.test_errors import error_of, good

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 8},
                "unit": {"enum": ["c", "f"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "unit", "days"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["utc", "cet"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}
MSGS = [{"role": "user", "content": "weather?"}]


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def model(oai):
    return oai.models.list().data[0].id


def check_calls(calls, names=None) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert names is None or call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_tool_choice_required_and_named(oai, model):
    tools = [WEATHER, CLOCK]
    for seed in range(2):
        r = oai.chat.completions.create(
            model=model,
            messages=MSGS,
            tools=tools,
            tool_choice="required",
            seed=seed,
            temperature=1.0,
            max_tokens=80,
            parallel_tool_calls=False,
        )
        assert r.choices[0].finish_reason == "tool_calls"
        assert len(r.choices[0].message.tool_calls) == 1
        check_calls(r.choices[0].message.tool_calls)
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = oai.chat.completions.create(
        model=model, messages=MSGS, tools=tools, tool_choice=named, seed=3, temperature=1.0, max_tokens=60
    )
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content is None
    check_calls(r.choices[0].message.tool_calls, {"get_weather"})
    stream = oai.chat.completions.create(
        model=model,
        messages=MSGS,
        tools=tools,
        tool_choice=named,
        seed=3,
        temperature=1.0,
        max_tokens=60,
        stream=True,
    )
    deltas = [c.choices[0] for c in stream if c.choices]
    calls = [tc for d in deltas for tc in (d.delta.tool_calls or [])]
    assert len(calls) == 1 and deltas[-1].finish_reason == "stop"
    assert calls[0].function.arguments == r.choices[0].message.tool_calls[0].function.arguments


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice"),  # this server has no parser
        ({"tools": [WEATHER]}, "tool_choice"),  # auto is the default with tools
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "retrieval"}], "tool_choice": "required"}, "tools[0]"),
        (
            {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
        ),
    ],
)
def test_tool_refusals(client, model, fields, param):
    body = {"model": model, "messages": MSGS, "max_tokens": 4, **fields}
    assert error_of(client.post("/v1/chat/completions", json=body), 400)["param"] == param
    good(client, model)


def test_tool_messages_reach_the_chat_template(ckpt_factory):
    tok = AutoTokenizer.from_pretrained(str(ckpt_factory("qwen3")))
    tok.chat_template = (
        "{% for t in tools %}[tool {{ t.function.name }}]{% endfor %}"
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
        "{% for c in m.tool_calls or [] %}(call {{ c.function.name }} {{ c.function.arguments.city }})"
        "{% endfor %}{% if m.tool_call_id is defined %}(result of {{ m.tool_call_id }}){% endif %}"
        "{% endfor %}"
    )
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
    }
    msgs = [
        P.ChatMessage("user", "weather?"),
        P.ChatMessage("assistant", "", tool_calls=[call]),
        P.ChatMessage("tool", "12C", tool_call_id="call_1"),
    ]
    text = PromptTokenizer(tok)._render(msgs, {"tools": [WEATHER]})
    assert text == (
        "[tool get_weather]<user>weather?<assistant>(call get_weather Oslo)<tool>12C(result of call_1)"
    )


# the scripted model's reply, one token each: filler tokens of a larger vocabulary, their text rewritten
SCRIPT = [
    "<think>",
    "Look it up.",
    "</think>",
    "\n\n",
    "<tool_call>",
    '\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c", "days": 2}}\n',
    "</tool_call>",
]


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory):
    """A scripted model that thinks, then calls get_weather Hermes-style, served with both parsers."""
    tok = build_tokenizer()
    header = tok.apply_chat_template(MSGS, add_generation_prompt=True, tokenize=False)
    chat_end = tok.encode(header, add_special_tokens=False)[-1]
    ids = list(range(len(tok), len(tok) + len(SCRIPT)))
    chain = [chat_end, *ids]
    path = make_scripted_checkpoint(
        tmp_path_factory.mktemp("tools"), dict(zip(chain[:-1], chain[1:])), vocab_size=len(tok) + 8
    )
    spec = json.loads((path / "tokenizer.json").read_text())
    table = _byte_to_unicode()
    vocab = spec["model"]["vocab"]
    by_id = {i: s for s, i in vocab.items()}
    for i, piece in zip(ids, SCRIPT):
        del vocab[by_id[i]]
        vocab["".join(table[b] for b in piece.encode())] = i
    (path / "tokenizer.json").write_text(json.dumps(spec))
    srv = ServerProcess(
        "--device", "cpu", "--model", str(path), "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"
    )
    yield srv
    assert srv.stop() == 0, srv.output


def test_hermes_auto_tool_call_with_reasoning(tool_server):
    oai = openai.OpenAI(base_url=f"{tool_server.url}/v1", api_key="x", max_retries=0)
    args = {"model": oai.models.list().data[0].id, "messages": MSGS, "tools": [WEATHER], "max_tokens": 20}
    r = oai.chat.completions.create(**args, temperature=0.0)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    assert msg.reasoning_content == "Look it up." and msg.content is None
    (call,) = msg.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "c", "days": 2}
    stream = list(oai.chat.completions.create(**args, temperature=0.0, stream=True))
    deltas = [c.choices[0] for c in stream if c.choices]
    assert "".join(getattr(d.delta, "reasoning_content", None) or "" for d in deltas) == "Look it up."
    assert "".join(d.delta.content or "" for d in deltas) == ""
    calls = [tc for d in deltas for tc in (d.delta.tool_calls or [])]
    assert [(c.index, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        (0, "get_weather", {"city": "Paris", "unit": "c", "days": 2})
    ]
    assert deltas[-1].finish_reason == "tool_calls"
    # tool_choice none: the same text, as content (the reasoning still split off)
    r = oai.chat.completions.create(**args, tool_choice="none", temperature=0.0)
    assert r.choices[0].message.tool_calls is None and "<tool_call>" in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"


CALL = {"name": "f", "arguments": {"a": 1}}


@pytest.mark.parametrize(
    ("parser", "text", "content", "calls"),
    [
        ("hermes", f"Sure.<tool_call>{json.dumps(CALL)}</tool_call>", "Sure.", [("f", {"a": 1})]),
        (
            "qwen",
            f"<tool_call>\n{json.dumps(CALL)}\n</tool_call>\n<tool_call>{json.dumps(CALL)}",
            "",
            [("f", {"a": 1})] * 2,
        ),
        ("hermes", "<tool_call>{broken", "<tool_call>{broken", []),
        (
            "llama3",
            '<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}',
            "",
            [("f", {"a": 1}), ("g", {})],
        ),
        ("llama3", "just text", "just text", []),
        ("mistral", f"ok [TOOL_CALLS] [{json.dumps(CALL)}]", "ok ", [("f", {"a": 1})]),
        ("mistral", "[TOOL_CALLS] not json", "[TOOL_CALLS] not json", []),
    ],
)
def test_parsers(parser, text, content, calls):
    got_content, got = parse_tool_calls(parser, text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls


def test_parallel_tool_calls_false_keeps_the_first_auto_call():
    text = f"<tool_call>{json.dumps(CALL)}</tool_call><tool_call>{json.dumps(CALL)}</tool_call>"
    assert len(ToolPlan("auto", [WEATHER], parser="hermes").calls(text)[1]) == 2
    assert len(ToolPlan("auto", [WEATHER], parser="hermes", parallel=False).calls(text)[1]) == 1


def test_streamed_prefix_holds_back_a_marker():
    plan = ToolPlan("auto", [WEATHER], parser="hermes")
    assert plan.streamed_prefix("Hello <tool") == "Hello "
    assert plan.streamed_prefix("Hello <tool_call>{") == "Hello "
    assert plan.streamed_prefix("Hello there") == "Hello there"


@pytest.mark.parametrize(
    ("parser", "text", "expected"),
    [
        ("qwen3", "<think>hmm</think>\n\nhi", ("hmm", "hi")),
        ("qwen3", "hi there", ("", "hi there")),
        ("qwen3", "<think>still thinking", ("still thinking", "")),
        ("deepseek-r1", "hmm</think>hi", ("hmm", "hi")),
        ("deepseek-r1", "all reasoning", ("all reasoning", "")),
    ],
)
def test_reasoning_parsers(parser, text, expected):
    assert split_reasoning(parser, text) == expected
    for cut in range(len(text)):  # what streams is a prefix of the final split
        r, c = split_reasoning(parser, text[:cut], final=False)
        assert expected[0].startswith(r) and expected[1].startswith(c), (text[:cut], r, c)


def test_grammar_applies_after_the_reasoning(tool_server):
    """With a reasoning parser the constraint waits for `</think>`: the scripted thinking is untouched, the
    answer after it is one of the choices (the script's own continuation is not)."""
    oai = openai.OpenAI(base_url=f"{tool_server.url}/v1", api_key="x", max_retries=0)
    r = oai.chat.completions.create(
        model=oai.models.list().data[0].id,
        messages=MSGS,
        max_tokens=20,
        temperature=0.0,
        extra_body={"guided_choice": ["sunny", "rainy"]},
    )
    msg = r.choices[0].message
    assert msg.reasoning_content == "Look it up." and msg.content in ("sunny", "rainy")


def test_tool_calls_past_64_bits_are_400(client, model):
    """(found by the fuzzer) an assistant's tool_calls holding an integer msgpack cannot carry"""
    msgs = [{"role": "assistant", "tool_calls": [{"": -(2**63) - 1}]}]
    body = {"model": model, "messages": msgs, "max_tokens": 4}
    assert error_of(client.post("/v1/chat/completions", json=body), 400)["param"] == "messages[0].tool_calls"
    good(client, model)
