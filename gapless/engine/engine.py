"""The engine in process: tokenizer + model runner + scheduler, driven one step at a time.

`LLM` (offline) and the server's scheduler process both drive this. Before anything loads, the model is
made local and checked (`gapless.engine.preflight`). Input is checked before anything is queued, so bad
input raises a clear error and leaves the engine as it was: `SamplingParams` checks its own values when
it is made; `tokenize` checks a prompt (non-empty, ids in the vocabulary, room for one new token);
`add_request` checks the params' type and the request id, fills the params' unset fields from the
checkpoint's generation defaults, and trusts its prompt ids, so its callers (`LLM`, `gapless chat`, the
server's scheduler worker) pass every prompt through `tokenize` first.

`shutdown` gives the device side back at once: the engine drops its scheduler, stream and runner (none
of them is in a reference cycle, so the weights, KV pool and CUDA graphs are freed then, not whenever the
garbage collector runs), and on CUDA returns the cached blocks to the device, so a second engine in the
same process, or another process, finds the memory free. Anything that needs the device side afterwards
raises `EngineShutDown`.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import random
from collections.abc import Sequence

import torch
from transformers import PreTrainedTokenizerBase

from gapless.config import EngineConfig
from gapless.engine import pooling, prompt_logprobs
from gapless.engine.detokenize import detokenize
from gapless.engine.grammar import Grammars, check_logit_bias
from gapless.engine.heap import gc_pauses
from gapless.engine.images import ImagePrompter, PromptImage
from gapless.engine.meter import BubbleMeter
from gapless.engine.preflight import check_engine_config
from gapless.engine.request import Req
from gapless.engine.runner import ModelRunner
from gapless.engine.scheduler import Scheduler
from gapless.engine.stats import EngineStats
from gapless.engine.stream import DeviceStream, make_stream
from gapless.lora.registry import AdapterRegistry
from gapless.lora.request import LoRARequest
from gapless.model.config import load_model_config
from gapless.model.generation_config import describe, generation_defaults
from gapless.model.source import load_tokenizer
from gapless.model.vision.mrope import PromptRope, prompt_rope
from gapless.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class EngineShutDown(RuntimeError):
    """The engine (or the `LLM` around it) was shut down: its model, KV cache and workers are gone."""


class Engine:
    def __init__(self, cfg: EngineConfig) -> None:
        if cfg.data_parallel_size != 1:  # the server's replicas each get a config of size 1
            raise ValueError(
                f"data_parallel_size={cfg.data_parallel_size}: an engine in this process is one replica; "
                "data parallelism is served: gapless serve --data-parallel-size N"
            )
        # the model as local files (a path, a built-in name or a Hugging Face id), checked before it loads
        checked = check_engine_config(cfg)
        self.cfg = cfg = checked.cfg
        # a vision-language model's chats with images go through its processor (`image_prompter`)
        self.vision = checked.model.vision
        self._prompter: ImagePrompter | None = None
        gc_pauses()  # counting from here
        self.tokenizer: PreTrainedTokenizerBase = load_tokenizer(cfg)
        # a pooling model's (embed, score: gapless.engine.pooling), else None: every request pools
        self.pooling = pooling.pooling_spec(cfg, self.tokenizer)
        # what a request's unset sampling knobs take (`add_request`): the checkpoint's, unless
        # generation_config says otherwise
        self.sampling_defaults = generation_defaults(cfg.model, cfg.generation_config)
        if self.sampling_defaults:
            source = "the checkpoint" if cfg.generation_config == "auto" else cfg.generation_config
            log.info(
                "generation defaults from %s: %s; --generation-config vllm to ignore",
                source,
                describe(self.sampling_defaults),
            )
        # the device side: in this process (`runner`), or in a device process (runner is None)
        stream, runner = make_stream(cfg)
        self._stream: DeviceStream | None = stream
        self._runner = runner
        self.info = stream.info
        # the scheduler's prefill budget is the one the runner chose for its device (engine.defaults)
        self.cfg = cfg = dataclasses.replace(cfg, chunked_prefill_size=self.info.chunked_prefill_size)
        eos = set(self.info.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_ids = frozenset(eos)
        self.vocab_size = self.info.vocab_size
        self.grammars = Grammars(self.tokenizer, self.vocab_size, self.eos_ids)  # structured output
        try:
            self._scheduler: Scheduler | None = Scheduler(cfg, stream, tokenizer=self.tokenizer)
        except BaseException:  # no engine to shut down: stop the device thread or process here
            stream.close()
            raise
        self._closed = False
        self._broken = False  # a step raised: shutdown skips draining
        self._seeds = random.Random(cfg.seed)
        self._ids = itertools.count()
        self.reqs: dict[str, Req] = {}
        # the LoRA adapters requests may name (gapless.lora), each checked against the model once
        self.loras = (
            AdapterRegistry(load_model_config(cfg.model), cfg.max_lora_rank, experts=cfg.lora_experts)
            if cfg.enable_lora
            else None
        )

    @property
    def closed(self) -> bool:
        """True once `shutdown` ran: the device side is released and only the tokenizer is left."""
        return self._closed

    def _live(self) -> None:
        if self._closed:
            raise EngineShutDown(
                "the engine was shut down: its model, KV cache and workers are released; start a new one"
            )

    @property
    def scheduler(self) -> Scheduler:
        self._live()
        assert self._scheduler is not None
        return self._scheduler

    @property
    def stream(self) -> DeviceStream:
        self._live()
        assert self._stream is not None
        return self._stream

    @property
    def runner(self) -> ModelRunner | None:
        """The in-process model runner; None when the device side runs in a device process."""
        self._live()
        return self._runner

    @property
    def max_context(self) -> int:
        return self.info.max_context

    @property
    def stats(self) -> EngineStats:
        """The live counters and bubble-meter figures (`get_stats` adds the queue and KV gauges)."""
        return self.scheduler.stats

    @property
    def meter(self) -> BubbleMeter:
        """The bubble meter behind `stats`' time figures: a loop around `step` meters its own host work
        beside the step's spans (`BubbleMeter.span`, or `host_span`), and a benchmark `reset`s it."""
        return self.scheduler.meter

    def tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        """Token ids of a prompt, validated: non-empty, in the vocabulary, leaving room for one new token."""
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_special_tokens=True) if prompt else []
        else:
            ids = [int(t) for t in prompt]
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        if not ids:
            raise ValueError("prompt is empty")
        if len(ids) >= self.max_context:
            context = self.cfg.max_model_len or self.info.max_position_embeddings
            what = "the KV cache can hold" if self.info.kv_tokens < context else "the context length"
            raise ValueError(
                f"prompt is {len(ids)} tokens but {what} is {self.max_context} tokens "
                f"(prompt plus at least one generated token must fit)"
            )
        return ids

    def add_request(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        rid: str | None = None,
        images: tuple[PromptImage, ...] = (),
        lora_request: LoRARequest | None = None,
    ) -> Req:
        """Queue an already validated prompt (see `tokenize`) and its images (`image_prompter`). The one
        place a request's unset sampling knobs are filled (`SamplingParams.resolved`: the checkpoint's
        defaults, else the library's), for `LLM`, `gapless chat` and the server alike; the queued `Req`
        holds the resolved params. `lora_request`: the LoRA adapter it runs with (checked, once per
        adapter: `add_lora`)."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be SamplingParams, not {type(params).__name__}")
        if images and (self.vision is None or any(im.start + im.length > len(prompt_ids) for im in images)):
            raise ValueError("images for a model without a vision encoder, or past the prompt's end")
        if images and self.vision is not None and self.vision.bidirectional:  # (Gemma 3)
            images = tuple(dataclasses.replace(im, bidirectional=True) for im in images)
        lora = self.add_lora(lora_request) if lora_request is not None else None
        params = params.resolved(self.sampling_defaults)
        if self.pooling is not None:  # prefill only: it samples nothing and ends after its last chunk
            params = dataclasses.replace(params, max_tokens=1, temperature=0.0, ignore_eos=True, stop=[])
        n = next(self._ids)
        rid = rid if rid is not None else str(n)
        if rid in self.reqs:
            raise ValueError(f"request id {rid!r} is already in use")
        stop_ids = set(params.stop_token_ids or ())
        if not params.ignore_eos:
            stop_ids |= self.eos_ids
        check_logit_bias(params, self.vocab_size)
        grammar = self.grammars.state(params, stop_ids)  # ValueError naming a field it cannot compile
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        req = Req(
            rid=rid,
            prompt_ids=list(prompt_ids),
            params=params,
            seed=seed,
            arrival=n,
            stop_ids=frozenset(stop_ids),
            prompt_lp=prompt_logprobs.new_state(params, len(prompt_ids)),
            pool=pooling.new_state(self.pooling, len(prompt_ids)),
            grammar=grammar,
            lora=lora,
            images=tuple(images),
            rope=self._prompt_rope(len(prompt_ids), images),
        )
        self.reqs[rid] = req
        self.scheduler.add(req)
        return req

    def _prompt_rope(self, length: int, images: tuple[PromptImage, ...]) -> PromptRope | None:
        """An M-RoPE model's positions of a prompt with images (each image's grid its last input)."""
        merge = self.vision.mrope_merge if self.vision is not None else None
        if not images or merge is None:
            return None
        return prompt_rope(length, [(im.start, im.length, im.inputs[-1]) for im in images], merge)

    def add_lora(self, lora: LoRARequest) -> LoRARequest:
        """`lora`, checked against the model (a `LoRAError` naming what is wrong) and known from now on."""
        if not isinstance(lora, LoRARequest):
            raise TypeError(f"lora_request must be a LoRARequest, not {type(lora).__name__}")
        if self.loras is None:
            raise ValueError(
                f"LoRA adapter {lora.lora_name!r}: LoRA is off; start with enable_lora=True (--enable-lora)"
            )
        return self.loras.add(lora)

    def image_prompter(self) -> ImagePrompter:
        """The model's processor, for chats with images (made on first use); ValueError for a text model."""
        if self.vision is None:
            raise ValueError(f"{self.cfg.model} is a text model: it takes no images")
        if self._prompter is None:
            self._prompter = ImagePrompter(self.cfg, self.vision.image_token_id)
        return self._prompter

    def check_params(self, params: SamplingParams) -> None:
        """ValueError naming the field if `add_request` would refuse `params` (a logit_bias token outside
        the vocabulary, a grammar that cannot compile; the compiled grammar is kept for it)."""
        check_logit_bias(params, self.vocab_size)
        self.grammars.state(params, ())

    def abort(self, rid: str) -> None:
        """Abort a request wherever it is; it is finished (reason "abort") at the next step."""
        req = self.reqs.get(rid)
        if req is not None and not req.finished:
            req.aborted = True

    @property
    def broken(self) -> bool:
        """True once a step raised part-way (e.g. Ctrl-C): the engine can only be shut down."""
        return self._broken

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[Req]:
        """Run one scheduler step; returns the requests that got a token or finished in it."""
        if self._broken:
            raise RuntimeError(
                "a step of this engine was interrupted part-way; its state is lost, start a new one"
            )
        sched, st = self.scheduler, self.scheduler.stats
        before = (st.prefill_batches + st.decode_batches, st.device_jobs)  # launched, processed
        self._broken = True  # until the step returns: an exception (Ctrl-C) mid-step leaves state half-moved
        updated = sched.step()
        self._broken = False
        after = (st.prefill_batches + st.decode_batches, st.device_jobs)
        if not updated and before == after and sched.has_work():  # nothing launched, nothing processed
            raise RuntimeError("scheduler stalled: requests are queued but none can be scheduled")
        for req in updated:
            if req.finished:
                self.reqs.pop(req.rid, None)
        return updated

    def output_text(self, req: Req) -> str:
        """The generated text, cut before a stop string (OpenAI semantics) by the rule the scheduler
        stopped on and the server streams by (gapless.engine.stop)."""
        p = req.params
        return detokenize(
            self.tokenizer, req.output_ids, stop=p.stop, skip_special_tokens=p.skip_special_tokens
        )

    def get_stats(self) -> dict[str, float | int]:
        """Every `EngineStats` figure under its own name (tokens, batches, steps, device busy and idle
        time, ...), with the queue and KV pool as they are now, and this process's cycle-collector pauses
        (`gc_*`, `gapless.engine.heap`: counted from the first engine on)."""
        sched = self.scheduler
        return {
            "running_requests": sched.queues.num_active(),
            "waiting_requests": len(sched.queues.waiting),
            **sched.kv.usage(),
            **sched.stats.as_dict(),
            **gc_pauses().figures(),
        }

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()

    def shutdown(self) -> None:
        """Abort what is left, write the trace if asked, stop the device side (even if draining fails)
        and release it: weights, KV pool, CUDA graphs, the device process or thread."""
        if self._closed:
            return
        try:
            if self._broken:  # a step was cut short: its host state is not consistent enough to drain
                return
            for rid in list(self.reqs):
                self.abort(rid)
            while self.has_unfinished():
                self.step()
            if self.cfg.trace_path:
                self.meter.write_trace(self.cfg.trace_path)
        finally:
            self._release()

    def _release(self) -> None:
        """Close the stream and drop every reference to the device side, so it is freed now."""
        stream = self._stream
        self._closed = True
        self._scheduler = self._stream = self._runner = None
        self.reqs.clear()
        if stream is not None:
            stream.close()
        del stream  # the last reference: the runner, its weights, KV pool and graphs go with it
        if self.info.device.startswith("cuda"):
            torch.cuda.empty_cache()  # hand the freed blocks back to the device
