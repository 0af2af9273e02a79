"""The model a server serves, as requests are checked against it: its names, vocabulary and context, and
the server's limits and defaults for a request (`--max-tokens-default`, `--max-logprobs`, the parsers)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gapless.engine.image_io import ImageLimits
from gapless.sampling_params import MAX_LOGPROBS
from gapless.server.errors import BadRequest

if TYPE_CHECKING:
    from gapless.lora.registry import AdapterRegistry
    from gapless.lora.request import LoRARequest

RUN_TO_CONTEXT_END = 2**31 - 1  # no max_tokens and no server default: generate until the context is full


@dataclass(frozen=True)
class ServedModel:
    """What requests are checked against before anything is submitted: the names the model answers to,
    the scheduler's vocabulary and context, and the server's default length of a reply."""

    name: str  # the model's id in the API; a request that names no model gets this one
    aliases: frozenset[str]  # also accepted as `model` (the checkpoint path)
    vocab_size: int
    max_context: int  # a prompt plus at least one generated token must fit
    max_tokens_default: int | None = None  # max_tokens of a request that sets none (None: the context's end)
    max_logprobs: int = MAX_LOGPROBS  # the most top logprobs a request may ask for (--max-logprobs)
    tool_call_parser: str | None = None  # --tool-call-parser (gapless.server.tools)
    reasoning_parser: str | None = None  # --reasoning-parser (gapless.server.reasoning)
    # the LoRA adapters served beside the model (--enable-lora; loaded and unloaded while it serves)
    loras: AdapterRegistry | None = None
    task: str = "generate"  # generate, or a pooling model's embed or score (gapless.engine.pooling)
    normalize: bool = False  # a pooling model's vectors are L2-normalized

    images: ImageLimits | None = None  # a vision-language model's image limits; None: it takes no images

    def check_task(self, endpoint: str, tasks: tuple[str, ...]) -> None:
        """A 400 when `endpoint` is not for this model's task: a generative model asked for embeddings, an
        embedding model asked to chat, ..., naming the flag that serves the other kind."""
        if self.task in tasks:
            return
        if self.task == "generate":
            how = "start the server with --task embed (or --task score --score-token TOKEN for a reranker)"
        else:
            how = "start the server with --task generate" if "generate" in tasks else "it needs --task embed"
        raise BadRequest(
            f"{endpoint} is not served for this model: it runs task {self.task!r}, and {endpoint} needs "
            f"{' or '.join(tasks)}; {how}",
            "model",
        )

    @classmethod
    def of_checkpoint(
        cls,
        name: str,
        path: str,
        vocab_size: int,
        max_context: int,
        max_tokens_default: int | None = None,
        max_logprobs: int = MAX_LOGPROBS,
        names: tuple[str, ...] = (),
    ) -> ServedModel:
        """The model served as `name` (and `names`, `--served-model-name`'s others) from `path`: the path as
        given, without a trailing slash and resolved are accepted names too, so a client may name the
        checkpoint it knows."""
        aliases = frozenset({path, path.rstrip("/") or path, os.path.realpath(path), *names}) - {name}
        return cls(name, aliases, vocab_size, max_context, max_tokens_default, max_logprobs)

    def check_logprobs(self, value: int | None, field: str) -> None:
        """A number of top logprobs: None, or an integer in [0, --max-logprobs] (a 400 naming `field`)."""
        if value is not None and not 0 <= value <= self.max_logprobs:
            raise BadRequest(
                f"{field} must be in [0, {self.max_logprobs}] (this server's --max-logprobs), got {value}",
                field,
            )

    @property
    def max_prompt_tokens(self) -> int:
        return self.max_context - 1

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter `model` names (None: the base model, which naming none is too); a 404 for a
        model this server does not serve."""
        lora = self.loras.lookup(model) if self.loras is not None else None
        if lora is not None:
            return lora
        names = (model, model.rstrip("/")) if model is not None else ()
        if model is not None and self.name not in names and self.aliases.isdisjoint(names):
            raise BadRequest(
                f"The model `{model[:200]}` does not exist; this server serves `{self.name}`.", "model", 404
            )
        return None

    def default_max_tokens(self, max_tokens: int | None) -> int:
        """A request's max_tokens: its own, else the server's default, else the rest of the context."""
        if max_tokens is not None:
            return max_tokens
        return self.max_tokens_default if self.max_tokens_default is not None else RUN_TO_CONTEXT_END
