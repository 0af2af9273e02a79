"""Sampling settings per request-table row, set once when a request is admitted.

A request's sampling settings do not change while it runs, so they are not rebuilt per step: when a
request enters a row, `RowParams.build` turns its `SamplingParams` into the values the sampler uses
(shipped with that batch and written into the sampler's per-row state on the device, in stream order)
and into the stages the row needs (kept on the host in `RowStages`, which tells each batch which stages
to run without a device sync). A step then ships only its rows and their step counts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from gapless.sampling_params import SamplingParams

# the per-row values, in the order of `RowParams.floats` and `RowParams.ints`
FLOAT_FIELDS = (
    "temperature",  # 0 marks a greedy row
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)
INT_FIELDS = ("top_k", "seed", "penalised")  # top_k "disabled" is vocab_size; penalised: 1 or 0
# the stages a row may need: bit i of a row's stages is STAGES[i]
# bias: the row has a logit_bias (kept per row on the device); mask: the host ships a token mask for the
# row's steps (a grammar, or min_tokens not reached yet: `gapless.engine.grammar`)
STAGES = ("greedy", "top_k", "top_p", "min_p", "penalties", "bias", "mask")


def as_int64(value: int) -> int:
    """Wrap any Python int into int64 range (seeds are arbitrary ints; only 64 bits of them count)."""
    return ((value + (1 << 63)) % (1 << 64)) - (1 << 63)


def row_values(p: SamplingParams, seed: int, k_off: int) -> tuple[list[float], list[int], list[bool]]:
    """One request's (floats, ints, stages), in `FLOAT_FIELDS`, `INT_FIELDS` and `STAGES` order.

    A greedy row carries temperature 0 and neutral filter settings, so the device can tell it apart
    without another value and its settings never switch a stage on; `k_off` is the top_k that means
    "disabled" (the vocabulary size), so a top_k at or above it forces no sort."""
    temperature, top_p, top_k, min_p, repetition = (
        p.temperature,
        p.top_p,
        p.top_k,
        p.min_p,
        p.repetition_penalty,
    )
    if temperature is None or top_p is None or top_k is None or min_p is None or repetition is None:
        raise ValueError(
            f"row_values takes resolved SamplingParams (SamplingParams.resolved); unset: {p.unset}"
        )
    penalties = [repetition, p.presence_penalty, p.frequency_penalty]
    penalised = p.has_penalties
    extra = [p.logit_bias is not None, p.structured is not None or p.min_tokens > 0]
    if p.greedy:
        floats, k = [0.0, 1.0, 0.0, *penalties], k_off
        stages = [True, False, False, False, penalised, *extra]
    else:
        floats = [temperature, top_p, min_p, *penalties]
        k = k_off if top_k == -1 else min(top_k, k_off)
        stages = [False, k < k_off, top_p < 1.0, min_p > 0.0, penalised, *extra]
    return floats, [k, as_int64(seed), int(penalised)], stages


@dataclass(frozen=True)
class SampleFlags:
    """Which sampling stages a batch needs: decided on the host, so the device skips the others without
    reading anything back."""

    all_greedy: bool
    any_greedy: bool
    need_top_k: bool
    need_top_p: bool
    need_min_p: bool
    need_penalties: bool
    num_logprobs: int = -1  # top logprobs to return per row (the batch's largest ask); -1: none
    need_bias: bool = False
    need_mask: bool = False  # host side: some row may need a token mask (the batch carries it)
    # the largest top_k of the rows that filter by it, when the host knows it (0: unknown): top-k alone
    # then finds each row's k-th largest logit with a partial sort (`torch.topk`) instead of a full one
    max_top_k: int = 0
    # the largest top_k of the rows that filter by top-p (those without one: the vocabulary size), when the
    # host knows it (0: unknown): top-p then finds its nucleus among the top-k candidates (`torch.topk`)
    max_top_p_k: int = 0

    @classmethod
    def of(cls, stages: np.ndarray, logprobs: np.ndarray, top_k: np.ndarray | None = None) -> SampleFlags:
        """The flags of a batch whose rows need `stages` ([n] uint8, bit i set: `STAGES[i]`) and ask for
        `logprobs` ([n] int, -1: none), with their `top_k` ([n]) when known."""
        if not len(stages):
            return cls(False, False, False, False, False, False)
        some, every = int(np.bitwise_or.reduce(stages)), int(np.bitwise_and.reduce(stages))
        max_top_k = 0
        if top_k is not None and some & 2:
            max_top_k = int(top_k[(stages & 2) != 0].max())
        max_top_p_k = int(top_k[(stages & 4) != 0].max()) if top_k is not None and some & 4 else 0
        return cls(
            all_greedy=bool(every & 1),
            any_greedy=bool(some & 1),
            need_top_k=bool(some & 2),
            need_top_p=bool(some & 4),
            need_min_p=bool(some & 8),
            need_penalties=bool(some & 16),
            num_logprobs=int(logprobs.max()),
            need_bias=bool(some & 32),
            need_mask=bool(some & 64),
            max_top_k=max_top_k,
            max_top_p_k=max_top_p_k,
        )


@dataclass
class RowParams:
    """The sampling values of requests entering request-table rows (host tensors; the batch that admits
    them carries these to the device, where `Sampler.write_rows` keeps them per row)."""

    rows: torch.Tensor  # [A] int64
    floats: torch.Tensor  # [len(FLOAT_FIELDS), A] float32
    ints: torch.Tensor  # [len(INT_FIELDS), A] int64
    # (row, {token: bias}) of the admitted requests that have a logit_bias
    logit_bias: list[tuple[int, dict[int, float]]] = field(default_factory=list)

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        rows: Sequence[int],
        seeds: Sequence[int],
        vocab_size: int | None = None,
    ) -> tuple[RowParams, np.ndarray, np.ndarray]:
        """The values of `params` for `rows` (with their effective `seeds`), and the rows' stages ([A]
        uint8, bit i: `STAGES[i]`) and logprobs asks ([A], -1: none) for the host's `RowStages`.
        `vocab_size`, when given, makes top_k >= vocab count as disabled."""
        k_off = vocab_size if vocab_size is not None else (1 << 31) - 1
        values = [row_values(p, s, k_off) for p, s in zip(params, seeds, strict=True)]
        n = len(values)
        floats = torch.tensor([v[0] for v in values], dtype=torch.float32).reshape(n, -1).T
        ints = torch.tensor([v[1] for v in values], dtype=torch.int64).reshape(n, -1).T
        bits = np.array([v[2] for v in values], dtype=np.uint8).reshape(n, len(STAGES))
        stages = (bits << np.arange(len(STAGES), dtype=np.uint8)).sum(axis=1, dtype=np.uint8)
        logprobs = np.array([-1 if p.logprobs is None else p.logprobs for p in params], dtype=np.int64)
        row_t = torch.tensor(list(rows), dtype=torch.int64)
        bias = [(r, p.logit_bias) for p, r in zip(params, rows) if p.logit_bias is not None]
        return cls(row_t, floats.contiguous(), ints.contiguous(), bias), stages, logprobs


class RowStages:
    """The host's copy of what each request-table row's sampling needs (`STAGES`, logprobs), so a batch's
    `SampleFlags` come from a gather over its rows instead of a loop over its requests."""

    def __init__(self, num_rows: int) -> None:
        self.stages = np.zeros(num_rows, dtype=np.uint8)  # bit i: the row needs STAGES[i]
        self.logprobs = np.full(num_rows, -1, dtype=np.int64)
        self.top_k = np.zeros(num_rows, dtype=np.int64)  # the row's top_k (as `RowParams.ints[0]`)

    def set(
        self, rows: torch.Tensor, stages: np.ndarray, logprobs: np.ndarray, top_k: torch.Tensor | None = None
    ) -> None:
        """Keep the stages, logprobs asks and (when given: `RowParams.ints[0]`) top_k of `rows`."""
        r = rows.numpy()
        self.stages[r] = stages
        self.logprobs[r] = logprobs
        # unknown: as large as can be, so a batch with such a row falls back to the full sort
        self.top_k[r] = top_k.numpy() if top_k is not None else np.iinfo(np.int64).max

    def flags(self, rows: np.ndarray) -> SampleFlags:
        """The flags of a batch sampling for `rows`."""
        return SampleFlags.of(self.stages[rows], self.logprobs[rows], self.top_k[rows])
