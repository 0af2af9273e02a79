"""Tool calling for chat completions: `tools`, `tool_choice`, `parallel_tool_calls`, and the parsers that
turn a model's text into OpenAI `tool_calls` (`--tool-call-parser`, vLLM's names).

`tool_choice`:
- `none`: the tools reach the chat template, the reply is text.
- `auto` (the default when tools are given): the reply is parsed with the server's tool-call parser;
  without one it is refused (400), as vLLM does.
- `required`, or a named function: a grammar makes the reply a JSON list of `{"name", "parameters"}`
  calls of the given tools (one with `parallel_tool_calls: false`), or the named function's arguments,
  each validating against the function's parameter schema; the reply is then those calls, whatever
  the parser. `parallel_tool_calls: false` allows one call (with `auto`, the first one parsed).

Parsers (each split the text into content and calls, never raise: text they cannot parse stays content):
- `hermes`, `qwen`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (the closing tag may
  be cut off by EOS), as Hermes 2 Pro, Qwen 2.5 and Qwen 3 write them.
- `llama3`: the reply is one JSON object `{"name": ..., "parameters": {...}}`, or several joined by `;`,
  optionally after `<|python_tag|>`.
- `mistral`: `[TOOL_CALLS]` followed by a JSON list of `{"name", "arguments"}` objects.

Streaming: text before a call's start marker streams as content; from the marker on it is held back and
sent, parsed, as `tool_calls` deltas when the choice ends (each call whole in one delta).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

PARSERS = ("hermes", "llama3", "mistral", "qwen")
# vLLM's and SGLang's names for these parsers (`--tool-call-parser` takes them too)
PARSER_ALIASES = {"llama3_json": "llama3", "qwen25": "qwen"}
_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
_START = {"hermes": "<tool_call>", "qwen": "<tool_call>", "mistral": "[TOOL_CALLS]"}


class ToolError(ValueError):
    """A tools field that cannot be honoured; `param` names it."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_json(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return out if index is None else {"index": index, **out}


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools mean for its generation and for its answer."""

    mode: str  # "none", "auto", "required", "named"
    tools: list[dict[str, Any]]  # for the chat template
    parser: str | None = None  # auto: the server's parser
    name: str | None = None  # named: the function
    schema: dict[str, Any] | None = None  # required, named: the JSON schema the reply must follow
    parallel: bool = True  # parallel_tool_calls: false keeps auto's first call only

    def calls(self, text: str) -> tuple[str, list[ToolCall]]:
        """The reply `text` as (content, tool calls)."""
        if self.mode == "named":
            return "", [ToolCall(self.name or "", _compact(text))]
        if self.mode == "required":
            try:
                items = json.loads(text)
            except json.JSONDecodeError:  # cut off by max_tokens: no call to report
                return text, []
            return "", [ToolCall(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in items]
        if self.mode == "auto" and self.parser is not None:
            content, calls = parse_tool_calls(self.parser, text)
            return content, calls if self.parallel else calls[:1]
        return text, []

    def streamed_prefix(self, text: str) -> str:
        """The part of `text` (the reply so far) that is surely content and may stream now."""
        if self.mode in ("required", "named"):
            return ""
        if self.mode != "auto" or self.parser is None:
            return text
        if self.parser == "llama3":
            stripped = text.lstrip()
            return "" if not stripped or stripped[0] in "{<" else text
        marker = _START[self.parser]
        at = text.find(marker)
        if at >= 0:
            return text[:at]
        # a marker may be arriving: hold back a tail that could start it
        for k in range(min(len(marker) - 1, len(text)), 0, -1):
            if marker.startswith(text[-k:]):
                return text[:-k]
        return text


def _compact(text: str) -> str:
    try:
        return json.dumps(json.loads(text), ensure_ascii=False)
    except json.JSONDecodeError:
        return text


def _call(obj: Any, args_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


def parse_tool_calls(parser: str, text: str) -> tuple[str, list[ToolCall]]:
    """`text` as (content, calls) by `parser`'s convention; unparsable text stays content."""
    if parser in ("hermes", "qwen"):
        calls = []
        for block in _HERMES.findall(text):
            try:
                call = _call(json.loads(block), "arguments")
            except json.JSONDecodeError:
                call = None
            if call is None:
                return text, []
            calls.append(call)
        start = text.find("<tool_call>")
        return (text if not calls else text[:start]), calls
    if parser == "mistral":
        start = text.find("[TOOL_CALLS]")
        if start < 0:
            return text, []
        try:
            items = json.loads(text[start + len("[TOOL_CALLS]") :])
        except json.JSONDecodeError:
            return text, []
        return _all_or_none(text, text[:start], [_call(c, "arguments") for c in _as_list(items)])
    body = text.strip().removeprefix("<|python_tag|>").strip()  # llama3
    if not body.startswith("{"):
        return text, []
    try:
        parsed = [_call(json.loads(part), "parameters") for part in body.split(";")]
    except json.JSONDecodeError:
        return text, []
    return _all_or_none(text, "", parsed)


