"""User-facing sampling options and their validation.

Field names and defaults follow vLLM's ``SamplingParams`` so that code written against it (and the
OpenAI-compatible server's request fields) carries over. Everything is checked once, here, so the
on-device sampler can trust its inputs and never branch on bad values in the hot path.

The sampling knobs a checkpoint may set defaults for (``CHECKPOINT_DEFAULTABLE``: temperature, top_p,
top_k, min_p, repetition_penalty) default to None, "unset", so that an explicit value, even one equal to
the library's default (``temperature=1.0``), can be told from one left out. The engine fills the unset
ones when it queues a request (``resolved``): the checkpoint's default (its ``generation_config.json``),
else the library's (``LIBRARY_DEFAULTS``, vLLM's), as vLLM does with ``--generation-config auto``. Only
resolved params reach the sampler.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

# Below this temperature the softmax is a point mass for any realistic logit gap, and dividing by it
# risks overflowing to inf; vLLM uses the same cut-off to switch to greedy decoding.
GREEDY_TEMPERATURE_EPS = 1e-5
MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit

# what an unset knob samples with when the checkpoint sets no default for it (vLLM's defaults)
LIBRARY_DEFAULTS: dict[str, float | int] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
}
CHECKPOINT_DEFAULTABLE = tuple(LIBRARY_DEFAULTS)  # the fields a checkpoint's generation config may default


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


def _temperature(v: object) -> float:
    t = _real("temperature", v)
    if not (math.isfinite(t) and t >= 0.0):
        raise ValueError(f"temperature must be a finite number >= 0, got {t}")
    return t


def _top_p(v: object) -> float:
    p = _real("top_p", v)
    if not 0.0 < p <= 1.0:  # also rejects NaN
        raise ValueError(f"top_p must be in (0, 1], got {p}")
    return p


def _top_k(v: object) -> int:
    k = _integer("top_k", v)
    if k == 0 or k < -1:
        raise ValueError(f"top_k must be -1 (disabled) or at least 1, got {k}")
    return k


def _min_p(v: object) -> float:
    p = _real("min_p", v)
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"min_p must be in [0, 1], got {p}")
    return p


def _repetition_penalty(v: object) -> float:
    r = _real("repetition_penalty", v)
    if not (math.isfinite(r) and r > 0.0):
        raise ValueError(f"repetition_penalty must be a finite number > 0, got {r}")
    return r


# each defaultable knob's check: its value as the sampler takes it, or ValueError naming the field
_CHECKS = {
    "temperature": _temperature,
    "top_p": _top_p,
    "top_k": _top_k,
    "min_p": _min_p,
    "repetition_penalty": _repetition_penalty,
}


STRUCTURED_FIELDS = ("json_schema", "regex", "ebnf", "choice", "json_object")
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound on each logit_bias value


def _logit_bias(bias: object) -> dict[int, float] | None:
    """`bias` as {token id: float}, or ValueError naming logit_bias (ids may come as strings, as JSON's
    object keys do); the vocabulary bound is checked by the engine, which knows it."""
    if bias is None:
        return None
    if not isinstance(bias, Mapping):
        raise ValueError(f"logit_bias must be a map of token id to bias, got {bias!r}")
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            tok = int(key)
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias keys must be token ids, got {key!r}") from None
        b = _real("logit_bias", value)
        if tok < 0 or not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS:
            raise ValueError(
                f"logit_bias must map token ids >= 0 to values in [-100, 100], got {key!r}: {value!r}"
            )
        out[tok] = b
    return out or None


def _check_structured(p: SamplingParams) -> None:
    """At most one structured-output field, each of its type (the grammar itself is compiled later)."""
    given = [name for name in STRUCTURED_FIELDS if getattr(p, name) not in (None, False)]
    if len(given) > 1:
        raise ValueError(f"json_schema, regex, ebnf, choice and json_object exclude each other; got {given}")
    p.json_object = _flag("json_object", p.json_object)
    if p.grammar_after is not None and (not isinstance(p.grammar_after, str) or not p.grammar_after):
        raise ValueError(f"grammar_after must be a non-empty string, got {p.grammar_after!r}")
    if p.json_schema is not None and not isinstance(p.json_schema, (str, dict)):
        raise ValueError(
            f"json_schema must be a JSON schema (an object or its JSON text), got {p.json_schema!r}"
        )
    for name in ("regex", "ebnf"):
        value = getattr(p, name)
        if value is not None and (not isinstance(value, str) or not value):
            raise ValueError(f"{name} must be a non-empty string, got {value!r}")
    if p.choice is not None:
        if (
            not isinstance(p.choice, (list, tuple))
            or not p.choice
            or not all(isinstance(c, str) for c in p.choice)
        ):
            raise ValueError(f"choice must be a non-empty list of strings, got {p.choice!r}")
        p.choice = list(p.choice)


def check_sampling_value(name: str, value: object) -> float | int:
    """`value` checked as `name`'s (one of ``CHECKPOINT_DEFAULTABLE``), by the rule a request's own is:
    a checkpoint's defaults pass it before they are used."""
    return _CHECKS[name](value)


