"""`/v1/load_lora_adapter` and `/v1/unload_lora_adapter` (vLLM's, behind the API key): the LoRA adapters a
server serves, changed while it serves (`--enable-lora`). A loaded adapter is checked against the model
first (a 400 naming what is wrong); requests name it as their `model`, and `/v1/models` lists it with the
base model as its `parent`. An unloaded adapter's running requests finish with it."""

from __future__ import annotations

import asyncio

import msgspec
from fastapi import APIRouter, Depends, Request
from fastapi.responses import PlainTextResponse

from gapless.lora.adapter import LoRAError
from gapless.lora.registry import AdapterRegistry
from gapless.server.errors import BadRequest
from gapless.server.openai_protocol import decode_body
from gapless.server.routes.common import read_json_body, require_api_key, server_state

router = APIRouter(dependencies=[Depends(require_api_key)])


class LoadLoRARequest(msgspec.Struct):
    lora_name: str
    lora_path: str


class UnloadLoRARequest(msgspec.Struct):
    lora_name: str


def _registry(request: Request) -> AdapterRegistry:
    loras = server_state(request).settings.loras
    if loras is None:
        raise BadRequest("LoRA adapters are off on this server: start it with --enable-lora", "lora_name")
    return loras


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: Request) -> PlainTextResponse:
    loras = _registry(request)
    settings = server_state(request).settings
    req = decode_body(await read_json_body(request, settings.max_request_bytes), LoadLoRARequest)
    if not req.lora_name or not req.lora_path:
        raise BadRequest("lora_name and lora_path must be non-empty", "lora_name")
    if req.lora_name == settings.served_model:
        raise BadRequest(f"{req.lora_name!r} is the base model's name", "lora_name")
    try:  # (reads the adapter's tensors: off the event loop)
        await asyncio.to_thread(loras.add_path, req.lora_name, req.lora_path, settings.served_model)
    except LoRAError as e:
        raise BadRequest(str(e), "lora_path") from None
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: Request) -> PlainTextResponse:
    loras = _registry(request)
    settings = server_state(request).settings
    req = decode_body(await read_json_body(request, settings.max_request_bytes), UnloadLoRARequest)
    try:
        loras.remove(req.lora_name)
    except LoRAError as e:
        raise BadRequest(str(e), "lora_name", 404) from None
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")
