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

# Logits per piece: 40 MiB in float32. Over 32 MiB on purpose: glibc's malloc serves a block that large
# from a mapping of its own and unmaps it when freed (its dynamic mmap threshold stops at 32 MiB), so
# on the CPU the pieces never pile up as heap fragments (measured over 2,048 positions of a 151,936-token
# vocabulary: 32 MiB pieces allocating their own results left the process's resident memory 2.4 GB
# higher; these pieces writing into results made once (`score_prompt`), ~0.1 GB).
PIECE_ELEMENTS = 10 << 20


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
    the LM head, `vocab` the real vocabulary (padded logit columns beyond it are dropped).

    Pieces of about `PIECE_ELEMENTS` logits bound the memory. The results and the rank mask are allocated
    once, before the first piece, and each piece writes into them (`out=`), so the only allocations per
    piece are its logits and their log-softmax, which glibc maps and unmaps whole (see PIECE_ELEMENTS).
    The piece size depends on shapes only, never on data, so nothing here waits for the device."""
    n, k, dev = ask.index.shape[0], ask.top_k, hidden.device
    out = PromptScores(
        torch.empty(n, dtype=torch.float32, device=dev),
        torch.empty(n, dtype=torch.int64, device=dev),
        torch.empty(n, k, dtype=torch.int64, device=dev),
        torch.empty(n, k, dtype=torch.float32, device=dev),
    )
    rows = min(n, -(-PIECE_ELEMENTS // vocab))  # at least PIECE_ELEMENTS per whole piece (see above)
    more = torch.empty(rows, vocab, dtype=torch.bool, device=dev)  # tokens more likely than the prompt's
    for start in range(0, n, rows):
        end = min(n, start + rows)
        logprobs = logits_fn(hidden[ask.index[start:end]])[:, :vocab].float().log_softmax(dim=-1)
        token_lp = out.logprobs[start:end, None]
        torch.gather(logprobs, 1, ask.targets[start:end, None], out=token_lp)
        torch.gt(logprobs, token_lp, out=more[: end - start])
        torch.sum(more[: end - start], dim=-1, out=out.ranks[start:end])
        if k:
            torch.topk(logprobs, k, dim=-1, out=(out.top_logprobs[start:end], out.top_ids[start:end]))
        del logprobs
    out.ranks.add_(1)
    return out


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
