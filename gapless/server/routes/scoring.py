"""Scoring in the responses: the prompt's logprobs as each API shapes them, and the token-counting routes.

- `echo` on `/v1/completions`: the prompt's text before the generated text, and with `logprobs` its
  tokens, text offsets, token logprobs and top logprobs in OpenAI's legacy layout (the first token's
  logprob and top are null: nothing precedes it). This is what lm-evaluation-harness's
  `local-completions` model scores with (`echo: true, logprobs: 1, max_tokens: 1`).
- vLLM's `prompt_logprobs`: per prompt position null or `{token id: {logprob, rank, decoded_token}}`.
- SGLang's `input_token_logprobs` / `input_top_logprobs` in `/generate`'s `meta_info`.
- `/tokenize` and `/detokenize` in vLLM's request and response shapes, with the served model's tokenizer
  (loaded in the API server on first use, tokenizing on a thread, so the event loop never waits).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import msgspec
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from gapless.server import protocol as P
from gapless.server.errors import BadRequest
from gapless.server.openai_protocol import ChatMessage, Int64, Message, decode_body
from gapless.server.routes.common import read_json_body, require_api_key, server_state
from gapless.server.served_model import ServedModel

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Json = dict[str, Any]

router = APIRouter(dependencies=[Depends(require_api_key)])


# ---------------------------------------------------------------------------------------------- layouts
def echo_text(prompt: str | None, p: P.PromptLogprobs | None) -> str:
    """The echoed prompt: the text as the client sent it, else (token ids) the ids decoded."""
    if prompt is not None:
        return prompt
    return p.text if p is not None else ""


def legacy_prompt_logprobs(p: P.PromptLogprobs) -> Json:
    """The prompt's part of a completion's legacy `logprobs` object: per prompt token its text, offset in
    the decoded tokens, logprob (null before the first scored position) and top logprobs (the token
    itself and the top k, by text)."""
    offsets, pos = [], 0
    for tok in p.tokens:
        offsets.append(pos)
        pos += len(tok)
    unscored: list[Any] = [None] * p.start
    tops = [
        {p.tokens[p.start + j]: lp, **{t: v for t, _, v in top if t != p.tokens[p.start + j]}}
        for j, (lp, top) in enumerate(zip(p.logprobs, p.top))
    ]
    return {
        "tokens": list(p.tokens),
        "token_logprobs": unscored + p.logprobs,
        "top_logprobs": unscored + tops,
        "text_offset": offsets,
    }


def join_legacy(prompt: Json, output: Json | None) -> Json:
    """The echoed prompt's legacy logprobs followed by the generated tokens' (their offsets already
    counted from the end of the echoed text)."""
    if output is None:
        return prompt
    return {key: prompt[key] + output[key] for key in prompt}


def vllm_prompt_logprobs(p: P.PromptLogprobs | None) -> list[Json | None] | None:
    """vLLM's `prompt_logprobs`: per prompt position null (the first, or before the first scored one) or
    the prompt token and the top k, keyed by token id (a JSON string), each with its logprob, rank and
    decoded text."""
    if p is None:
        return None
    out: list[Json | None] = [None] * p.start
    for j, (lp, rank, top) in enumerate(zip(p.logprobs, p.ranks, p.top)):
        pos = p.start + j
        entry = {str(p.ids[pos]): {"logprob": lp, "rank": rank, "decoded_token": p.tokens[pos]}}
        for i, (text, tid, v) in enumerate(top):
            entry.setdefault(str(tid), {"logprob": v, "rank": i + 1, "decoded_token": text})
        out.append(entry)
    return out


def sglang_logprobs(
    choice_logprobs: list[P.TokenLogprob], token_ids: list[int], p: P.PromptLogprobs | None, with_text: bool
) -> Json:
    """SGLang's logprob fields of `/generate`'s `meta_info`: `[logprob, token id, text or null]` per
    token (the prompt's first position has a null logprob), and the top ones per position."""

    def entry(lp: float | None, tid: int, text: str) -> list[Any]:
        return [lp, tid, text if with_text else None]

    out: Json = {
        "output_token_logprobs": [
            entry(lp.logprob, t, lp.token) for lp, t in zip(choice_logprobs, token_ids)
        ],
        "output_top_logprobs": [[entry(v, i, s) for s, i, v in lp.top] for lp in choice_logprobs],
    }
    if p is not None:
        first = [entry(None, p.ids[0], p.tokens[0])] if p.start == 1 else []
        scored = [entry(lp, p.ids[p.start + j], p.tokens[p.start + j]) for j, lp in enumerate(p.logprobs)]
        out["input_token_logprobs"] = first + scored
        out["input_top_logprobs"] = [None] * len(first) + [
            [entry(v, i, s) for s, i, v in top] for top in p.top
        ]
    return out


def prompts_of(prompt: str | list[Any]) -> list[str | None]:
    """Each prompt of a completion request as the client sent it: its text, or None for token ids."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(t, int) for t in prompt):
        return [None]
    return [x if isinstance(x, str) else None for x in prompt]


# ----------------------------------------------------------------------------------- tokenize routes
class TokenizeRequest(msgspec.Struct, kw_only=True):
    """POST /tokenize (vLLM's): a `prompt`, or chat `messages` rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    """POST /detokenize (vLLM's): token ids to text."""

    model: str | None = None
    tokens: list[Int64]


def _decode_body(body: bytes, kind: type[Any], served: ServedModel) -> Any:
    req = decode_body(body, kind)
    if served.check_model(req.model) is not None:
        raise BadRequest(
            f"{req.model!r} is a LoRA adapter; this endpoint serves the base model only", "model"
        )
    return req


def _tokenize(tok: PreTrainedTokenizerBase, req: TokenizeRequest) -> list[int]:
    from gapless.engine.chat_template import render_chat

    if (req.prompt is None) == (req.messages is None):
        raise BadRequest("give exactly one of prompt and messages", "prompt")
    if req.messages is not None:
        chat = [ChatMessage(m.role, m.text(f"messages[{i}]")) for i, m in enumerate(req.messages)]
        try:
            messages = [{"role": m.role, "content": m.content} for m in chat]
            _, ids = render_chat(tok, messages, add_generation_prompt=req.add_generation_prompt)
        except ValueError as e:
            raise BadRequest(str(e), "messages") from None
        return list(ids)
    return tok.encode(req.prompt, add_special_tokens=req.add_special_tokens)


@router.post("/tokenize")
async def tokenize(request: Request) -> Response:
    settings = server_state(request).settings
    req = _decode_body(
        await read_json_body(request, settings.max_request_bytes), TokenizeRequest, settings.served
    )
    tok = await asyncio.to_thread(lambda: settings.tokenizer)
    ids = await asyncio.to_thread(_tokenize, tok, req)
    out: Json = {
        "count": len(ids),
        "max_model_len": settings.served.max_context,
        "tokens": ids,
        "token_strs": None,
    }
    if req.return_token_strs:
        out["token_strs"] = tok.convert_ids_to_tokens(ids)
    return JSONResponse(out)


@router.post("/detokenize")
async def detokenize(request: Request) -> Response:
    settings = server_state(request).settings
    req = _decode_body(
        await read_json_body(request, settings.max_request_bytes), DetokenizeRequest, settings.served
    )
    bad = next((t for t in req.tokens if not 0 <= t < settings.served.vocab_size), None)
    if bad is not None:
        raise BadRequest(
            f"token id {bad} is outside the vocabulary [0, {settings.served.vocab_size})", "tokens"
        )
    tok = await asyncio.to_thread(lambda: settings.tokenizer)
    return JSONResponse({"prompt": await asyncio.to_thread(tok.decode, req.tokens)})
