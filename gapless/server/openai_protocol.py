"""HTTP request bodies (OpenAI's, with the vLLM/SGLang extensions), their validation and conversion to
engine requests. What they are checked against is `served_model.ServedModel`; a refusal is an
`errors.BadRequest`.

`parse_request` is the one place a body becomes engine requests, and it checks everything it can before
anything is submitted: msgspec decodes the body straight into these structs (a body that is not JSON, not
UTF-8 or nested too deeply is a 422; a field of the wrong type, or an integer outside 64 bits, a 400
naming the field), the model name is checked (404), and the struct's `submission` checks the values (a
400 naming the field), every prompt of a multi-prompt request included (token ids against the vocabulary
and the context). Text prompts are measured once tokenized, by the tokenizer worker, which refuses the
whole request if any prompt is too long, before any of it reaches the scheduler.

Unknown fields are ignored, as OpenAI's clients send ones we have no use for (`user`, ...), and logged once
each at debug level; fields we know but cannot honour are refused by name rather than silently ignored.
The structs are also the one source of the published OpenAPI schema (`routes/schema.py`).
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Annotated, Any, Literal, TypeGuard, TypeVar, Union

import msgspec

from gapless.sampling_params import STRUCTURED_FIELDS, SamplingParams
from gapless.server.errors import BadRequest, prompt_too_long
from gapless.server.images import check_image_count, check_image_url
from gapless.server.protocol import ChatMessage, ImageChat, LoRAIn
from gapless.server.reasoning import END as THINK_END
from gapless.server.request_body import decode_body, log_ignored_fields
from gapless.server.served_model import ServedModel
from gapless.server.structured import StructuredError, check_compiles, structured_fields
from gapless.server.tools import ToolError, ToolPlan, plan_tools

MAX_N = 128  # choices per prompt

# Every integer a request carries must fit in 64 bits: the wire between the processes (msgpack) and the
# sampler (int64 tensors) carry no more. Bounding them here makes a larger one a 400 naming its field.
Int64 = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
Choices = Annotated[int, msgspec.Meta(ge=1, le=MAX_N)]

# text, token ids, or a chat to render with the template (with images: a vision-language model's)
Prompt = str | list[int] | list[ChatMessage] | ImageChat
EngineRequest = tuple[Prompt, SamplingParams]  # one prompt and choice


@dataclass(frozen=True)
class Submission:
    """A checked request's work for the engine: its prompts and, per choice, the sampling params. Engine
    request i * n + j is prompt i's choice j, sampled with `choices[j]` (n = len(choices)): the order in
    which the responses list their choices."""

    prompts: list[Prompt]
    choices: list[SamplingParams]
    chat_template_kwargs: dict[str, Any] | None = None
    lora: LoRAIn | None = None  # the LoRA adapter the request's `model` names; None: the base model

    def engine_requests(self) -> list[EngineRequest]:
        return [(prompt, params) for prompt in self.prompts for params in self.choices]


def _choices(params: SamplingParams, n: int) -> list[SamplingParams]:
    """The params of each of n choices. With a seed, choice j samples with seed + j: repeatable across
    requests, and the n choices still differ."""
    if params.seed is None:
        return [params] * n
    return [replace(params, seed=params.seed + j) if j else params for j in range(n)]


def _is_ids(x: object) -> TypeGuard[list[int]]:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def _check_ids(ids: list[int], param: str, served: ServedModel) -> None:
    """Token ids the scheduler would take: not longer than the context allows, each in the vocabulary."""
    if len(ids) > served.max_prompt_tokens:
        raise BadRequest(prompt_too_long(len(ids), served.max_prompt_tokens), param)
    bad = next((t for t in ids if not 0 <= t < served.vocab_size), None)
    if bad is not None:
        raise BadRequest(f"{param} token id {bad} is outside the vocabulary [0, {served.vocab_size})", param)


def prompt_list(p: object, param: str, served: ServedModel, text: bool = True) -> list[Prompt]:
    """One prompt or a list of them: strings (if `text`) or token-id lists; each non-empty, and token
    ids checked against the vocabulary and the context."""
    prompts: list[str | list[int]]
    if isinstance(p, str) and text:
        prompts = [p]
    elif _is_ids(p) and p:
        prompts = [p]
    elif isinstance(p, list) and p and all((isinstance(x, str) and text) or _is_ids(x) for x in p):
        prompts = list(p)
    else:
        what = "a string, a list of token ids, or a list of either" if text else "token ids or a list of them"
        raise BadRequest(f"{param} must be {what} (non-empty)", param)
    for prompt in prompts:
        if len(prompt) == 0:
            raise BadRequest(f"{param} contains an empty prompt", param)
        if isinstance(prompt, list):
            _check_ids(prompt, param, served)
    return list(prompts)


def _sampling_params(fields: dict[str, Any], structured_source: str | None = None) -> SamplingParams:
    """`SamplingParams(**fields)`, its refusal of a value a 400 naming the field (the request's own
    structured-output field where a constraint came from one)."""
    try:
        return SamplingParams(**fields)
    except ValueError as e:
        param = str(e).split(" ", 1)[0]
        if structured_source is not None and param in STRUCTURED_FIELDS:
            raise BadRequest(f"{structured_source}: {e}", structured_source) from None
        raise BadRequest(str(e), param) from None


def _check_engine_side(params: SamplingParams, structured_source: str | None, served: ServedModel) -> None:
    """What the engine would refuse, refused here with a 400 naming the field: a constraint that cannot be
    compiled, a logit_bias token outside the vocabulary."""
    try:
        check_compiles(params, structured_source)
    except StructuredError as e:
        raise BadRequest(str(e), e.param) from None
    bad = [t for t in params.logit_bias or () if t >= served.vocab_size]
    if bad:
        raise BadRequest(
            f"logit_bias token id {bad[0]} is outside the vocabulary [0, {served.vocab_size})", "logit_bias"
        )


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class _Sampling(msgspec.Struct, kw_only=True):
    """Fields common to the OpenAI endpoints."""

    model: str | None = None  # the served model when left out
    temperature: float | None = None
    top_p: float | None = None
    n: Choices = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: Int64 | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM / SGLang extensions
    top_k: Int64 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[Int64] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    prompt_logprobs: Int64 | None = None  # vLLM's: the prompt's logprobs and the top k (0-20) per position
    min_tokens: Int64 = 0
    # structured output (gapless.server.structured): OpenAI's, and vLLM's guided_* extensions
    response_format: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = None

    def sampling_params(
        self, max_tokens: int, logprobs: int | None, served: ServedModel, tool_constraint: dict | None = None
    ) -> list[SamplingParams]:
        """The params of each choice; `tool_constraint`: the grammar `tool_choice` asks for."""
        if self.stream and self.prompt_logprobs is not None:  # as vLLM: they come with the whole answer
            raise BadRequest("prompt_logprobs is not available when stream is true", "prompt_logprobs")
        fields: dict[str, Any] = {
            "max_tokens": max_tokens,
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids,
            "ignore_eos": self.ignore_eos,
            "seed": self.seed,
            "skip_special_tokens": self.skip_special_tokens,
            "logprobs": logprobs,
            "prompt_logprobs": self.prompt_logprobs,
            "logit_bias": self.logit_bias,
            "min_tokens": self.min_tokens,
        }
        try:
            structured, source = structured_fields(self)
        except StructuredError as e:
            raise BadRequest(str(e), e.param) from None
        if tool_constraint is not None:
            if source is not None:
                raise BadRequest(
                    f'tool_choice "required" or a named function excludes {source}', "tool_choice"
                )
            structured, source = tool_constraint, "tool_choice"
        fields.update(structured)
        if source is not None:
            _fits_the_wire(structured, source)  # (a JSON schema is any JSON)
            fields["grammar_after"] = self.grammar_after(served)
        for name in (
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "repetition_penalty",
            "presence_penalty",
            "frequency_penalty",
        ):
            if getattr(self, name) is not None:
                fields[name] = getattr(self, name)
        params = _sampling_params(fields, source)
        _check_engine_side(params, source, served)
        return _choices(params, self.n)

    def grammar_after(self, served: ServedModel) -> str | None:
        """The text after which a structured-output constraint applies (None: from the first token)."""
        return None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Sampling, kw_only=True):
    """POST /v1/completions."""

    # a string, token ids, or a list of either: any JSON list, checked in `submission` to word the error
    prompt: str | list[Any]
    max_tokens: Int64 | None = 16  # OpenAI's default; null: the server's default (--max-tokens-default)
    logprobs: Int64 | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: Int64 | None = None

    def submission(self, served: ServedModel) -> Submission:
        if self.suffix:
            raise BadRequest("suffix is not supported", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise BadRequest("best_of other than n is not supported", "best_of")
        served.check_logprobs(self.logprobs, "logprobs")
        served.check_logprobs(self.prompt_logprobs, "prompt_logprobs")
        max_tokens = served.default_max_tokens(self.max_tokens)
        if self.scores_only:  # the prompt alone: one token is sampled (the last chunk samples anyway), unsent
            max_tokens = 1
        choices = self.sampling_params(max_tokens, self.logprobs, served)
        if self.echo:
            # the prompt's logprobs come with it, from the same top k (gapless.server.routes.scoring)
            k = max(self.logprobs or 0, self.prompt_logprobs or 0)
            choices = [replace(c, prompt_logprobs=k) for c in choices]
        return Submission(prompt_list(self.prompt, "prompt", served), choices)

    @property
    def scores_only(self) -> bool:
        """`echo` with `max_tokens` 0: the answer is the prompt (and its logprobs), nothing generated."""
        return self.echo and self.max_tokens == 0


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None
    image_url: dict[str, Any] | str | None = None  # {"url": data: or http(s), "detail": accepted, unused}


def _part_text(part: ContentPart, field: str) -> str:
    """A text part's text; a 400 naming `field` for any other part, or one without its text."""
    if part.type != "text":
        raise BadRequest(f"{field}: content of type {part.type!r} is not supported", field)
    if part.text is None:
        raise BadRequest(f"{field}.text is missing: a text content part needs its text", f"{field}.text")
    return part.text


