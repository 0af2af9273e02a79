"""Prompt logprobs on the device: each scored prompt token's logprob and rank, and the top k of its position.

A request that asks for prompt logprobs (`SamplingParams.prompt_logprobs`) needs the distribution at
every prompt position, not just the last one. Its extend batches carry a `PromptScoreAsk`: the flat
indices of the positions to score and the token that follows each. `score_prompt` runs the LM head over
those positions in pieces of at most `PIECE_ELEMENTS` logits, keeping per position only the gathered
token logprob, its rank and the top k, so the scratch memory is bounded whatever the prompt length
(`PIECE_ELEMENTS` float32 logits and their log-softmax, ~2 x 32 MiB, plus a mask of a quarter that), while
a whole `[tokens, vocab]` float32 matrix of a 32k prompt and a 150k vocabulary would be 19 GB.

The logprobs are those of the model's raw distribution (before temperature, penalties and filters), as
vLLM's default `prompt_logprobs` are. Everything here runs inside the device job, with no host read.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

PIECE_ELEMENTS = 1 << 23  # logits per piece: 32 MiB in float32, whatever the vocabulary


@dataclass
class PromptScoreAsk:
    """What an extend batch scores: flat token indices whose next-token distribution is wanted, the
    token that follows each (its logprob and rank are returned) and the batch's largest top-k ask."""

    index: torch.Tensor  # [P] int64, flat indices into the batch's tokens
    targets: torch.Tensor  # [P] int64, the prompt token at the next position
    top_k: int


@dataclass
class PromptScores:
    """`score_prompt`'s result, on the device: per scored position, in the ask's order."""

    logprobs: torch.Tensor  # [P] float32: the prompt token's logprob
    ranks: torch.Tensor  # [P] int64: 1 + how many tokens are more likely than it
    top_ids: torch.Tensor  # [P, k] int64, most likely first
    top_logprobs: torch.Tensor  # [P, k] float32

    def tensors(self) -> list[torch.Tensor]:
        return [self.logprobs, self.ranks, self.top_ids, self.top_logprobs]


# One scored prompt position on the host: (logprob of the prompt token, its rank, [(id, logprob)] top k)
PromptLogprob = tuple[float, int, list[tuple[int, float]]]


def host_scores(tensors: list[torch.Tensor]) -> list[PromptLogprob]:
    """`PromptScores.tensors()` (or host copies of them, same order) as one entry per position."""
    lps, ranks, ids, tops = (t.tolist() for t in tensors)
    return [(lp, r, list(zip(i, t))) for lp, r, i, t in zip(lps, ranks, ids, tops)]


def score_prompt(
    hidden: torch.Tensor, logits_fn: Callable[[torch.Tensor], torch.Tensor], ask: PromptScoreAsk, vocab: int
) -> PromptScores:
    """Score the positions `ask` names: `hidden` [T, H] is the batch's final hidden states, `logits_fn`
    the LM head, `vocab` the real vocabulary (padded logit columns beyond it are dropped). Pieces of at
    most `PIECE_ELEMENTS` logits bound the memory; the piece size depends on shapes only, never on data,
    so nothing here waits for the device."""
    rows = max(1, PIECE_ELEMENTS // vocab)
    parts: list[PromptScores] = []
    for start in range(0, ask.index.shape[0], rows):
        index, targets = ask.index[start : start + rows], ask.targets[start : start + rows]
        logprobs = logits_fn(hidden[index])[:, :vocab].float().log_softmax(dim=-1)
        token_lp = logprobs.gather(1, targets[:, None])
        ranks = (logprobs > token_lp).sum(dim=-1).add_(1)
        top_lp, top_ids = (
            logprobs.topk(ask.top_k, dim=-1) if ask.top_k else (logprobs[:, :0], ranks[:, None][:, :0])
        )
        parts.append(PromptScores(token_lp.squeeze(1), ranks, top_ids, top_lp))
        del logprobs
    if len(parts) == 1:
        return parts[0]
    return PromptScores(*(torch.cat(ts) for ts in zip(*(p.tensors() for p in parts))))


@dataclass
class PromptLogprobState:
    """A request's prompt logprobs as they are scored (host side). Positions [start, len(prompt)) are
    scored, in order; `next` is the first one no launched batch scores yet (it moves when a batch is
    built, as the rest of a request's state does). Position 0 has no logprob: nothing precedes it."""

    top_k: int
    start: int  # first scored position, >= 1
    next: int
    values: list[PromptLogprob] = field(default_factory=list)

    @classmethod
    def of(cls, top_k: int, start: int) -> PromptLogprobState:
        first = max(1, start)
        return cls(top_k, first, first)
