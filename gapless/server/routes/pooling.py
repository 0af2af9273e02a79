"""The endpoints of a pooling model (`--task embed` or `--task score`, gapless.engine.pooling):

- `/v1/embeddings` (OpenAI's): `input` as a text, a list of texts, token ids or a list of them;
  `encoding_format` float or base64 (little-endian float32, as OpenAI's client decodes it); `dimensions`
  keeps the first that many values (Matryoshka), normalized again when the model normalizes.
- `/v1/score` and `/score` (vLLM's): `text_1` against each of `text_2`, or pairwise.
- `/rerank`, `/v1/rerank`, `/v2/rerank` (Jina's and Cohere's shape, as vLLM serves it): `query`,
  `documents`, `top_n`, `return_documents`; the results most relevant first.

An embedding model scores a pair by the cosine of its two embeddings; a causal-LM reranker (`--task
score`) by its score tokens at the end of the pair's prompt (`--score-template`). Each text is one engine
request of the HTTP request's group, batched by the scheduler with everything else.
"""

from __future__ import annotations

import base64
import time
import uuid
from typing import Any

import msgspec
import numpy as np
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from gapless.engine.pooling import cosine, format_pair, score_pairs, score_template
from gapless.sampling_params import SamplingParams
from gapless.server.errors import BadRequest
from gapless.server.openai_protocol import Prompt, Submission, decode_body, prompt_list
from gapless.server.routes.common import owned_by_exchange, read_json_body, require_api_key, server_state
from gapless.server.routes.generation import Choice, Generation

router = APIRouter(dependencies=[Depends(require_api_key)])
Json = dict[str, Any]


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    """POST /v1/embeddings (OpenAI's; `input` checked by `prompt_list`)."""

    input: Any
    model: str | None = None
    encoding_format: str = "float"
    dimensions: int | None = None
    user: str | None = None


class ScoreRequest(msgspec.Struct, kw_only=True):
    """POST /v1/score (vLLM's): `text_1` one text or as many as `text_2`."""

    text_1: str | list[str]
    text_2: str | list[str]
    model: str | None = None


class RerankRequest(msgspec.Struct, kw_only=True):
    """POST /v1/rerank (Jina's and Cohere's, as vLLM's): `top_n` None or 0 for all."""

    query: str
    documents: list[str]
    model: str | None = None
    top_n: int | None = None
    return_documents: bool = True


async def _read(request: Request, kind: type[Any], tasks: tuple[str, ...]) -> Any:
    """The body as `kind`, once the model is known to serve `tasks` and the `model` named is this one."""
    settings = server_state(request).settings
    settings.served.check_task(request.url.path, tasks)
    req = decode_body(await read_json_body(request, settings.max_request_bytes), kind)
    if settings.served.check_model(req.model) is not None:
        raise BadRequest(
            f"{req.model!r} is a LoRA adapter; this endpoint serves the base model only", "model"
        )
    return req


async def _pool(request: Request, prompts: list[Prompt], what: str) -> list[Choice]:
    """Pool each prompt (one engine request each, one group); the finished choices, in order."""
    state = server_state(request)
    settings = state.settings
    group = state.client.submit(
        Submission(prompts, [SamplingParams(max_tokens=1)]),
        settings.served.max_prompt_tokens,
        settings.request_timeout_s,
    )
    owned_by_exchange(request, group)
    choices = await Generation(request, group).collect()
    if any(c.pooled is None for c in choices):
        raise BadRequest(f"a {what} request ended before it was pooled (aborted)", status=500)
    return choices


def _usage(choices: list[Choice]) -> Json:
    tokens = sum(c.prompt_tokens for c in choices)
    return {"prompt_tokens": tokens, "total_tokens": tokens}


def _texts(texts: list[str], param: str) -> list[str]:
    if not texts or any(not t for t in texts):
        raise BadRequest(f"{param} must hold at least one text, and no empty one", param)
    return texts