@dataclass
class SamplingParams:
    """How to pick each output token of one request, and when to stop.

    ``stop`` and ``stop_token_ids`` are normalised to lists (possibly empty) so callers never need
    to handle ``None`` or a bare string. The five knobs a checkpoint may default are None until the
    engine resolves them (see the module's docstring): None is "unset", never a value to sample with.
    """

    max_tokens: int = 16
    temperature: float | None = None  # unset: the checkpoint's default, else 1.0 (LIBRARY_DEFAULTS)
    top_p: float | None = None  # unset: the checkpoint's, else 1.0 (off)
    top_k: int | None = None  # unset: the checkpoint's, else -1 (off)
    min_p: float | None = None  # unset: the checkpoint's, else 0.0 (off)
    repetition_penalty: float | None = None  # unset: the checkpoint's, else 1.0 (off)
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
    # None: none; k >= 0: for every prompt position from `prompt_logprobs_start` on (at least 1: the
    # first token has nothing before it), the prompt token's logprob and rank and the k most likely
    # tokens' logprobs, from the same raw distribution (gapless.sampling.logprobs). The prompt's cached
    # prefix is reused only up to the first scored position.
    prompt_logprobs: int | None = None
    prompt_logprobs_start: int = 0  # SGLang's logprob_start_len

    # OpenAI's logit_bias: token id -> a bias in [-100, 100] added to its logit before sampling
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0  # EOS and stop_token_ids cannot end the request before this many output tokens
    # Structured output (SGLang's sampling-param names; at most one): the output must match a JSON
    # schema (a dict or its JSON text), a regular expression, an EBNF grammar (GBNF style, with a `root`
    # rule), one of a list of strings, or any JSON object. Compiled with xgrammar when the request is
    # queued (`gapless.engine.grammar`); one that cannot be compiled is a ValueError naming the field.
    json_schema: str | dict[str, Any] | None = None
    regex: str | None = None
    ebnf: str | None = None
    choice: list[str] | None = None
    json_object: bool = False
    # the constraint applies only once the output has written this text (a reasoning model's "</think>"):
    # what comes before it is free
    grammar_after: str | None = None

    def __post_init__(self) -> None:
        self.max_tokens = _integer("max_tokens", self.max_tokens)
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")

        for name, check in _CHECKS.items():
            value = getattr(self, name)
            if value is not None:  # None: unset, filled by `resolved`
                setattr(self, name, check(value))

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
        if self.prompt_logprobs is not None:
            self.prompt_logprobs = _integer("prompt_logprobs", self.prompt_logprobs)
            if not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
                raise ValueError(
                    f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}"
                )
        self.prompt_logprobs_start = _integer("prompt_logprobs_start", self.prompt_logprobs_start)
        if self.prompt_logprobs_start < 0:
            raise ValueError(f"prompt_logprobs_start must be non-negative, got {self.prompt_logprobs_start}")

        self.min_tokens = _integer("min_tokens", self.min_tokens)
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        self.logit_bias = _logit_bias(self.logit_bias)
        _check_structured(self)

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
    def structured(self) -> tuple[str, object] | None:
        """The structured-output constraint as (field name, value), or None when the output is free."""
        for name in STRUCTURED_FIELDS:
            value = getattr(self, name)
            if value not in (None, False):
                return name, value
        return None

    @property
    def unset(self) -> tuple[str, ...]:
        """The knobs left unset (None): the checkpoint's defaults, else the library's, fill them."""
        return tuple(name for name in CHECKPOINT_DEFAULTABLE if getattr(self, name) is None)

    def resolved(self, defaults: Mapping[str, float | int] | None = None) -> SamplingParams:
        """These params with every unset knob filled: from `defaults` (the checkpoint's, already checked
        with `check_sampling_value`) where it has the knob, else from ``LIBRARY_DEFAULTS``. Explicit
        values stay as they are; `self` itself when nothing is unset."""
        unset = self.unset
        if not unset:
            return self
        defaults = defaults or {}
        filled: dict[str, Any] = {name: defaults.get(name, LIBRARY_DEFAULTS[name]) for name in unset}
        return replace(self, **filled)

    def _value(self, name: str) -> float | int:
        """The knob's value as the request will sample with it if the checkpoint sets no default."""
        value = getattr(self, name)
        return LIBRARY_DEFAULTS[name] if value is None else value

    @property
    def greedy(self) -> bool:
        """True when the request always takes the argmax token (temperature 0 or top_k 1); of unset
        params, when they would be greedy without checkpoint defaults.

        Temperatures below ``GREEDY_TEMPERATURE_EPS`` count as 0, as in vLLM: dividing logits by
        them would overflow to inf, and the distribution they describe is the argmax anyway.
        """
        return self._value("temperature") < GREEDY_TEMPERATURE_EPS or self._value("top_k") == 1

    @property
    def has_penalties(self) -> bool:
        """True when any penalty is active, i.e. the sampler must track this request's tokens."""
        return (
            self._value("repetition_penalty") != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )
