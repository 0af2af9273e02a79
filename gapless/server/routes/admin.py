"""The endpoints around generation: `/health` (no key needed), `/v1/models`, `/metrics` (Prometheus)
and `/debug/state` (the scheduler's counters, with its KV integrity check when idle)."""

from __future__ import annotations

import time

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from gapless.server.routes.common import error_response, require_api_key, server_state

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> Response:
    fatal = server_state(request).health.fatal
    if fatal:
        return error_response(503, fatal)
    return JSONResponse({"status": "ok"})


@router.get("/v1/models", dependencies=[Depends(require_api_key)])
async def models(request: Request) -> JSONResponse:
    """The served model (under each of its `--served-model-name` names), and each LoRA adapter served beside
    it with the model as its `parent`."""
    settings = server_state(request).settings
    card = {
        "id": settings.served_model,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "gapless",
        "max_model_len": settings.info.max_context,
        "quantization": settings.info.quantization,  # e.g. "fp8"; None: float weights
        "weight_formats": settings.info.weight_formats,  # each format and how many layers hold it
        "kv_cache": settings.info.kv_cache,  # its dtype and bytes per token: "fp8_e4m3, 57344 B/token"
    }
    adapters = settings.loras.served() if settings.loras is not None else []
    cards = (
        [card]
        + [{**card, "id": alias} for alias in settings.model_aliases]
        + [
            {**card, "id": lo.lora_name, "root": lo.lora_path, "parent": settings.served_model}
            for lo in adapters
        ]
    )
    return JSONResponse({"object": "list", "data": cards})


@router.get("/metrics", dependencies=[Depends(require_api_key)])
async def metrics(request: Request) -> Response:
    """Prometheus exposition; the schedulers' gauges (one series per replica) as fresh as they can answer
    within half a second."""
    state = server_state(request)
    state.metrics.set_engine(await state.client.replica_stats())
    return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


@router.get("/debug/state", dependencies=[Depends(require_api_key)])
async def debug_state(request: Request) -> JSONResponse:
    """The scheduler's counters and, when idle, its KV integrity check (its last counters, with their age
    in `stats_age_s`, while a long step keeps it from answering); and the open requests and collector
    pauses (`api_*`) of the API server process that answers (`api_server`, with `--api-server-count`)."""
    state = server_state(request)
    stats = await state.client.engine_stats()
    open_requests = len(state.client.groups)
    return JSONResponse(
        {
            **stats,
            "api_server": state.client.api_server,
            "api_open_requests": open_requests,
            "worker_pids": state.health.worker_pids,
        }
    )