class Message(msgspec.Struct):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's calls, to render with the template
    tool_call_id: str | None = None  # a tool result's call
    name: str | None = None

    def text(self, where: str) -> str:
        """The message's text; `where` (`messages[i]`) names it in errors."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(_part_text(part, f"{where}.content[{j}]") for j, part in enumerate(self.content))

    def parts(
        self, where: str, served: ServedModel, images: list[bytes], fetched: Mapping[str, bytes] | None
    ) -> list[dict[str, str]]:
        """A message with images: its text and image parts in order, each image checked and its bytes
        (a remote URL's from `fetched`) appended to `images`."""
        out = []
        for j, part in enumerate(self.content if isinstance(self.content, list) else ()):
            field = f"{where}.content[{j}]"
            if part.type == "image_url":
                images.append(check_image_url(part.image_url, field, served.images, fetched))
                out.append({"type": "image"})
            else:
                out.append({"type": "text", "text": _part_text(part, field)})
        return out


class ChatCompletionRequest(_Sampling, kw_only=True):
    """POST /v1/chat/completions."""

    messages: list[Message]
    max_tokens: Int64 | None = None  # neither this nor max_completion_tokens: the server's default
    max_completion_tokens: Int64 | None = None
    logprobs: bool = False
    top_logprobs: Int64 | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # extra template variables (Qwen3's enable_thinking)

    def submission(self, served: ServedModel, fetched: Mapping[str, bytes] | None = None) -> Submission:
        """The chat's work; `fetched`: its remote images' bytes by URL (`gapless.server.media`)."""
        if not self.messages:
            raise BadRequest("messages is empty", "messages")
        plan = self.tool_plan(served)
        if self.top_logprobs is not None and not self.logprobs:
            raise BadRequest("top_logprobs needs logprobs to be true", "top_logprobs")
        served.check_logprobs(self.top_logprobs, "top_logprobs")
        served.check_logprobs(self.prompt_logprobs, "prompt_logprobs")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        constraint = {"json_schema": plan.schema} if plan is not None and plan.schema is not None else None
        choices = self.sampling_params(served.default_max_tokens(max_tokens), logprobs, served, constraint)
        chat: list[ChatMessage] = []
        images: list[bytes] = []
        for i, m in enumerate(self.messages):
            if isinstance(m.content, list) and any(p.type == "image_url" for p in m.content):
                parts = m.parts(f"messages[{i}]", served, images, fetched)
                chat.append(ChatMessage(m.role, "", m.tool_calls, m.tool_call_id, m.name, parts=parts))
            else:
                chat.append(
                    ChatMessage(m.role, m.text(f"messages[{i}]"), m.tool_calls, m.tool_call_id, m.name)
                )
        check_image_count(len(images), served.images)
        # any JSON: its integers must fit in 64 bits too, to reach the template
        _fits_the_wire(self.chat_template_kwargs, "chat_template_kwargs")
        _fits_the_wire(self.tools, "tools")
        for i, m in enumerate(self.messages):
            _fits_the_wire(m.tool_calls, f"messages[{i}].tool_calls")
        kwargs = self.chat_template_kwargs
        if plan is not None:
            kwargs = {**(kwargs or {}), "tools": plan.tools}
        return Submission([ImageChat(chat, images) if images else chat], choices, kwargs)

    def grammar_after(self, served: ServedModel) -> str | None:
        """With a reasoning parser the constraint waits for the end of the reasoning (`</think>`), unless
        the template was told not to think."""
        thinking = (self.chat_template_kwargs or {}).get("enable_thinking", True) is not False
        return THINK_END if served.reasoning_parser is not None and thinking else None

    def tool_plan(self, served: ServedModel) -> ToolPlan | None:
        """What the request's tools mean (`gapless.server.tools`); a 400 naming the field if they cannot
        be honoured."""
        try:
            return plan_tools(self.tools, self.tool_choice, self.parallel_tool_calls, served.tool_call_parser)
        except ToolError as e:
            raise BadRequest(str(e), e.param) from None


def _fits_the_wire(value: object, param: str) -> None:
    """A 400 naming `param` when free-form JSON holds an integer msgpack cannot carry (past 64 bits)."""
    if value:
        try:
            msgspec.msgpack.encode(value)
        except OverflowError:
            raise BadRequest(f"{param} holds an integer past 64 bits", param) from None


def _int64_inside(tp: Any) -> Any:
    """`tp` with every `int` in it (inside unions and lists too) bounded to 64 bits."""
    if tp is int:
        return Int64
    args = typing.get_args(tp)
    if typing.get_origin(tp) is list:
        return list[_int64_inside(args[0])]  # type: ignore[misc]  # a type made at run time
    if args and typing.get_origin(tp) in (Union, types.UnionType):
        return functools.reduce(operator.or_, [_int64_inside(a) for a in args])
    return tp


def _native_sampling_struct() -> type[msgspec.Struct]:
    """`SamplingParams`' fields as a request struct (with SGLang's `max_new_tokens`): made from the
    dataclass, so the native endpoint's schema and checks can never list other fields than it."""
    hints = typing.get_type_hints(SamplingParams)
    fields: list[tuple[str, Any, Any]] = [
        (f.name, _int64_inside(hints[f.name]), f.default) for f in dataclasses.fields(SamplingParams)
    ]
    fields.append(("max_new_tokens", Int64 | None, None))  # SGLang's name for max_tokens
    struct = msgspec.defstruct("SamplingParamsIn", fields, kw_only=True, forbid_unknown_fields=True)
    struct.__doc__ = "gapless.SamplingParams' fields by their names, and SGLang's max_new_tokens."
    return struct


SamplingParamsIn = _native_sampling_struct()


class GenerateRequest(msgspec.Struct, kw_only=True):
    """POST /generate: SGLang-style, text or token ids in, text and token ids out."""

    text: str | list[str] | None = None
    input_ids: list[Any] | None = None  # token ids, or a list of them (checked in `submission`)
    sampling_params: SamplingParamsIn = msgspec.field(default_factory=SamplingParamsIn)  # type: ignore[valid-type]  # made at run time
    stream: bool = False
    # SGLang's logprob options: with return_logprob, meta_info carries the output tokens' logprobs and the
    # prompt's from position logprob_start_len (-1: none), each with the top_logprobs_num most likely
    return_logprob: bool = False
    logprob_start_len: Int64 = -1
    top_logprobs_num: Int64 = 0
    return_text_in_logprobs: bool = False

    def submission(self, served: ServedModel) -> Submission:
        fields = msgspec.structs.asdict(self.sampling_params)
        max_new_tokens = fields.pop("max_new_tokens")
        if max_new_tokens is not None:
            fields["max_tokens"] = max_new_tokens
        served.check_logprobs(fields["logprobs"], "sampling_params.logprobs")
        served.check_logprobs(fields["prompt_logprobs"], "sampling_params.prompt_logprobs")
        if self.return_logprob:
            served.check_logprobs(self.top_logprobs_num, "top_logprobs_num")
            if self.logprob_start_len < -1:
                raise BadRequest(
                    "logprob_start_len must be -1 (no prompt logprobs) or more", "logprob_start_len"
                )
            fields["logprobs"] = self.top_logprobs_num
            if self.logprob_start_len >= 0:
                fields["prompt_logprobs"] = self.top_logprobs_num
                fields["prompt_logprobs_start"] = self.logprob_start_len
        params = _sampling_params(fields)
        structured = params.structured
        _check_engine_side(params, structured[0] if structured else None, served)
        if (self.text is None) == (self.input_ids is None):
            raise BadRequest("give exactly one of text and input_ids", "text")
        if self.text is not None:
            return Submission(prompt_list(self.text, "text", served), [params])
        return Submission(prompt_list(self.input_ids, "input_ids", served, text=False), [params])


GenerationRequest = TypeVar("GenerationRequest", CompletionRequest, ChatCompletionRequest, GenerateRequest)
REQUEST_TYPES = (CompletionRequest, ChatCompletionRequest, GenerateRequest)


def parse_request(
    body: bytes,
    kind: type[GenerationRequest],
    served: ServedModel,
    fetched: Mapping[str, bytes] | None = None,
) -> tuple[GenerationRequest, Submission]:
    """The request in `body` and its work for the engine, or BadRequest: the one place a request is checked.
    Malformed JSON is a 422, a wrong shape or type a 400 naming the field, a model this server does not
    serve a 404, and an invalid value (or one it cannot honour) a 400 naming the field. The route reads
    it in two halves, fetching a chat's remote images between them (`gapless.server.media`)."""
    req = read_request(body, kind, served)
    return req, submission(req, served, fetched)


def read_request(body: bytes, kind: type[GenerationRequest], served: ServedModel) -> GenerationRequest:
    """`body` decoded into `kind`, for a model this server serves (else a 404)."""
    req = decode_body(body, kind)
    served.check_model(getattr(req, "model", None))  # the native endpoint names none
    log_ignored_fields(body, kind)
    return req


def submission(
    req: GenerationRequest, served: ServedModel, fetched: Mapping[str, bytes] | None
) -> Submission:
    """A read request's work; `fetched`: a chat's remote images' bytes by URL."""
    if isinstance(req, ChatCompletionRequest):
        sub = req.submission(served, fetched)
    else:
        sub = req.submission(served)
    lora = served.check_model(getattr(req, "model", None))
    if lora is not None:
        sub = replace(sub, lora=LoRAIn(lora.lora_name, lora.lora_int_id, lora.lora_path))
    return sub
