"""What every generation endpoint shares: submitting a request's engine requests, folding their deltas
into choices, and answering with one JSON response (`collect`) or a stream of SSE chunks (`stream`).

Either way the request's group belongs to its HTTP exchange (`ExchangeScope`), which releases it when the
answer ends, its client goes away or its deadline passes: that aborts whatever still runs, so a request
that is not answered never holds KV. A stream starts only once its first delta is in: a request the
workers refuse (a prompt too long once tokenized, a chat to a model without a chat template) is answered
with its 4xx, not a 200 and an error event.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

import msgspec
from fastapi import Request
from fastapi.responses import StreamingResponse

from gapless.server import protocol as P
from gapless.server.engine_client import Group
from gapless.server.errors import BadRequest, error_body
from gapless.server.images import remote_images
from gapless.server.media import fetch_images
from gapless.server.openai_protocol import ChatCompletionRequest, GenerationRequest, read_request, submission
from gapless.server.routes.common import owned_by_exchange, read_json_body, server_state

log = logging.getLogger(__name__)

Json = dict[str, object]  # a JSON object of a response
T = TypeVar("T")


@dataclass
class Choice:
    """What one engine request (one prompt, one choice) has produced so far."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[P.TokenLogprob] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None
    prompt: P.PromptLogprobs | None = None  # the prompt's logprobs, when asked for (first delta)
    pooled: list[float] | None = None  # a pooling model's embedding or [score] (last delta)

    def fold(self, d: P.ReqDelta) -> None:
        """Add a delta: its text, tokens and logprobs, the latest counts, and how it finished."""
        self.prompt = d.prompt or self.prompt
        self.pooled = d.pooled if d.pooled is not None else self.pooled
        self.text.append(d.text)
        self.token_ids += d.token_ids
        if d.logprobs:
            self.logprobs += d.logprobs
        self.prompt_tokens, self.completion_tokens = d.prompt_tokens, d.completion_tokens
        self.cached_tokens = d.cached_tokens
        if d.finish_reason is not None:
            self.finish_reason = d.finish_reason if d.finish_reason in ("stop", "length") else "abort"


def count_usage(choices: list[Choice], n: int) -> Json:
    """Prompt and cached tokens count once per prompt (its first choice); completion tokens every choice."""
    firsts = choices[::n]
    prompt = sum(c.prompt_tokens for c in firsts)
    completion = sum(c.completion_tokens for c in choices)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(c.cached_tokens for c in firsts)},
    }


async def submit(request: Request, kind: type[GenerationRequest]) -> tuple[GenerationRequest, Group]:
    """Read the body, check and convert it (`parse_request`'s halves: everything is checked before anything
    is submitted, a chat's remote images fetched between them), and submit its engine requests as a group
    the HTTP exchange owns."""
    settings = server_state(request).settings
    served = settings.served
    served.check_task(request.url.path, ("generate",))
    body = await read_json_body(request, settings.max_request_bytes)
    req = read_request(body, kind, served)
    fetched = None
    if isinstance(req, ChatCompletionRequest):
        fetched = await fetch_images(remote_images(req.messages, served.images), settings.media)
    sub = submission(req, served, fetched)
    group = server_state(request).client.submit(sub, served.max_prompt_tokens, settings.request_timeout_s)
    owned_by_exchange(request, group)
    return req, group


_encode_json = msgspec.json.Encoder().encode  # UTF-8 as is, like json.dumps(ensure_ascii=False), faster
DONE = b"data: [DONE]\n\n"


def _sse(obj: Mapping[str, object]) -> bytes:
    return b"data: " + _encode_json(obj) + b"\n\n"


Chunks = Callable[[int, P.ReqDelta, Choice], list[Json]]  # a delta of choice i -> the chunks it streams
FinalChunks = Callable[[list[Choice]], list[Json]]  # the choices once all finished -> the last chunks


class Generation:
    """The answer to one generation request, in one response shape (completion, chat, native)."""

    def __init__(self, request: Request, group: Group, id_prefix: str = "", model: str = "") -> None:
        self.request, self.group, self.count = request, group, len(group.rids)
        self.created = int(time.time())
        self.id, self.model = f"{id_prefix}-{uuid.uuid4().hex}", model

    def envelope(self, obj: str, choices: list[Json], usage: Json | None = None) -> Json:
        """An OpenAI response object (or stream chunk) around `choices`."""
        out: Json = {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if usage is not None:
            out["usage"] = usage
        return out

    def usage_chunk(self, obj: str, include: bool, n: int) -> FinalChunks:
        """The stream's last chunk: usage with no choices, when the client asked (`include_usage`)."""
        return lambda choices: [self.envelope(obj, [], count_usage(choices, n))] if include else []

    async def _unless_disconnected(self, work: Awaitable[T]) -> T:
        """`work`'s result; BadRequest (499) the moment the client goes away first (the exchange's release
        then aborts the request)."""

        async def disconnected() -> None:
            while (await self.request.receive())["type"] != "http.disconnect":
                pass

        task = asyncio.ensure_future(work)
        watch = asyncio.create_task(disconnected())
        try:
            await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
            if not task.done():  # the client is gone; the answer goes nowhere
                raise BadRequest("client disconnected", status=499)
            return task.result()
        finally:
            for t in (task, watch):
                t.cancel()

    async def collect(self) -> list[Choice]:
        """Wait for every choice to finish."""

        async def fold_all() -> list[Choice]:
            choices = [Choice() for _ in range(self.count)]
            while not self.group.done:
                index, d = await self.group.next_delta()
                choices[index].fold(d)
            return choices

        return await self._unless_disconnected(fold_all())

    async def stream(self, chunks: Chunks, final: FinalChunks) -> StreamingResponse:
        """Stream the deltas' chunks as SSE, then the final ones and `[DONE]`. The first delta is awaited
        before the response starts, so a refusal is an HTTP error; a later failure (a deadline, a worker's
        error) becomes an error event, and the stream still ends with `[DONE]`.

        Each write holds everything ready: the deltas that piled up while the last write waited on the
        client (or the event loop was busy) are merged per choice into one chunk (`Group.next_deltas`),
        and the chunks they make go out in one write, each encoded once."""
        first = await self._unless_disconnected(self.group.next_deltas())

        async def body() -> AsyncIterator[bytes]:
            choices = [Choice() for _ in range(self.count)]
            ready = first
            try:
                while True:
                    out = []
                    for index, d in ready:
                        choices[index].fold(d)
                        out += [_sse(chunk) for chunk in chunks(index, d, choices[index])]
                    if out:
                        yield b"".join(out)
                    if self.group.done:
                        break
                    ready = await self.group.next_deltas()
                last = final(choices)
                if last:
                    yield b"".join(_sse(chunk) for chunk in last)
            except BadRequest as e:
                yield _sse(error_body(e.status, str(e), e.param, code=e.status))
            except Exception:  # noqa: BLE001 - the headers are sent: end the stream with an error event
                log.exception("unexpected error while streaming")
                yield _sse(
                    error_body(500, "internal server error (details are in the server's log)", code=500)
                )
            yield DONE

        return StreamingResponse(body(), media_type="text/event-stream")
