"""What every generation endpoint shares: submitting a request's engine requests, folding their deltas
into choices, and answering with one JSON response (`collect`) or a stream of SSE chunks (`stream`).

Either way the request's group is released when the answer ends or its client goes away, which aborts
whatever still runs, so a client that leaves never holds KV.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import StreamingResponse

from gapless.server import protocol as P
from gapless.server.engine_client import EngineClient, Group
from gapless.server.openai_protocol import BadRequest, GenerationRequest, error_body, parse_request
from gapless.server.routes.common import read_body, server_state

Json = dict[str, object]  # a JSON object of a response


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

    def fold(self, d: P.ReqDelta) -> None:
        """Add a delta: its text, tokens and logprobs, the latest counts, and how it finished."""
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
    """Read the body, check and convert it (`parse_request`), and submit its engine requests."""
    state = server_state(request)
    body = await read_body(request, state.settings.max_request_bytes)
    req, engine_requests = parse_request(body, kind, state.settings.model_names)
    return req, state.client.submit(engine_requests)


async def _events(group: Group) -> AsyncIterator[tuple[int, P.ReqDelta]]:
    """Deltas of a group until all its requests finish; a worker's refusal raises BadRequest."""
    while group.open or not group.queue.empty():
        index, msg = await group.queue.get()
        if isinstance(msg, P.ReqError):
            raise BadRequest(msg.message, msg.param, msg.status)
        yield index, msg


def _sse(obj: Json) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


Chunks = Callable[[int, P.ReqDelta, Choice], list[Json]]  # a delta of choice i -> the chunks it streams
FinalChunks = Callable[[list[Choice]], list[Json]]  # the choices once all finished -> the last chunks


class Generation:
    """The answer to one generation request, in one response shape (completion, chat, native)."""

    def __init__(self, request: Request, group: Group, id_prefix: str = "", model: str = "") -> None:
        self.client: EngineClient = server_state(request).client
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

    async def collect(self) -> list[Choice]:
        """Wait for every choice to finish; abort them the moment the client goes away."""

        async def fold_all() -> list[Choice]:
            choices = [Choice() for _ in range(self.count)]
            async for index, d in _events(self.group):
                choices[index].fold(d)
            return choices

        async def disconnected() -> None:
            while (await self.request.receive())["type"] != "http.disconnect":
                pass

        work = asyncio.create_task(fold_all())
        watch = asyncio.create_task(disconnected())
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():  # the client is gone: abort (below); the answer goes nowhere
                raise BadRequest("client disconnected", status=499)
            return work.result()
        finally:
            for task in (work, watch):
                task.cancel()
            self.client.release(self.group)

    def stream(self, chunks: Chunks, final: FinalChunks) -> StreamingResponse:
        """Stream each delta's chunks as SSE, then the final ones and `[DONE]`; a worker's refusal
        mid-stream becomes an error event."""

        async def body() -> AsyncIterator[str]:
            choices = [Choice() for _ in range(self.count)]
            try:
                async for index, d in _events(self.group):
                    choices[index].fold(d)
                    for chunk in chunks(index, d, choices[index]):
                        yield _sse(chunk)
                for chunk in final(choices):
                    yield _sse(chunk)
            except BadRequest as e:
                yield _sse(error_body(e.status, str(e), e.param, code=e.status))
            finally:  # also when the client disconnected and the response task was cancelled
                self.client.release(self.group)
            yield "data: [DONE]\n\n"

        return StreamingResponse(body(), media_type="text/event-stream")