@router.post("/v1/embeddings")
async def embeddings(request: Request) -> Response:
    req: EmbeddingRequest = await _read(request, EmbeddingRequest, ("embed",))
    served = server_state(request).settings.served
    if req.encoding_format not in ("float", "base64"):
        raise BadRequest(
            f"encoding_format must be float or base64, got {req.encoding_format!r}", "encoding_format"
        )
    if req.dimensions is not None and req.dimensions < 1:
        raise BadRequest(f"dimensions must be >= 1, got {req.dimensions}", "dimensions")
    prompts = prompt_list(req.input, "input", served)
    choices = await _pool(request, prompts, "embedding")
    data = []
    for i, c in enumerate(choices):
        vec = np.asarray(c.pooled, dtype=np.float32)
        if req.dimensions is not None:
            if req.dimensions > vec.shape[0]:
                raise BadRequest(f"dimensions must be <= {vec.shape[0]}, this model's", "dimensions")
            vec = vec[: req.dimensions]
            if served.normalize:  # as vLLM: the kept values normalized again
                vec = vec / max(float(np.linalg.norm(vec)), 1e-12)
        value: Any = (
            base64.b64encode(vec.astype("<f4").tobytes()).decode()
            if req.encoding_format == "base64"
            else vec.tolist()
        )
        data.append({"object": "embedding", "index": i, "embedding": value})
    return JSONResponse(
        {
            "id": f"embd-{uuid.uuid4().hex}",
            "object": "list",
            "created": int(time.time()),
            "model": req.model or server_state(request).settings.served_model,
            "data": data,
            "usage": _usage(choices),
        }
    )


async def _scores(request: Request, queries: list[str], docs: list[str]) -> tuple[list[float], Json]:
    """The score of each (query, document) pair, and the usage."""
    settings = server_state(request).settings
    if settings.served.task == "score":
        assert settings.engine_config is not None, "the server was started without its engine config"
        template = score_template(settings.engine_config)
        prompts: list[Prompt] = [format_pair(template, q, d) for q, d in zip(queries, docs)]
        choices = await _pool(request, prompts, "score")
        return [c.pooled[0] for c in choices if c.pooled is not None], _usage(choices)
    unique = list(dict.fromkeys(queries + docs))  # each text embedded once
    choices = await _pool(request, list(unique), "score")
    vecs = {t: c.pooled for t, c in zip(unique, choices)}
    return [cosine(vecs[q] or [], vecs[d] or []) for q, d in zip(queries, docs)], _usage(choices)


@router.post("/v1/score")
@router.post("/score")
async def score(request: Request) -> Response:
    req: ScoreRequest = await _read(request, ScoreRequest, ("embed", "score"))
    try:
        queries, docs = score_pairs(req.text_1, req.text_2)
    except ValueError as e:
        raise BadRequest(str(e), "text_2") from None
    _texts(queries, "text_1")
    _texts(docs, "text_2")
    values, usage = await _scores(request, queries, docs)
    return JSONResponse(
        {
            "id": f"score-{uuid.uuid4().hex}",
            "object": "list",
            "created": int(time.time()),
            "model": req.model or server_state(request).settings.served_model,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(values)],
            "usage": usage,
        }
    )


@router.post("/v1/rerank")
@router.post("/rerank")
@router.post("/v2/rerank")
async def rerank(request: Request) -> Response:
    req: RerankRequest = await _read(request, RerankRequest, ("embed", "score"))
    _texts([req.query], "query")
    docs = _texts(req.documents, "documents")
    if req.top_n is not None and req.top_n < 0:
        raise BadRequest(f"top_n must be >= 0 (0: all), got {req.top_n}", "top_n")
    values, usage = await _scores(request, [req.query] * len(docs), docs)
    order = sorted(range(len(docs)), key=lambda i: -values[i])[: req.top_n or None]
    results = []
    for i in order:
        result: Json = {"index": i, "relevance_score": values[i]}
        if req.return_documents:
            result["document"] = {"text": docs[i]}
        results.append(result)
    return JSONResponse(
        {
            "id": f"rerank-{uuid.uuid4().hex}",
            "model": req.model or server_state(request).settings.served_model,
            "usage": {"total_tokens": usage["total_tokens"]},
            "results": results,
        }
    )
