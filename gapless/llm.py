"""Offline entry point: `LLM(path).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tqdm.auto import tqdm

from gapless.config import EngineConfig
from gapless.engine.engine import Engine
from gapless.engine.request import Req
from gapless.sampling_params import SamplingParams


@dataclass
class RequestOutput:
    """One prompt's result: its text (cut before a stop string), token ids, and why it finished."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str
    cached_tokens: int
    # with SamplingParams.logprobs: per token, its logprob, and the top (token id, logprob) pairs
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None


class LLM:
    """An engine in this process. Options are those of `EngineConfig` (page_size, radix_cache, ...)."""

    def __init__(self, model: str, **options: Any) -> None:
        self.engine = Engine(EngineConfig.from_kwargs(str(model), **options))
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for each prompt (text or token ids) and return the outputs in the prompts' order.

        `sampling_params` is one for all prompts or one per prompt. Every prompt and params is checked
        before anything is queued, so a bad one raises and leaves the engine untouched. An error (or
        Ctrl-C) between steps aborts this call's requests before it propagates; one that cuts a step
        short leaves the engine `broken`, to be shut down."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (
            [sampling_params] * len(prompts)
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        # validate everything before queueing anything, so a bad prompt leaves the engine untouched
        token_ids = [self.engine.tokenize(p) for p in prompts]
        for p in params:
            if not isinstance(p, SamplingParams):
                raise TypeError(f"sampling params must be SamplingParams, not {type(p).__name__}")
        reqs = [self.engine.add_request(ids, p) for ids, p in zip(token_ids, params)]
        try:
            with tqdm(total=len(reqs), desc="generate", disable=not use_tqdm, unit="req") as bar:
                while self.engine.has_unfinished():
                    done = sum(r.finished for r in self.engine.step())
                    bar.update(done)
        except BaseException:
            if not self.engine.broken:  # an error between steps: give this call's requests back
                for r in reqs:
                    self.engine.abort(r.rid)
                while self.engine.has_unfinished():
                    self.engine.step()
            raise
        return [self._output(r, p) for r, p in zip(reqs, prompts)]

    def _output(self, req: Req, prompt: str | Sequence[int]) -> RequestOutput:
        return RequestOutput(
            request_id=req.rid,
            prompt=prompt if isinstance(prompt, str) else None,
            prompt_token_ids=req.prompt_ids,
            text=self.engine.output_text(req),
            token_ids=list(req.output_ids),
            finish_reason=req.finish_reason or "abort",
            cached_tokens=req.cached_tokens or 0,
            logprobs=list(req.output_logprobs) if req.params.logprobs is not None else None,
            top_logprobs=list(req.output_top_logprobs) if req.params.logprobs is not None else None,
        )

    def get_stats(self) -> dict[str, float | int]:
        """Steps, tokens, device idle fraction, mean host time per step, ... since the engine started."""
        return self.engine.get_stats()

    def check_integrity(self) -> None:
        self.engine.check_integrity()

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
