"""`GET /openapi.json`: the API's OpenAPI document, behind the API key when one is set.

The request bodies' schemas are generated from the structs `parse_request` decodes into (msgspec), so the
published schema and the checks a request meets are one list of fields and cannot disagree. Responses
are described by their status and OpenAI's error object; their bodies are OpenAI's (see its reference).
"""

from __future__ import annotations

import functools
from typing import Any

import msgspec
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from gapless import __version__
from gapless.server.errors import error_body
from gapless.server.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
)
from gapless.server.routes.common import require_api_key, server_state
from gapless.server.routes.pooling import EmbeddingRequest, RerankRequest, ScoreRequest

router = APIRouter()

_REF = "#/components/schemas/{name}"

# status -> when a generation endpoint answers it
_ERRORS = {
    "400": "A field has an invalid value (`param` names it), or the prompt is too long",
    "401": "Missing or wrong API key",
    "404": "Unknown model",
    "413": "Body larger than --max-request-bytes",
    "415": "Body that is not JSON",
    "422": "Body that is not valid JSON (or not UTF-8, or nested too deeply)",
    "503": "The server is shutting down or a worker failed",
    "504": "Past --request-timeout; the request was stopped",
}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _generation(
    kind: type[msgspec.Struct], summary: str, answer: str = "The answer, or an SSE stream with `stream: true`"
) -> dict[str, Any]:
    error = {"$ref": _REF.format(name="Error")}
    responses = {"200": _json({"type": "object"}, answer)}
    responses |= {status: _json(error, why) for status, why in _ERRORS.items()}
    body = {
        "required": True,
        "content": {"application/json": {"schema": {"$ref": _REF.format(name=kind.__name__)}}},
    }
    return {"post": {"summary": summary, "requestBody": body, "responses": responses}}


def _get(summary: str, media: str = "application/json") -> dict[str, Any]:
    return {
        "get": {"summary": summary, "responses": {"200": {"description": summary, "content": {media: {}}}}}
    }


def _post(summary: str) -> dict[str, Any]:
    body = {"required": True, "content": {"application/json": {"schema": {"type": "object"}}}}
    ok = {"description": summary, "content": {"text/plain": {}}}
    return {"post": {"summary": summary, "requestBody": body, "responses": {"200": ok}}}


@functools.cache
def openapi_document(with_key: bool) -> dict[str, Any]:
    """The OpenAPI 3.1 document of every endpoint (built once), saying whether a Bearer key is required."""
    _, schemas = msgspec.json.schema_components(
        (
            CompletionRequest,
            ChatCompletionRequest,
            GenerateRequest,
            EmbeddingRequest,
            ScoreRequest,
            RerankRequest,
        ),
        ref_template=_REF,
    )
    sample = error_body(400, "what is wrong", "the field")["error"]
    schemas["Error"] = {
        "type": "object",
        "properties": {"error": {"type": "object", "properties": {k: {} for k in sample}}},
        "required": ["error"],
    }
    paths = {
        "/v1/completions": _generation(CompletionRequest, "Text completion (OpenAI)"),
        "/v1/chat/completions": _generation(ChatCompletionRequest, "Chat completion (OpenAI)"),
        "/generate": _generation(GenerateRequest, "Native generation (SGLang's shape)"),
        "/v1/embeddings": _generation(
            EmbeddingRequest, "Embeddings (OpenAI); a pooling model's", "The answer"
        ),
        "/v1/score": _generation(ScoreRequest, "Pair scores (vLLM); a pooling model's", "The answer"),
        "/v1/rerank": _generation(RerankRequest, "Rerank (Jina, Cohere); a pooling model's", "The answer"),
        "/v1/models": _get("The served model and its LoRA adapters"),
        "/v1/load_lora_adapter": _post("Load a LoRA adapter: {lora_name, lora_path} (--enable-lora)"),
        "/v1/unload_lora_adapter": _post("Unload a LoRA adapter: {lora_name} (--enable-lora)"),
        "/health": _get("Liveness: 200, or 503 once a worker failed (no key needed)"),
        "/metrics": _get("Prometheus metrics", "text/plain"),
        "/debug/state": _get("The scheduler's counters, the KV integrity check when idle, the worker pids"),
        "/openapi.json": _get("This document"),
    }
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "gapless", "version": __version__},
        "paths": paths,
        "components": {"schemas": schemas},
    }
    if with_key:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        doc["security"] = [{"bearer": []}]
    return doc


@router.get("/openapi.json", dependencies=[Depends(require_api_key)])
async def openapi(request: Request) -> JSONResponse:
    return JSONResponse(openapi_document(server_state(request).settings.api_key is not None))
