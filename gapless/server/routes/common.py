"""HTTP plumbing every route shares: OpenAI-style error responses, the server state behind a request,
the API key check, and reading a body under the size limit."""

from __future__ import annotations

import hmac

from fastapi import Request
from fastapi.responses import JSONResponse

from gapless.server.openai_protocol import BadRequest, error_body
from gapless.server.state import ServerState


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status)


def server_state(request: Request) -> ServerState:
    """The state `create_app` attached to the app serving `request`."""
    return request.app.state.server


async def require_api_key(request: Request) -> None:
    """A route dependency: with an API key set, refuse (401) a request without it as a Bearer token."""
    key = server_state(request).settings.api_key
    if key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), key.encode()):
        raise BadRequest("invalid or missing API key (Authorization: Bearer <key>)", status=401)


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body; 413 past `limit` bytes, by its Content-Length or, without one, while reading."""
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
