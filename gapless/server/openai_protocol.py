"""HTTP request bodies (OpenAI's, with the vLLM/SGLang extensions), their validation and conversion to
engine requests, and OpenAI's error object.

`parse_request` is the one place a body becomes engine requests: msgspec decodes it straight into these
structs (a body that is not JSON is a 422, a field of the wrong type a 400 naming the field), the model
name is checked (404), and the struct's `engine_requests` checks the values (a 400 naming the field) and
turns it into one (prompt, `SamplingParams`) pair per prompt and choice. Unknown fields are ignored, as
OpenAI's clients send ones we have no use for (`user`, ...); fields we know but cannot honour are
refused by name rather than silently ignored.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import replace
from typing import Any, Literal, TypeGuard, TypeVar

import msgspec

from gapless.sampling_params import SamplingParams
from gapless.server.protocol import ChatMessage

RUN_TO_CONTEXT_END = 2**31 - 1  # max_tokens left unset: generate until the context is full (or a stop)

Prompt = str | list[int] | list[ChatMessage]  # text, token ids, or a chat to render with the template
EngineRequest = tuple[Prompt, SamplingParams]  # one prompt and choice, as the tokenizer worker takes it

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    500: "server_error",
    503: "server_error",
}


class BadRequest(ValueError):
    """An invalid request: answered with `status` and an OpenAI-style error naming `param`."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param, self.status = param, status


def error_body(
    status: int, message: str, param: str | None = None, code: int | None = None
) -> dict[str, dict[str, str | int | None]]:
    """OpenAI's error object: `{"error": {"message", "type", "param", "code"}}`."""
    kind = _ERROR_TYPES.get(status, "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def expand(prompts: list[Prompt], params: SamplingParams, n: int) -> list[EngineRequest]:
    """One engine request per (prompt, choice). With a seed, choice j samples with seed + j: repeatable
    across requests, and the n choices still differ."""
    seeded = params.seed is not None
    return [
        (prompt, replace(params, seed=params.seed + j) if seeded and j else params)
        for prompt in prompts
        for j in range(n)
    ]


def _is_ids(x: object) -> TypeGuard[list[int]]:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def _prompt_list(p: object, param: str, text: bool = True) -> list[str | list[int]]:
    """One prompt or a list of them: strings (if `text`) or token-id lists; each non-empty."""
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
    if any(len(x) == 0 for x in prompts):
        raise BadRequest(f"{param} contains an empty prompt", param)
    return prompts


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class _Sampling(msgspec.Struct, kw_only=True):
    """Fields common to every generation endpoint."""

    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM / SGLang extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        if self.n < 1 or self.n > 128:
            raise BadRequest(f"n must be in [1, 128], got {self.n}", "n")
        if self.logit_bias:
            raise BadRequest("logit_bias is not supported", "logit_bias")
        fields: dict[str, Any] = {
            "max_tokens": RUN_TO_CONTEXT_END if max_tokens is None else max_tokens,
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids,
            "ignore_eos": self.ignore_eos,
            "seed": self.seed,
            "skip_special_tokens": self.skip_special_tokens,
            "logprobs": logprobs,
        }
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
        try:
            return SamplingParams(**fields)
        except ValueError as e:
            raise BadRequest(str(e), str(e).split(" ", 1)[0]) from None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Sampling, kw_only=True):
    model: str
    # a string, token ids, or a list of either: any JSON list, checked in `prompts` to word the error
    prompt: str | list[Any]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def prompts(self) -> list[str | list[int]]:
        return _prompt_list(self.prompt, "prompt")

    def to_params(self) -> SamplingParams:
        if self.echo:
            raise BadRequest("echo is not supported", "echo")
        if self.suffix:
            raise BadRequest("suffix is not supported", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise BadRequest("best_of other than n is not supported", "best_of")
        if self.logprobs is not None and not 0 <= self.logprobs <= 5:
            raise BadRequest(f"logprobs must be in [0, 5], got {self.logprobs}", "logprobs")
        return self.sampling_params(self.max_tokens, self.logprobs)

    def engine_requests(self) -> list[EngineRequest]:
        params = self.to_params()
        return expand(self.prompts(), params, self.n)


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class Message(msgspec.Struct):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise BadRequest(f"message content of type {part.type!r} is not supported", "messages")
            parts.append(part.text)
        return "".join(parts)


class ChatCompletionRequest(_Sampling, kw_only=True):
    model: str
    messages: list[Message]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None

    def to_params(self) -> SamplingParams:
        if not self.messages:
            raise BadRequest("messages is empty", "messages")
        if self.tools:
            raise BadRequest("tools are not supported", "tools")
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            raise BadRequest("response_format other than text is not supported", "response_format")
        if self.top_logprobs is not None and not self.logprobs:
            raise BadRequest("top_logprobs needs logprobs to be true", "top_logprobs")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self.sampling_params(max_tokens, logprobs)

    def engine_requests(self) -> list[EngineRequest]:
        params = self.to_params()
        chat: list[ChatMessage] = [ChatMessage(m.role, m.text()) for m in self.messages]
        return expand([chat], params, self.n)


class GenerateRequest(msgspec.Struct, kw_only=True):
    """SGLang-style native endpoint: text or token ids in, text and token ids out."""

    text: str | list[str] | None = None
    input_ids: list[Any] | None = None  # token ids, or a list of them (checked in `prompts`)
    sampling_params: dict[str, Any] = {}
    stream: bool = False

    def prompts(self) -> list[str | list[int]]:
        if (self.text is None) == (self.input_ids is None):
            raise BadRequest("give exactly one of text and input_ids", "text")
        if self.text is not None:
            return _prompt_list(self.text, "text")
        return _prompt_list(self.input_ids, "input_ids", text=False)

    def to_params(self) -> SamplingParams:
        fields = dict(self.sampling_params)
        if "max_new_tokens" in fields:  # SGLang's name
            fields["max_tokens"] = fields.pop("max_new_tokens")
        try:
            return SamplingParams(**fields)
        except TypeError as e:
            raise BadRequest(f"sampling_params: {e}", "sampling_params") from None
        except ValueError as e:
            raise BadRequest(str(e), str(e).split(" ", 1)[0]) from None

    def engine_requests(self) -> list[EngineRequest]:
        params = self.to_params()
        return expand(self.prompts(), params, 1)


GenerationRequest = TypeVar("GenerationRequest", CompletionRequest, ChatCompletionRequest, GenerateRequest)


def parse_request(
    body: bytes, kind: type[GenerationRequest], model_names: Collection[str]
) -> tuple[GenerationRequest, list[EngineRequest]]:
    """The request in `body` and its engine requests, or BadRequest: the one place a request is checked.

    Malformed JSON is a 422, a wrong shape or type a 400 naming the field, a model this server does not
    serve a 404, and an invalid value (or one it cannot honour) a 400 naming the field."""
    req = _decode(body, kind)
    model = getattr(req, "model", None)  # the native endpoint names none
    if model is not None and model not in model_names:
        raise BadRequest(f"The model `{model}` does not exist.", "model", status=404)
    return req, req.engine_requests()


def _decode(body: bytes, kind: type[GenerationRequest]) -> GenerationRequest:
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as e:
        message = str(e)
        param = message.rsplit("`$.", 1)[-1].rstrip("`").split("[")[0] if "`$." in message else None
        raise BadRequest(message, param) from None
    except msgspec.DecodeError as e:
        raise BadRequest(f"request body is not valid JSON: {e}", None, status=422) from None
