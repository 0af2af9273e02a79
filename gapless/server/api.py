"""The HTTP API server: OpenAI-compatible endpoints over the worker pipeline.

Each HTTP request becomes one or more engine requests (one per prompt and choice). The API server
sends them to the tokenizer and waits on one queue per HTTP request, fed by a single task that reads
every message the workers send back. A request whose client goes away is aborted at once, so its KV
is freed; every refusal is an OpenAI-style error JSON with the right status, and the server goes on.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any

import zmq
import zmq.asyncio
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from gapless.sampling_params import SamplingParams
from gapless.server import protocol as P
from gapless.server.metrics import Metrics
from gapless.server.openai_protocol import (
    BadRequest,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    decode_body,
)

log = logging.getLogger(__name__)

STATS_TIMEOUT_S = 5.0

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


def error_body(status: int, message: str, param: str | None = None, code: Any = None) -> dict[str, Any]:
    """OpenAI's error object: `{"error": {"message", "type", "param", "code"}}`."""
    kind = _ERROR_TYPES.get(status, "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status)


@dataclass
class _Choice:
    """What one engine request (one prompt, one choice) has produced so far."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[P.TokenLogprob] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None


class _Group:
    """The engine requests of one HTTP request; their deltas arrive on one queue as (index, message)."""

    def __init__(self, rids: list[str]) -> None:
        self.rids = rids
        self.index = {rid: i for i, rid in enumerate(rids)}
        self.open = set(rids)
        self.queue: asyncio.Queue[tuple[int, P.ReqDelta | P.ReqError]] = asyncio.Queue()
        self.arrival = time.perf_counter()
        self.last_token: dict[str, float] = {}


class ServerState:
    """Sockets, the requests in flight, and the server's settings, shared by all handlers."""

    def __init__(
        self,
        ends: Any,
        served_model: str,
        model_path: str,
        info: dict[str, Any],
        api_key: str | None = None,
        max_request_bytes: int = 32 << 20,
    ) -> None:
        self.served_model = served_model
        self.model_names = {served_model, model_path}
        self.info = info
        self.api_key = api_key
        self.max_request_bytes = max_request_bytes
        self.ctx = zmq.asyncio.Context()
        self.recv = self.ctx.socket(zmq.PULL)
        self.recv.bind(ends.api)
        self._send_ctx = zmq.Context()
        self.to_tokenizer = self._send_ctx.socket(zmq.PUSH)
        self.to_tokenizer.connect(ends.tokenizer)
        self.groups: dict[str, _Group] = {}  # engine rid -> its HTTP request's group
        self.stats_waiters: dict[int, asyncio.Future] = {}
        self._tickets = itertools.count()
        self.metrics = Metrics(served_model)
        self.fatal: str | None = None  # set when a worker died: the server is shutting down
        self.worker_pids: dict[str, int] = {}
        self.on_fatal: Callable[[str], None] = lambda why: None

    def send(self, msg: Any) -> None:
        """Queue a message to the tokenizer without awaiting (safe inside a cancelled task's cleanup)."""
        self.to_tokenizer.send(P.encode(msg))

    async def next_message(self, timeout_s: float | None = None) -> Any | None:
        if timeout_s is not None and not await self.recv.poll(int(timeout_s * 1000)):
            return None
        return P.decode(await self.recv.recv())

    # ------------------------------------------------------------------ the receive loop
    async def receive_loop(self) -> None:
        try:
            while True:
                self._dispatch(await self.next_message())
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - without this loop no request can finish: stop serving
            log.exception("the API server's receive loop failed")
            self.fail(f"the API server's receive loop failed: {e!r}")

    def _dispatch(self, msg: Any) -> None:
        if isinstance(msg, P.Deltas):
            now = time.perf_counter()
            for d in msg.deltas:
                self._deliver(d.rid, d, now)
        elif isinstance(msg, P.ReqError):
            self._deliver(msg.rid, msg, time.perf_counter())
        elif isinstance(msg, P.StatsOut):
            fut = self.stats_waiters.pop(msg.ticket, None)
            if fut is not None and not fut.done():
                fut.set_result(msg.stats)
        elif isinstance(msg, P.Failed):
            self.fail(f"the {msg.worker} worker failed:\n{msg.error}")

    def _deliver(self, rid: str, msg: P.ReqDelta | P.ReqError, now: float) -> None:
        group = self.groups.get(rid)
        if group is None:  # its client is gone (already aborted)
            return
        if isinstance(msg, P.ReqDelta):
            self._observe(group, msg, now)
        if isinstance(msg, P.ReqError) or msg.finish_reason is not None:
            group.open.discard(rid)
            del self.groups[rid]
        group.queue.put_nowait((group.index[rid], msg))

    def _observe(self, group: _Group, d: P.ReqDelta, now: float) -> None:
        m, model = self.metrics, self.metrics.model
        n = len(d.token_ids)
        if n:
            last = group.last_token.get(d.rid)
            if last is None:
                m.ttft.labels(model).observe(now - group.arrival)
            else:
                for _ in range(n):
                    m.itl.labels(model).observe((now - last) / n)
            group.last_token[d.rid] = now
            m.generation_tokens.labels(model).inc(n)
        if d.finish_reason is not None:
            m.prompt_tokens.labels(model).inc(d.prompt_tokens)
            m.requests.labels(model, d.finish_reason).inc()
            m.e2e.labels(model).observe(now - group.arrival)

    def fail(self, why: str) -> None:
        if self.fatal is None:
            self.fatal = why
            log.error("%s", why)
            for rid, group in list(self.groups.items()):
                group.queue.put_nowait((group.index[rid], P.ReqError(rid, why, status=503)))
            self.groups.clear()
            self.on_fatal(why)

    # ------------------------------------------------------------------ requests
    def submit(self, prompts: list[tuple[str | list[int] | list[P.ChatMessage], SamplingParams]]) -> _Group:
        if self.fatal:
            raise BadRequest(f"server is shutting down: {self.fatal}", status=503)
        base = uuid.uuid4().hex
        rids = [f"{base}-{i}" for i in range(len(prompts))]
        group = _Group(rids)
        for rid, (prompt, params) in zip(rids, prompts):
            self.groups[rid] = group
            if isinstance(prompt, str):
                req = P.TokenizeReq(rid, params, text=prompt)
            elif prompt and isinstance(prompt[0], P.ChatMessage):
                req = P.TokenizeReq(rid, params, messages=prompt)  # type: ignore[arg-type]
            else:
                req = P.TokenizeReq(rid, params, token_ids=prompt)  # type: ignore[arg-type]
            self.send(req)
        self.metrics.in_flight.inc()
        return group

    def release(self, group: _Group) -> None:
        """The HTTP request is done (or its client gone): abort whatever of it still runs."""
        for rid in list(group.open):
            self.groups.pop(rid, None)
            self.send(P.Abort(rid))
            self.metrics.requests.labels(self.metrics.model, "abort").inc()
        group.open.clear()
        self.metrics.in_flight.dec()

    async def engine_stats(self) -> dict[str, Any]:
        ticket = next(self._tickets)
        fut = asyncio.get_running_loop().create_future()
        self.stats_waiters[ticket] = fut
        self.send(P.StatsReq(ticket))
        try:
            return await asyncio.wait_for(fut, STATS_TIMEOUT_S)
        finally:
            self.stats_waiters.pop(ticket, None)


def _expand(prompts: list[Any], params: SamplingParams, n: int) -> list[tuple[Any, SamplingParams]]:
    """One engine request per (prompt, choice). With a seed, choice j samples with seed + j: repeatable
    across requests, and the n choices still differ."""
    seeded = params.seed is not None
    return [
        (prompt, replace(params, seed=params.seed + j) if seeded and j else params)
        for prompt in prompts
        for j in range(n)
    ]


async def _events(group: _Group) -> AsyncIterator[tuple[int, P.ReqDelta]]:
    """Deltas of a group until all its requests finish; a worker's refusal raises BadRequest."""
    while group.open or not group.queue.empty():
        index, msg = await group.queue.get()
        if isinstance(msg, P.ReqError):
            raise BadRequest(msg.message, msg.param, msg.status)
        yield index, msg


def _usage(choices: list[_Choice], n: int) -> dict[str, Any]:
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


def _fold(choice: _Choice, d: P.ReqDelta) -> None:
    choice.text.append(d.text)
    choice.token_ids += d.token_ids
    if d.logprobs:
        choice.logprobs += d.logprobs
    choice.prompt_tokens, choice.completion_tokens = d.prompt_tokens, d.completion_tokens
    choice.cached_tokens = d.cached_tokens
    if d.finish_reason is not None:
        choice.finish_reason = _finish_reason(d.finish_reason)


def _finish_reason(reason: str) -> str:
    return reason if reason in ("stop", "length") else "abort"


# ---------------------------------------------------------------------------- response shapes
def _completion_logprobs(lps: list[P.TokenLogprob], offset: int = 0) -> dict[str, Any]:
    offsets, pos = [], offset
    for lp in lps:
        offsets.append(pos)
        pos += len(lp.token)
    return {
        "tokens": [lp.token for lp in lps],
        "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": [{t: v for t, _, v in lp.top} for lp in lps],
        "text_offset": offsets,
    }


def _chat_logprobs(lps: list[P.TokenLogprob]) -> dict[str, Any]:
    def entry(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    return {
        "content": [
            {**entry(lp.token, lp.logprob), "top_logprobs": [entry(t, v) for t, _, v in lp.top]} for lp in lps
        ]
    }


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class _Endpoint:
    """Runs a generation request for one response shape (completion, chat, native)."""

    def __init__(self, state: ServerState, request: Request, id_prefix: str = "", model: str = "") -> None:
        self.state, self.request = state, request
        self.created = int(time.time())
        self.id, self.model = f"{id_prefix}-{uuid.uuid4().hex}", model

    def envelope(self, obj: str, choices: list[Any], usage: dict[str, Any] | None = None) -> dict[str, Any]:
        """An OpenAI response object (or stream chunk) around `choices`."""
        out = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}
        if usage is not None:
            out["usage"] = usage
        return out

    def usage_chunk(self, obj: str, include: bool, n: int) -> Callable[[list[_Choice]], list[Any]]:
        """The stream's last chunk: usage with no choices, when the client asked (`include_usage`)."""
        return lambda choices: [self.envelope(obj, [], _usage(choices, n))] if include else []

    async def collect(self, group: _Group, count: int) -> list[_Choice]:
        """Wait for every choice to finish; abort them the moment the client goes away."""

        async def fold_all() -> list[_Choice]:
            choices = [_Choice() for _ in range(count)]
            async for index, d in _events(group):
                _fold(choices[index], d)
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
            self.state.release(group)

    def stream(
        self,
        group: _Group,
        count: int,
        chunks: Callable[[int, P.ReqDelta, _Choice], list[Any]],
        final: Callable[[list[_Choice]], list[Any]],
    ) -> StreamingResponse:
        async def body() -> AsyncIterator[str]:
            choices = [_Choice() for _ in range(count)]
            try:
                async for index, d in _events(group):
                    _fold(choices[index], d)
                    for chunk in chunks(index, d, choices[index]):
                        yield _sse(chunk)
                for chunk in final(choices):
                    yield _sse(chunk)
            except BadRequest as e:
                yield _sse(error_body(e.status, str(e), e.param, code=e.status))
            finally:  # also when the client disconnected and the response task was cancelled
                self.state.release(group)
            yield "data: [DONE]\n\n"

        return StreamingResponse(body(), media_type="text/event-stream")


async def read_body(request: Request, limit: int) -> bytes:
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise BadRequest(f"request body is {length} bytes; the limit is {limit}", status=413)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BadRequest(f"request body exceeds the limit of {limit} bytes", status=413)
        chunks.append(chunk)
    return b"".join(chunks)


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="gapless", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state

    async def auth(request: Request) -> None:
        if state.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), state.api_key.encode()):
            raise BadRequest("invalid or missing API key (Authorization: Bearer <key>)", status=401)

    @app.exception_handler(BadRequest)
    async def _bad_request(request: Request, e: BadRequest) -> JSONResponse:
        return error_response(e.status, str(e), e.param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        return error_response(e.status_code, str(e.detail))

    async def parse(request: Request, kind: type) -> Any:
        body = decode_body(await read_body(request, state.max_request_bytes), kind)
        if hasattr(body, "model") and body.model not in state.model_names:
            raise BadRequest(f"The model `{body.model}` does not exist.", "model", status=404)
        return body

    @app.get("/health")
    async def health() -> Response:
        if state.fatal:
            return error_response(503, state.fatal)
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models", dependencies=[Depends(auth)])
    async def models() -> JSONResponse:
        card = {
            "id": state.served_model,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "gapless",
            "max_model_len": state.info.get("max_context"),
        }
        return JSONResponse({"object": "list", "data": [card]})

    @app.get("/metrics", dependencies=[Depends(auth)])
    async def metrics() -> Response:
        try:
            state.metrics.set_engine(await state.engine_stats())
        except asyncio.TimeoutError:
            log.warning("scheduler stats timed out; serving the last values")
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/debug/state", dependencies=[Depends(auth)])
    async def debug_state() -> JSONResponse:
        """The scheduler's counters and, when idle, its KV integrity check; and the API's open requests."""
        stats = await state.engine_stats()
        return JSONResponse(
            {**stats, "api_open_requests": len(state.groups), "worker_pids": state.worker_pids}
        )

    @app.post("/v1/completions", dependencies=[Depends(auth)])
    async def completions(request: Request) -> Response:
        req: CompletionRequest = await parse(request, CompletionRequest)
        params, prompts = req.to_params(), req.prompts()
        group = state.submit(_expand(prompts, params, req.n))
        ep, obj = _Endpoint(state, request, "cmpl", req.model), "text_completion"
        count = len(group.rids)
        with_logprobs = params.logprobs is not None

        def choice(index: int, text: str, lps: list[P.TokenLogprob] | None, finish: str | None, offset=0):
            lp = _completion_logprobs(lps, offset) if with_logprobs and lps is not None else None
            return {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}

        if req.stream:
            offsets = [0] * count

            def delta(index: int, d: P.ReqDelta, c: _Choice) -> list[Any]:
                if not d.text and d.finish_reason is None and not d.logprobs:
                    return []
                out = choice(index, d.text, d.logprobs, c.finish_reason, offsets[index])
                offsets[index] += len(d.text)
                return [ep.envelope(obj, [out])]

            return ep.stream(group, count, delta, ep.usage_chunk(obj, req.include_usage, req.n))
        choices = await ep.collect(group, count)
        return JSONResponse(
            ep.envelope(
                obj,
                [choice(i, "".join(c.text), c.logprobs, c.finish_reason) for i, c in enumerate(choices)],
                _usage(choices, req.n),
            )
        )

    @app.post("/v1/chat/completions", dependencies=[Depends(auth)])
    async def chat_completions(request: Request) -> Response:
        req: ChatCompletionRequest = await parse(request, ChatCompletionRequest)
        params = req.to_params()
        messages = [P.ChatMessage(m.role, m.text()) for m in req.messages]
        group = state.submit(_expand([messages], params, req.n))
        ep, obj = _Endpoint(state, request, "chatcmpl", req.model), "chat.completion.chunk"
        count = len(group.rids)

        def logprobs(lps: list[P.TokenLogprob] | None) -> dict[str, Any] | None:
            return _chat_logprobs(lps) if req.logprobs and lps is not None else None

        if req.stream:
            started = [False] * count

            def delta(index: int, d: P.ReqDelta, c: _Choice) -> list[Any]:
                out = []
                if not started[index]:  # the first chunk of a choice names the role
                    started[index] = True
                    role = {"role": "assistant", "content": ""}
                    out.append({"index": index, "delta": role, "logprobs": None, "finish_reason": None})
                if d.text or d.logprobs or d.finish_reason is not None:
                    body = {"content": d.text} if d.text else {}
                    out.append(
                        {
                            "index": index,
                            "delta": body,
                            "logprobs": logprobs(d.logprobs),
                            "finish_reason": c.finish_reason,
                        }
                    )
                return [ep.envelope(obj, [o]) for o in out]

            return ep.stream(group, count, delta, ep.usage_chunk(obj, req.include_usage, req.n))
        choices = await ep.collect(group, count)
        answers = [
            {
                "index": i,
                "message": {"role": "assistant", "content": "".join(c.text)},
                "logprobs": logprobs(c.logprobs),
                "finish_reason": c.finish_reason,
            }
            for i, c in enumerate(choices)
        ]
        return JSONResponse(ep.envelope("chat.completion", answers, _usage(choices, req.n)))

    @app.post("/generate", dependencies=[Depends(auth)])
    async def generate(request: Request) -> Response:
        """Native endpoint: `text` or `input_ids` (one or a list) and vLLM-named `sampling_params`;
        returns `text`, `output_ids` and `meta_info` per prompt. Streaming sends deltas."""
        req: GenerateRequest = await parse(request, GenerateRequest)
        params, prompts = req.to_params(), req.prompts()
        group = state.submit(_expand(prompts, params, 1))
        ep = _Endpoint(state, request)

        def result(index: int, c: _Choice, text: str, ids: list[int]) -> dict[str, Any]:
            return {
                "index": index,
                "text": text,
                "output_ids": ids,
                "meta_info": {
                    "id": group.rids[index],
                    "prompt_tokens": c.prompt_tokens,
                    "completion_tokens": c.completion_tokens,
                    "cached_tokens": c.cached_tokens,
                    "finish_reason": c.finish_reason,
                },
            }

        if req.stream:
            return ep.stream(
                group, len(prompts), lambda i, d, c: [result(i, c, d.text, d.token_ids)], lambda cs: []
            )
        choices = await ep.collect(group, len(prompts))
        out = [result(i, c, "".join(c.text), c.token_ids) for i, c in enumerate(choices)]
        return JSONResponse(out[0] if len(out) == 1 else out)

    return app