def _as_list(items: Any) -> list[Any]:
    return items if isinstance(items, list) else [items]


def _all_or_none(text: str, rest: str, calls: list[ToolCall | None]) -> tuple[str, list[ToolCall]]:
    """`rest` and the calls when every one parsed; else the text as it was and no call."""
    found = [c for c in calls if c is not None]
    return (rest, found) if len(found) == len(calls) else (text, [])


def _functions(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The tools' functions by name, each checked."""
    out = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function")
        if tool.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ToolError(
                f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}", f"tools[{i}]"
            )
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise ToolError(
                f"tools[{i}].function.parameters must be a JSON schema", f"tools[{i}].function.parameters"
            )
        out[fn["name"]] = params
    return out


def plan_tools(
    tools: list[dict[str, Any]] | None, tool_choice: Any, parallel: bool | None, parser: str | None
) -> ToolPlan | None:
    """The `ToolPlan` of a request's tool fields (None: no tools), or ToolError naming the field."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise ToolError("tool_choice needs tools", "tool_choice")
        return None
    functions = _functions(tools)
    choice = tool_choice if tool_choice is not None else "auto"
    if choice == "none":
        return ToolPlan("none", tools)
    if choice == "auto":
        if parser is None:
            raise ToolError(
                'tool_choice "auto" needs the server started with --tool-call-parser '
                f'({"|".join(PARSERS)}); or use "required" or a named function',
                "tool_choice",
            )
        return ToolPlan("auto", tools, parser=parser, parallel=parallel is not False)
    if choice == "required":
        call = [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "parameters": schema},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for name, schema in functions.items()
        ]
        array: dict[str, Any] = {"type": "array", "items": {"anyOf": call}, "minItems": 1}
        if parallel is False:
            array["maxItems"] = 1
        return ToolPlan("required", tools, schema=array)
    if (
        isinstance(choice, dict)
        and choice.get("type") == "function"
        and isinstance(choice.get("function"), dict)
    ):
        name = choice["function"].get("name")
        if name not in functions:
            raise ToolError(f"tool_choice names the function {name!r}, which is not in tools", "tool_choice")
        return ToolPlan("named", tools, name=name, schema=functions[name])
    raise ToolError(
        'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
        "tool_choice",
    )


def template_message(msg: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI chat message as chat templates take it: an assistant's tool-call arguments as objects
    (templates write them with `tojson`), a tool result with its `tool_call_id`; unset fields left out."""
    out = {k: v for k, v in msg.items() if v is not None}
    calls = []
    for call in out.get("tool_calls") or ():
        call = dict(call)
        fn = dict(call.get("function") or {})
        if isinstance(fn.get("arguments"), str):
            try:
                fn["arguments"] = json.loads(fn["arguments"])
            except json.JSONDecodeError:
                pass
        call["function"] = fn
        calls.append(call)
    if calls:
        out["tool_calls"] = calls
    return out
