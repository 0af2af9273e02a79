"""Offline entry point: `LLM(path).generate(prompts, SamplingParams(...))`, or `.chat(messages)`.

Leaving `with LLM(...)` (or `shutdown()`) releases the model, KV cache, CUDA graphs and workers at once;
the object stays, but every later call raises `EngineShutDown`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from tqdm.auto import tqdm

from gapless.config import EngineConfig
from gapless.engine.chat_template import Message, render_chat
from gapless.engine.engine import Engine, EngineShutDown
from gapless.engine.heap import frozen_heap
from gapless.engine.prompt_logprobs import Logprob, prompt_logprobs_output
from gapless.engine.request import Req
from gapless.lora.request import LoRARequest
from gapless.sampling_params import SamplingParams

Prompt = str | Sequence[int]


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
    # with SamplingParams.prompt_logprobs: per prompt position, None (the first, or before
    # prompt_logprobs_start) or {token id: Logprob(logprob, rank, decoded_token)}, as vLLM's
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


class LLM:
    """An engine in this process. Options are those of `EngineConfig` (page_size, radix_cache, ...)."""

    def __init__(self, model: str, **options: Any) -> None:
        self.engine = Engine(EngineConfig.from_kwargs(str(model), **options))
        self.tokenizer = self.engine.tokenizer

    def _live_engine(self) -> Engine:
        if self.engine.closed:
            raise EngineShutDown(
                "this LLM was shut down (its `with` block ended or shutdown() was called): its model, KV "
                "cache and workers are released; create a new LLM"
            )
        return self.engine

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for each prompt (text or token ids) and return the outputs in the prompts' order.

        `lora_request`: the LoRA adapter (engine option `enable_lora`) all prompts run with, or one per
        prompt (None: the base model), as vLLM's.

        `sampling_params` is one for all prompts or one per prompt (None: `SamplingParams()`); the knobs
        they leave unset take the checkpoint's sampling defaults (`get_default_sampling_params`). Every
        prompt and params is checked before anything is queued, so a bad one raises and leaves the
        engine untouched. An error (or Ctrl-C) between steps aborts this call's requests before it
        propagates; one that cuts a step short leaves the engine `broken`, to be shut down."""
        engine = self._live_engine()
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            batch = [cast(Prompt, prompts)]  # one prompt, text or token ids
        else:
            batch = list(cast(Sequence[Prompt], prompts))
        params = _params_per_prompt(sampling_params, len(batch), "prompts")
        # validate everything before queueing anything, so a bad prompt leaves the engine untouched
        token_ids = [engine.tokenize(p) for p in batch]
        return self._run(batch, token_ids, params, use_tqdm, self._loras(lora_request, len(batch)))

    def _loras(
        self, lora: LoRARequest | Sequence[LoRARequest | None] | None, n: int
    ) -> list[LoRARequest | None]:
        """One adapter (or None) per prompt, each checked (and refused by name) before anything is queued."""
        loras = _loras_per_prompt(lora, n)
        for lo in loras:
            if lo is not None:
                self._live_engine().add_lora(lo)
        return loras

    def get_default_sampling_params(self) -> SamplingParams:
        """What a request that sets no sampling knob samples with, as vLLM's method of this name: the
        checkpoint's defaults (its generation_config.json, unless `generation_config="vllm"`), else the
        library's."""
        return SamplingParams().resolved(self._live_engine().sampling_defaults)

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        add_generation_prompt: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Reply to one conversation (a list of `{"role", "content"}` messages) or to each of a list of
        them, as vLLM's `LLM.chat` does: each is rendered with the tokenizer's chat template (or
        `chat_template`), `chat_template_kwargs` passed to it (e.g. `{"enable_thinking": False}` for
        Qwen3), and an assistant turn opened (`add_generation_prompt`); `lora_request` as `generate`'s.
        Returns one `RequestOutput` per conversation, its `prompt` the rendered text. Raises ValueError
        when the model's tokenizer has no chat template; like `generate`, it checks every conversation
        before queueing any."""
        engine = self._live_engine()
        if messages and isinstance(messages[0], Mapping):
            convs = [cast(Sequence[Message], messages)]  # one conversation
        else:
            convs = list(cast(Sequence[Sequence[Message]], messages))
        params = _params_per_prompt(sampling_params, len(convs), "conversations")
        texts, token_ids = [], []
        for conv in convs:
            text, ids = render_chat(
                self.tokenizer,
                conv,
                add_generation_prompt=add_generation_prompt,
                chat_template=chat_template,
                chat_template_kwargs=chat_template_kwargs,
            )
            texts.append(text)
            token_ids.append(engine.tokenize(ids))
        return self._run(texts, token_ids, params, use_tqdm, self._loras(lora_request, len(convs)))

    def _run(
        self,
        prompts: Sequence[Prompt],
        token_ids: list[list[int]],
        params: list[SamplingParams],
        use_tqdm: bool,
        loras: Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Queue the validated prompts and step the engine until all of them are finished. The heap the
        caller's process held before is frozen meanwhile (`frozen_heap`): the collections the run's own
        objects set off do not walk it."""
        for p in params:  # a grammar that cannot compile refuses the call before any of it is queued
            self.engine.check_params(p)
        loras = loras if loras is not None else [None] * len(params)
        reqs = [
            self.engine.add_request(ids, p, lora_request=lo) for ids, p, lo in zip(token_ids, params, loras)
        ]
        try:
            with (
                frozen_heap(),
                tqdm(total=len(reqs), desc="generate", disable=not use_tqdm, unit="req") as bar,
            ):
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

    def _output(self, req: Req, prompt: Prompt) -> RequestOutput:
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
            prompt_logprobs=prompt_logprobs_output(req, self._decode_token),
        )

    def _decode_token(self, token_id: int) -> str:
        # transformers types `decode` as str | list[str]; one list of ids decodes to one str
        return cast(str, self.tokenizer.decode([token_id]))

    def get_stats(self) -> dict[str, float | int]:
        """Steps, tokens, device idle fraction, mean host time per step, ... since the engine started."""
        return self._live_engine().get_stats()

    def check_integrity(self) -> None:
        self._live_engine().check_integrity()

    def shutdown(self) -> None:
        """Stop the engine and release its model, KV cache, CUDA graphs and workers now. Idempotent."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _params_per_prompt(
    sampling_params: SamplingParams | Sequence[SamplingParams] | None, n: int, what: str
) -> list[SamplingParams]:
    """One `SamplingParams` per prompt: the same one for all, or the list given (checked)."""
    if sampling_params is None:
        sampling_params = SamplingParams()
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * n
    params = list(sampling_params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling params for {n} {what}")
    for p in params:
        if not isinstance(p, SamplingParams):
            raise TypeError(f"sampling params must be SamplingParams, not {type(p).__name__}")
    return params


def _loras_per_prompt(
    lora: LoRARequest | Sequence[LoRARequest | None] | None, n: int
) -> list[LoRARequest | None]:
    """One adapter (or None) per prompt: the same one for all, or the list given (checked)."""
    if lora is None or isinstance(lora, LoRARequest):
        return [lora] * n
    loras = list(lora)
    if len(loras) != n:
        raise ValueError(f"got {len(loras)} lora requests for {n} prompts")
    return loras
