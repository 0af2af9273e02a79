"""Prompt logprobs on the host side: which prompt positions an extend batch scores, how far the radix cache
may supply a scoring request's prefix, folding a processed batch's scores into its requests, and the
vLLM-shaped output (`RequestOutput.prompt_logprobs`).

The KV cache holds keys and values, not the hidden states logprobs come from: a request that wants the
logprob of prompt position s needs the forward of position s - 1. So its cached prefix is reused only
up to that position (SGLang's `logprob_start_len`), and the rest of the prompt is computed, chunk by
chunk under chunked prefill, each chunk scoring the positions it computes. Like the rest of a request's
state, `PromptLogprobState.next` moves when a batch is built; the scores reach the host with the
batch's sampled tokens, one step later under overlap, through the same deferred copy.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from gapless.engine.request import Extend, Req
from gapless.sampling.logprobs import PromptLogprob, PromptLogprobState, PromptScoreAsk
from gapless.sampling_params import SamplingParams


class ScoredReq(NamedTuple):
    """A request that scores prompt positions in an extend batch, and how many."""

    req: Req
    positions: int


Scored = list[ScoredReq]  # an extend batch's scoring requests


@dataclass(frozen=True)
class Logprob:
    """One token's entry in `RequestOutput.prompt_logprobs` (vLLM's `Logprob`)."""

    logprob: float
    rank: int  # 1: the most likely token
    decoded_token: str | None = None


def new_state(params: SamplingParams, prompt_len: int) -> PromptLogprobState | None:
    """The scoring state of a new request with a prompt of `prompt_len` tokens, or None when it asks for
    no prompt logprobs. A start past the prompt scores nothing (and is kept at its end, so the outputs
    that list every position up to it stay as long as the prompt)."""
    if params.prompt_logprobs is None:
        return None
    return PromptLogprobState.of(params.prompt_logprobs, min(params.prompt_logprobs_start, prompt_len))


def reuse_limit(req: Req) -> int:
    """How many leading tokens of `req` the prefix cache may supply: all but the last (whose logits are
    sampled from), and for a request still to score prompt positions, none at or past the one before
    its first unscored position (its hidden state is needed)."""
    limit = len(req.prompt_ids) + len(req.output_ids) - 1
    state = req.prompt_lp
    if state is not None and state.next < len(req.prompt_ids):
        limit = min(limit, state.next - 1)
    return limit


class ScorePlan(NamedTuple):
    """The prompt positions an extend batch scores: what the device computes, and per request how many."""

    ask: PromptScoreAsk | None  # None: the batch scores none
    scored: Scored


def plan_scores(entries: list[Extend]) -> ScorePlan:
    """What an extend batch of `entries` (request, tokens it computes; `kv_len` already advanced)
    scores: the flat indices and target tokens of the prompt positions its requests still need, and per
    scoring request how many. Advances each request's `next` (state moves at schedule time)."""
    index: list[torch.Tensor] = []
    targets: list[int] = []
    scored: Scored = []
    top_k, flat = 0, 0
    for req, n in entries:
        state = req.prompt_lp
        if state is not None:
            first = req.kv_len - n  # position of the chunk's first token
            lo, hi = state.next - 1, min(req.kv_len, len(req.prompt_ids) - 1)
            if hi > lo:
                assert lo >= first, "a scored position's hidden state came from the cache"
                index.append(torch.arange(flat + lo - first, flat + hi - first))
                targets += req.prompt_ids[lo + 1 : hi + 1]
                scored.append(ScoredReq(req, hi - lo))
                state.next = hi + 1
                top_k = max(top_k, state.top_k)
        flat += n
    if not scored:
        return ScorePlan(None, [])
    ask = PromptScoreAsk(torch.cat(index), torch.tensor(targets, dtype=torch.int64), top_k)
    return ScorePlan(ask, scored)


def fold_scores(scored: Scored, values: list[PromptLogprob] | None) -> None:
    """Add a processed batch's prompt scores to its requests (each cut to its own top k); a request
    that finished meanwhile (aborted) takes none."""
    if not scored:
        return
    assert values is not None, "a batch that scores prompt positions returned no scores"
    start = 0
    for req, n in scored:
        state = req.prompt_lp
        if state is not None and not req.finished:
            k = state.top_k
            state.values += [(lp, rank, top[:k]) for lp, rank, top in values[start : start + n]]
        start += n


def prompt_logprobs_output(
    req: Req, decode: Callable[[int], str] | None = None
) -> list[dict[int, Logprob] | None] | None:
    """vLLM's `prompt_logprobs` of a finished request: per prompt position, None where nothing was
    scored (the first token, positions before `prompt_logprobs_start`), else a dict from token id to
    `Logprob` holding the prompt token and the top k. `decode` gives each token's text."""
    state = req.prompt_lp
    if state is None:
        return None
    if decode is not None:  # a prompt of n tokens has up to n * (k + 1) entries: decode each id once
        decode = functools.cache(decode)
    out: list[dict[int, Logprob] | None] = [None] * state.start
    for pos, (lp, rank, top) in enumerate(state.values, start=state.start):
        tok = req.prompt_ids[pos]
        entry = {tok: Logprob(lp, rank, decode(tok) if decode else None)}  # the prompt token first
        for i, (tid, v) in enumerate(top):
            entry.setdefault(tid, Logprob(v, i + 1, decode(tid) if decode else None))
        out.append(entry)
    return out
