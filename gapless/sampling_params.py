"""User-facing sampling options and their validation.

Field names and defaults follow vLLM's ``SamplingParams`` so that code written against it (and the
OpenAI-compatible server's request fields) carries over. Everything is checked once, here, so the
on-device sampler can trust its inputs and never branch on bad values in the hot path.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

# Below this temperature the softmax is a point mass for any realistic logit gap, and dividing by it
# risks overflowing to inf; vLLM uses the same cut-off to switch to greedy decoding.
GREEDY_TEMPERATURE_EPS = 1e-5
MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit


def _real(name: str, value: object) -> float:
    """Return ``value`` as a float, or raise ValueError naming the field (bools are not numbers here)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {value!r}")
    return float(value)


def _integer(name: str, value: object) -> int:
    """Return ``value`` as an int, or raise ValueError naming the field (1.0 and True are rejected)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an int, got {value!r}")
    return int(value)


def _flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")
    return value


@dataclass
class SamplingParams:
    """How to pick each output token of one request, and when to stop.

    ``stop`` and ``stop_token_ids`` are normalised to lists (possibly empty) so callers never need
    to handle ``None`` or a bare string.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    skip_special_tokens: bool = True
    # None: no logprobs; k >= 0: the sampled token's logprob and the k most likely tokens' (raw model
    # distribution, before penalties, temperature and filters, as vLLM returns them)
    logprobs: int | None = None

    def __post_init__(self) -> None:
        self.max_tokens = _integer("max_tokens", self.max_tokens)
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")

        self.temperature = _real("temperature", self.temperature)
        if not (math.isfinite(self.temperature) and self.temperature >= 0.0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")

        self.top_p = _real("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:  # also rejects NaN
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

        self.top_k = _integer("top_k", self.top_k)
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or at least 1, got {self.top_k}")

        self.min_p = _real("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")

        self.repetition_penalty = _real("repetition_penalty", self.repetition_penalty)
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0.0):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}")

        for name in ("presence_penalty", "frequency_penalty"):
            value = _real(name, getattr(self, name))
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
            setattr(self, name, value)

        self.stop = self._normalise_stop(self.stop)
        self.stop_token_ids = self._normalise_stop_token_ids(self.stop_token_ids)
        self.ignore_eos = _flag("ignore_eos", self.ignore_eos)
        self.skip_special_tokens = _flag("skip_special_tokens", self.skip_special_tokens)
        if self.seed is not None:
            self.seed = _integer("seed", self.seed)
        if self.logprobs is not None:
            self.logprobs = _integer("logprobs", self.logprobs)
            if not 0 <= self.logprobs <= MAX_LOGPROBS:
                raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")

    @staticmethod
    def _normalise_stop(stop: object) -> list[str]:
        if stop is None:
            return []
        items = [stop] if isinstance(stop, str) else stop
        if not isinstance(items, (list, tuple)) or not all(isinstance(s, str) for s in items):
            raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
        if any(s == "" for s in items):  # an empty stop string would end every request at once
            raise ValueError(f"stop must not contain empty strings, got {stop!r}")
        return list(items)

    @staticmethod
    def _normalise_stop_token_ids(ids: object) -> list[int]:
        if ids is None:
            return []
        if not isinstance(ids, (list, tuple)):
            raise ValueError(f"stop_token_ids must be a list of ints, got {ids!r}")
        out = [_integer("stop_token_ids", i) for i in ids]
        if any(i < 0 for i in out):
            raise ValueError(f"stop_token_ids must be non-negative, got {ids!r}")
        return out

    @property
    def greedy(self) -> bool:
        """True when the request always takes the argmax token (temperature 0 or top_k 1).

        Temperatures below ``GREEDY_TEMPERATURE_EPS`` count as 0, as in vLLM: dividing logits by
        them would overflow to inf, and the distribution they describe is the argmax anyway.
        """
        return self.temperature < GREEDY_TEMPERATURE_EPS or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        """True when any penalty is active, i.e. the sampler must track this request's tokens."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
