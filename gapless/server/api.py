"""The HTTP API server: a FastAPI app with OpenAI-compatible and native endpoints over the worker pipeline.

Routes live in `routes/` by endpoint family; every refusal, from a route or from Starlette itself (an
unknown route, a wrong method), is answered as OpenAI's error JSON with its status, and the server goes on.
Around every HTTP exchange, `ExchangeScope` releases what it submitted, however it ends, and answers an
unexpected exception with a JSON 500 on a connection that stays open.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from gapless.server.errors import BadRequest
from gapless.server.routes import admin, lora, native, openai, pooling, schema, scoring
from gapless.server.routes.common import ExchangeScope, error_response
from gapless.server.state import ServerState


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="gapless", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state
    app.add_exception_handler(BadRequest, _bad_request)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_middleware(ExchangeScope)
    for routes in (admin, openai, native, schema, scoring, pooling, lora):
        app.include_router(routes.router)
    return app


# Starlette types every handler as taking an Exception; each is registered for its own class only


async def _bad_request(request: Request, e: Exception) -> JSONResponse:
    assert isinstance(e, BadRequest)
    return error_response(e.status, str(e), e.param)


async def _http_error(request: Request, e: Exception) -> JSONResponse:
    assert isinstance(e, StarletteHTTPException)
    return error_response(e.status_code, str(e.detail))
