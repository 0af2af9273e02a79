"""The native endpoint, `/generate` (SGLang's shape): `text` or `input_ids` (one or a list) and
`sampling_params` with `SamplingParams`' names; returns `text`, `output_ids` and `meta_info` per prompt
(one object for one prompt, else a list). Streaming sends each prompt's deltas in that shape."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from gapless.server.engine_client import Group
from gapless.server.openai_protocol import GenerateRequest
from gapless.server.routes.common import require_api_key
from gapless.server.routes.generation import Choice, Generation, Json, submit
from gapless.server.routes.scoring import sglang_logprobs

router = APIRouter(dependencies=[Depends(require_api_key)])


@router.post("/generate")
async def generate(request: Request) -> Response:
    req, group = await submit(request, GenerateRequest)
    gen = Generation(request, group)
    if req.stream:
        return await gen.stream(
            lambda i, d, c: [_result(req, group, i, c, d.text, d.token_ids)], lambda cs: []
        )
    choices = await gen.collect()
    out = [_result(req, group, i, c, "".join(c.text), c.token_ids) for i, c in enumerate(choices)]
    return JSONResponse(out[0] if len(out) == 1 else out)


def _result(req: GenerateRequest, group: Group, index: int, c: Choice, text: str, ids: list[int]) -> Json:
    meta: Json = {
        "id": group.rids[index],
        "prompt_tokens": c.prompt_tokens,
        "completion_tokens": c.completion_tokens,
        "cached_tokens": c.cached_tokens,
        "finish_reason": c.finish_reason,
    }
    if req.return_logprob:  # SGLang's logprob fields (gapless.server.routes.scoring), so far
        meta.update(sglang_logprobs(c.logprobs, c.token_ids, c.prompt, req.return_text_in_logprobs))
    return {"index": index, "text": text, "output_ids": ids, "meta_info": meta}
