"""Prompt logprobs between the server's workers: the scheduler sends a scoring request's prompt and scores
on its first update (`prompt_logprob_fields`); the detokenizer decodes them once (`decode_prompt_logprobs`)
into the `PromptLogprobs` the API server shapes into echo, vLLM's `prompt_logprobs` and SGLang's
`input_token_logprobs` (gapless.server.routes.scoring).

Imports nothing heavy: the API server imports the workers' module without torch or transformers."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from gapless.server import protocol as P

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from gapless.engine.request import Req


def prompt_logprob_fields(req: Req) -> dict[str, Any]:
    """The `ReqUpdate` fields of a request's first update that carry its prompt logprobs (none when it
    asked for none). The first update comes once the request sampled its first token or ended, so every
    prompt position it scores is in by then."""
    state = req.prompt_lp
    if state is None:
        return {}
    return {
        "prompt_ids": req.prompt_ids,
        "prompt_logprobs_start": state.start,
        "prompt_logprobs": state.values,
    }


def decode_prompt_logprobs(
    tokenizer: PreTrainedTokenizerBase, piece: Callable[[int], str], u: P.ReqUpdate
) -> P.PromptLogprobs | None:
    """The update's prompt logprobs with every token's text (`piece`: a token's own text, which the
    detokenizer decodes once per id), or None."""
    if u.prompt_ids is None or u.prompt_logprobs is None:
        return None
    return P.PromptLogprobs(
        text=cast(str, tokenizer.decode(u.prompt_ids)),  # transformers types it str | list[str]
        ids=u.prompt_ids,
        tokens=[piece(t) for t in u.prompt_ids],
        start=u.prompt_logprobs_start,
        logprobs=[lp for lp, _, _ in u.prompt_logprobs],
        ranks=[rank for _, rank, _ in u.prompt_logprobs],
        top=[[(piece(i), i, v) for i, v in top] for _, _, top in u.prompt_logprobs],
    )
