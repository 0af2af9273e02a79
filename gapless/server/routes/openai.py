"""OpenAI's generation endpoints, `/v1/completions` and `/v1/chat/completions`: their response objects,
streamed chunks and logprob formats. Requests are checked and converted in `openai_protocol`."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from gapless.server import protocol as P
from gapless.server.openai_protocol import ChatCompletionRequest, CompletionRequest
from gapless.server.reply import ChatReply
from gapless.server.routes.common import require_api_key, server_state
from gapless.server.routes.generation import Choice, Generation, Json, count_usage, submit
from gapless.server.routes.scoring import (
    echo_text,
    join_legacy,
    legacy_prompt_logprobs,
    prompts_of,
    vllm_prompt_logprobs,
)

router = APIRouter(dependencies=[Depends(require_api_key)])

TEXT_COMPLETION = "text_completion"
CHAT_COMPLETION = "chat.completion"
CHAT_CHUNK = "chat.completion.chunk"


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    req, group = await submit(request, CompletionRequest)
    gen = Generation(request, group, "cmpl", req.model or server_state(request).settings.served_model)
    shape = _Completion(gen, req)
    if req.stream:
        usage = gen.usage_chunk(TEXT_COMPLETION, req.include_usage, req.n)
        return await gen.stream(shape.chunks, lambda cs: usage(shape.scored(cs)))
    choices = shape.scored(await gen.collect())
    answers = [
        shape.choice(i, "".join(c.text), c.logprobs, c.finish_reason, c.prompt, first=True)
        for i, c in enumerate(choices)
    ]
    return JSONResponse(gen.envelope(TEXT_COMPLETION, answers, count_usage(choices, req.n)))


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    req, group = await submit(request, ChatCompletionRequest)
    settings = server_state(request).settings
    gen = Generation(request, group, "chatcmpl", req.model or settings.served_model)
    shape = _Chat(
        gen, req.logprobs, ChatReply(req.tool_plan(settings.served), settings.served.reasoning_parser)
    )
    if req.stream:
        return await gen.stream(shape.chunks, gen.usage_chunk(CHAT_CHUNK, req.include_usage, req.n))
    choices = await gen.collect()
    answers = [shape.answer(i, c) for i, c in enumerate(choices)]
    out = gen.envelope(CHAT_COMPLETION, answers, count_usage(choices, req.n))
    if req.prompt_logprobs is not None:  # vLLM's extra field, once per response (one prompt)
        out["prompt_logprobs"] = vllm_prompt_logprobs(choices[0].prompt)
    return JSONResponse(out)


class _Completion:
    """A completion's choices, whole or as stream chunks (with each chunk's offset into its text). With
    `echo`, a choice's first chunk (or the whole choice) starts with the prompt and, with `logprobs`, the
    prompt's logprobs (gapless.server.routes.scoring); with `max_tokens` 0 nothing generated is sent."""

    def __init__(self, gen: Generation, req: CompletionRequest) -> None:
        self.gen, self.with_logprobs, self.echo, self.n = gen, req.logprobs is not None, req.echo, req.n
        self.scores_only, self.with_prompt_logprobs = req.scores_only, req.prompt_logprobs is not None
        self.prompts = prompts_of(req.prompt) if req.echo else []
        self.offsets = [0] * gen.count  # per choice: the length of the text streamed so far

    def choice(
        self,
        index: int,
        text: str,
        lps: list[P.TokenLogprob] | None,
        finish: str | None,
        prompt: P.PromptLogprobs | None,
        offset: int = 0,
        first: bool = False,
    ) -> Json:
        if self.scores_only:  # the one token sampled is not part of the answer
            text, lps, finish = "", [], finish and "length"
        head = echo_text(self.prompts[index // self.n], prompt) if self.echo and first else ""
        lp = _completion_logprobs(lps, offset + len(head)) if self.with_logprobs and lps is not None else None
        if head and lp is not None and prompt is not None:
            lp = join_legacy(legacy_prompt_logprobs(prompt), lp)
        out = {"index": index, "text": head + text, "logprobs": lp, "finish_reason": finish}
        if self.with_prompt_logprobs and first:
            out["prompt_logprobs"] = vllm_prompt_logprobs(prompt)
        return out

    def chunks(self, index: int, d: P.ReqDelta, c: Choice) -> list[Json]:
        first = d.prompt is not None  # echo asks for the prompt's logprobs: they come on the first delta
        quiet = self.scores_only or (not d.text and not d.logprobs)
        if quiet and d.finish_reason is None and not (first and self.echo):
            return []
        out = self.choice(index, d.text, d.logprobs, c.finish_reason, d.prompt, self.offsets[index], first)
        self.offsets[index] += len(out["text"])  # type: ignore[arg-type]  # choice() puts a str there
        return [self.gen.envelope(TEXT_COMPLETION, [out])]

    def scored(self, choices: list[Choice]) -> list[Choice]:
        """`choices`, counting no completion tokens when nothing generated is sent (`max_tokens` 0)."""
        if self.scores_only:
            for c in choices:
                c.completion_tokens = 0
        return choices


class _Chat:
    """A chat completion's messages, whole or as stream chunks (a choice's first chunk names the role).
    With tools or a reasoning parser (`reply` not plain) the text is split into reasoning, content and
    tool calls (`gapless.server.reply`)."""

    def __init__(self, gen: Generation, with_logprobs: bool, reply: ChatReply) -> None:
        self.gen, self.with_logprobs, self.reply = gen, with_logprobs, reply
        self.started = [False] * gen.count
        self.sent = [(0, 0)] * gen.count  # per choice: reasoning and content characters streamed

    def logprobs(self, lps: list[P.TokenLogprob] | None) -> Json | None:
        return _chat_logprobs(lps) if self.with_logprobs and lps is not None else None

    def answer(self, index: int, c: Choice) -> Json:
        message: Json = {"role": "assistant", "content": "".join(c.text)}
        finish = c.finish_reason
        if not self.reply.plain:
            reasoning, content, calls = self.reply.final("".join(c.text))
            message["content"] = content if content or not calls else None
            if reasoning is not None:
                message["reasoning_content"] = reasoning
            if calls:
                message["tool_calls"] = [call.to_json() for call in calls]
            finish = self._finish(finish, bool(calls))
        return {
            "index": index,
            "message": message,
            "logprobs": self.logprobs(c.logprobs),
            "finish_reason": finish,
        }

    def _finish(self, reason: str | None, called: bool) -> str | None:
        """OpenAI's finish reason: `tool_calls` when the model chose to call (a named function: `stop`)."""
        tools = self.reply.tools
        if called and reason == "stop" and tools is not None and tools.mode in ("auto", "required"):
            return "tool_calls"
        return reason

    def _shaped_delta(self, index: int, d: P.ReqDelta, c: Choice) -> tuple[Json, str | None]:
        """The delta of a non-plain reply: what may stream of its reasoning and content now, and, at its
        end, the rest and its tool calls; with the choice's finish reason."""
        text, (r_sent, c_sent) = "".join(c.text), self.sent[index]
        calls: list = []
        if d.finish_reason is None:
            reasoning, content = self.reply.streamable(text)
        else:
            final_reasoning, content, calls = self.reply.final(text)
            reasoning = final_reasoning or ""
        delta: Json = {}
        if len(reasoning) > r_sent:
            delta["reasoning_content"] = reasoning[r_sent:]
        if len(content) > c_sent:
            delta["content"] = content[c_sent:]
        if calls:
            delta["tool_calls"] = [call.to_json(i) for i, call in enumerate(calls)]
        self.sent[index] = (max(r_sent, len(reasoning)), max(c_sent, len(content)))
        return delta, self._finish(c.finish_reason, bool(calls))

    def chunks(self, index: int, d: P.ReqDelta, c: Choice) -> list[Json]:
        out: list[Json] = []
        if not self.started[index]:
            self.started[index] = True
            role = {"role": "assistant", "content": ""}
            out.append({"index": index, "delta": role, "logprobs": None, "finish_reason": None})
        if self.reply.plain:
            delta: Json = {"content": d.text} if d.text else {}
            finish = c.finish_reason
        else:
            delta, finish = self._shaped_delta(index, d, c)
        if delta or d.logprobs or d.finish_reason is not None:
            logprobs = self.logprobs(d.logprobs)
            out.append({"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish})
        return [self.gen.envelope(CHAT_CHUNK, [o]) for o in out]


def _completion_logprobs(lps: list[P.TokenLogprob], offset: int = 0) -> Json:
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


def _chat_logprobs(lps: list[P.TokenLogprob]) -> Json:
    def entry(token: str, logprob: float) -> Json:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    return {
        "content": [
            {**entry(lp.token, lp.logprob), "top_logprobs": [entry(t, v) for t, _, v in lp.top]} for lp in lps
        ]
    }
