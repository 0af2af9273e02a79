"""What the API server's handlers share, one object per concern: the settings they answer by, the
client of the worker pipeline (with the requests in flight), the server's health, and its metrics."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gapless.engine.image_io import ImageLimits
from gapless.sampling_params import MAX_LOGPROBS
from gapless.server.engine_client import EngineClient
from gapless.server.health import Health
from gapless.server.media import MediaPolicy
from gapless.server.metrics import Metrics
from gapless.server.protocol import SchedulerInfo
from gapless.server.served_model import ServedModel

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from gapless.config import EngineConfig
    from gapless.lora.registry import AdapterRegistry


@dataclass(frozen=True)
class Settings:
    served_model: str  # the model's id in the API
    model_path: str  # also accepted as the model's id
    info: SchedulerInfo  # what the scheduler reported when it was ready
    api_key: str | None = None  # every endpoint but /health needs it as a Bearer token when set
    max_request_bytes: int = 32 << 20  # larger bodies get a 413
    max_tokens_default: int | None = None  # max_tokens of a request that sets none (None: the context's end)
    request_timeout_s: float | None = None  # a request still running after this long is stopped (504)
    max_logprobs: int = MAX_LOGPROBS  # the most top logprobs a request may ask for
    engine_config: EngineConfig | None = None  # the workers' config: /tokenize loads the same tokenizer
    tool_call_parser: str | None = None  # --tool-call-parser
    reasoning_parser: str | None = None  # --reasoning-parser
    loras: AdapterRegistry | None = None  # the LoRA adapters served (--enable-lora), None: LoRA off
    media: MediaPolicy = MediaPolicy()  # which remote image URLs are fetched (--allow-remote-media, ...)
    model_aliases: tuple[str, ...] = ()  # --served-model-name's names past the first: accepted, listed

    @functools.cached_property
    def served(self) -> ServedModel:
        """What requests are checked against: the model's names and the scheduler's limits."""
        info = self.info
        served = ServedModel.of_checkpoint(
            self.served_model,
            self.model_path,
            info.vocab_size,
            info.max_context,
            self.max_tokens_default,
            self.max_logprobs,
            self.model_aliases,
        )
        images = ImageLimits(*info.image_limits) if info.image_limits != (0, 0) else None
        return dataclasses.replace(
            served,
            tool_call_parser=self.tool_call_parser,
            reasoning_parser=self.reasoning_parser,
            loras=self.loras,
            task=info.task,
            normalize=info.normalize,
            images=images,
        )

    @functools.cached_property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The served model's tokenizer in the API server, loaded on first use (by /tokenize)."""
        from gapless.model.source import load_tokenizer

        assert self.engine_config is not None, "the server was started without its engine config"
        return load_tokenizer(self.engine_config)


@dataclass(frozen=True)
class ServerState:
    settings: Settings
    client: EngineClient
    health: Health
    metrics: Metrics
