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
from gapless.engine.image_io import split_chat
from gapless.engine.images import PromptImage
from gapless.engine.pooling import PoolingSpec, cosine, format_pair, score_pairs, score_template
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


@dataclass
class EmbeddingOutput:
    """One prompt's embedding (`LLM.embed`)."""

    prompt_token_ids: list[int]
    embedding: list[float]


def _pooled(req: Req) -> list[float]:
    if req.pool is None or req.finish_reason == "abort":
        raise RuntimeError(f"request {req.rid} was aborted before it was pooled")
    return req.pool.result()


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
        return self._run(batch, token_ids, params, use_tqdm, loras=self._loras(lora_request, len(batch)))

    def _loras(
        self, lora: LoRARequest | Sequence[LoRARequest | None] | None, n: int
    ) -> list[LoRARequest | None]:
        """One adapter (or None) per prompt, each checked (and refused by name) before anything is queued."""
        loras = _loras_per_prompt(lora, n)
        for lo in loras:
            if lo is not None:
                self._live_engine().add_lora(lo)
        return loras

    def embed(self, prompts: Prompt | Sequence[Prompt], use_tqdm: bool = False) -> list[EmbeddingOutput]:
        """The embedding of each prompt (text or token ids), in order, from a model served with task
        embed (`task="embed"`, or a sentence-transformers checkpoint): its pooled final hidden states,
        normalized unless the model says otherwise (gapless.engine.pooling)."""
        self._pooling("embed", "embed")
        outs = self._pool(prompts, use_tqdm)
        return [EmbeddingOutput(r.prompt_ids, _pooled(r)) for r in outs]

    def score(
        self, text_1: str | Sequence[str], text_2: str | Sequence[str], use_tqdm: bool = False
    ) -> list[float]:
        """One score per pair, as vLLM's `LLM.score`: `text_1` one text (scored against each of `text_2`)
        or as many as `text_2` (pairwise). An embedding model scores by the cosine of the two
        embeddings; a causal-LM reranker (task score) by its score tokens at the end of the pair's prompt
        (`score_template`)."""
        spec = self._pooling("score", "embed or score")
        queries, docs = score_pairs(text_1, text_2)
        if spec.task == "score":
            template = score_template(self.engine.cfg)
            return [
                _pooled(r)[0]
                for r in self._pool([format_pair(template, q, d) for q, d in zip(queries, docs)], use_tqdm)
            ]
        vecs = [_pooled(r) for r in self._pool(list(queries) + list(docs), use_tqdm)]
        return [cosine(a, b) for a, b in zip(vecs[: len(queries)], vecs[len(queries) :])]

    def _pooling(self, what: str, tasks: str) -> PoolingSpec:
        spec = self._live_engine().pooling
        if spec is None or (what == "embed" and spec.task != "embed"):
            task = spec.task if spec is not None else "generate"
            raise ValueError(
                f"{what} needs a model run with task {tasks} (task=...); this one's task is {task}"
            )
        return spec

    def _pool(self, prompts: Prompt | Sequence[Prompt], use_tqdm: bool) -> list[Req]:
        """Run each prompt as a pooling request; the finished requests, in order."""
        engine = self._live_engine()
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            batch = [cast(Prompt, prompts)]
        else:
            batch = list(cast(Sequence[Prompt], prompts))
        token_ids = [engine.tokenize(p) for p in batch]
        return self._requests(token_ids, [SamplingParams(max_tokens=1)] * len(batch), use_tqdm)

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
        if engine.vision is not None:  # a vision-language model: its processor renders and expands
            how = {**(chat_template_kwargs or {}), "add_generation_prompt": add_generation_prompt}
            if chat_template is not None:
                how["chat_template"] = chat_template
            return self._chat_images(convs, params, use_tqdm, how, self._loras(lora_request, len(convs)))
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
        return self._run(texts, token_ids, params, use_tqdm, loras=self._loras(lora_request, len(convs)))

    def _chat_images(
        self,
        convs: list[Sequence[Message]],
        params: list[SamplingParams],
        use_tqdm: bool,
        template_kwargs: dict[str, Any],
        loras: list[LoRARequest | None],
    ) -> list[RequestOutput]:
        """`chat` for a vision-language model: messages may hold image parts (`{"type": "image", "image":
        a PIL image or a path}`, or OpenAI's `image_url` with a data: URL), each checked against the
        limits before anything is queued."""
        prompter = self.engine.image_prompter()
        token_ids, images = [], []
        for conv in convs:
            chat, opened = split_chat([dict(m) for m in conv], prompter.limits)
            ids, prompt_images = prompter.render(chat, opened, template_kwargs)
            token_ids.append(self.engine.tokenize(ids))
            images.append(prompt_images)
        return self._run([None] * len(convs), token_ids, params, use_tqdm, images, loras)

    def _run(
        self,
        prompts: Sequence[Prompt | None],
        token_ids: list[list[int]],
        params: list[SamplingParams],
        use_tqdm: bool,
        images: list[tuple[PromptImage, ...]] | None = None,
        loras: Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for the validated prompts (a pooling model refuses: it does not generate)."""
        if self.engine.pooling is not None:
            raise ValueError(
                f"this model runs task {self.engine.pooling.task} (a pooling model): it does not generate; "
                "use LLM.embed or LLM.score, or load it with task='generate'"
            )
        reqs = self._requests(token_ids, params, use_tqdm, images, loras)
        return [self._output(r, p) for r, p in zip(reqs, prompts)]

    def _requests(
        self,
        token_ids: list[list[int]],
        params: list[SamplingParams],
        use_tqdm: bool,
        images: list[tuple[PromptImage, ...]] | None = None,
        loras: Sequence[LoRARequest | None] | None = None,
    ) -> list[Req]:
        """Queue the validated prompts and step the engine until all of them are finished. The heap the
        caller's process held before is frozen meanwhile (`frozen_heap`): the collections the run's own
        objects set off do not walk it."""
        for p in params:  # a grammar that cannot compile refuses the call before any of it is queued
            self.engine.check_params(p)
        images = images or [()] * len(token_ids)
        loras = loras if loras is not None else [None] * len(params)
        reqs = [
            self.engine.add_request(ids, p, images=im, lora_request=lo)
            for ids, p, im, lo in zip(token_ids, params, images, loras)
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
        return reqs

    def _output(self, req: Req, prompt: Prompt | None) -> RequestOutput:
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
