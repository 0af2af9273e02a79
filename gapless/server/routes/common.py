"""HTTP plumbing every route shares: OpenAI-style error responses, the server state behind a request,
the API key check, reading a JSON body under the size limit, and the scope of one HTTP exchange (which
releases what the exchange submitted, however it ends, and turns an unexpected exception into a JSON 500).
"""

from __future__ import annotations

import hmac
import logging

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gapless.server.engine_client import Group
from gapless.server.errors import BadRequest, error_body
from gapless.server.state import ServerState

log = logging.getLogger(__name__)

_GROUPS = "gapless.groups"  # scope key: the groups an HTTP exchange submitted


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    # a 401 says how to authenticate (RFC 9110 requires the challenge; clients and proxies read it)
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


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


def _is_json(content_type: str | None) -> bool:
    """A JSON media type (`application/json`, `application/*+json`), or none given (curl -d and many
    clients send none, and the body is parsed as JSON anyway)."""
    if content_type is None:
        return True
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


async def read_json_body(request: Request, limit: int) -> bytes:
    """The request's body, which must be JSON (415 otherwise); 413 past `limit` bytes, by its
    Content-Length or, without one, while reading."""
    content_type = request.headers.get("content-type")
    if not _is_json(content_type):
        raise BadRequest(
            f"the body must be JSON (Content-Type: application/json), not {content_type!r}", status=415
        )
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


def owned_by_exchange(request: Request, group: Group) -> None:
    """Tie `group` to the HTTP exchange of `request`: `ExchangeScope` releases it when the exchange ends."""
    request.scope[_GROUPS].append(group)


class ExchangeScope:
    """ASGI middleware around every HTTP exchange. When the exchange ends, however it ends (answered, its
    client gone, its stream cut, or an exception), every group it submitted is released, which aborts what
    still runs: nothing it registered outlives it. An exception no handler answered becomes a JSON 500 (the
    traceback goes to the log, not the client) and is not re-raised, so the server does not drop the
    keep-alive connection."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        groups: list[Group] = []
        scope[_GROUPS] = groups
        started = False

        async def send_tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_tracked)
        except Exception:  # noqa: BLE001 - the one place an unexpected failure becomes an answer
            log.exception("unexpected error answering %s %s", scope.get("method"), scope.get("path"))
            if not started:
                response = error_response(500, "internal server error (details are in the server's log)")
                await response(scope, receive, send)
        finally:
            state: ServerState = scope["app"].state.server
            for group in groups:
                state.client.release(group)
