"""The torch path's top-k, top-p and min-p: masks (to -inf) on a batch's temperature-scaled float32 logits.

Sorting rules first (`apply_top_k_top_p`: the whole vocabulary sorted), then the ways around the sort that
keep the same tokens: a partial sort where the batch's top-k bounds what the filters keep, the nucleus
kernel (`gapless.sampling.triton_nucleus`) where it does not. On CUDA the sampler's draw kernel
(`gapless.sampling.triton_sample`) applies the same rules itself, without any of these.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# top-k uses a partial sort (`torch.topk`) up to this k; past it a full sort costs about the same. Top-p
# uses one when each top-p row's top-k is at most this: its nucleus is then computed over the row's this
# many largest logits, on either path (`apply_top_k_top_p_partial`), so the rounding of the softmax and
# cumulative sum behind a seeded draw does not depend on which path the row's batch took.
PARTIAL_SORT_MAX_K = 1024
# `triton_nucleus.nucleus_floor`'s signature: (logits [B, V], top_p [B]) -> each row's nucleus floor [B, 1]
NucleusKernel = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k, then outside its top-p nucleus, by sorting the
    whole vocabulary: the path for batches with a top-p row whose nucleus may be anywhere (no top-k, or
    one past PARTIAL_SORT_MAX_K); `apply_top_k_top_p_partial` is the same rule on the largest logits alone.

    Same rule as Hugging Face's warpers and vLLM: top-k keeps every token tied with the k-th largest;
    top-p drops tokens whose ascending cumulative probability is <= 1 - p, always keeping the largest.
    Both become a per-row floor on the logit (`_nucleus_floor`), so a token tied with the nucleus' smallest
    is kept too. Rows with k = vocab and p = 1 come out unchanged. ``logits`` is modified in place.
    """
    ascending = logits.sort(dim=-1, descending=False).values
    vocab = logits.shape[-1]
    floor = _top_k_floor(ascending, top_k, vocab, ascending=True) if top_k is not None else None
    if floor is not None:
        ascending.masked_fill_(ascending < floor, float("-inf"))
    if top_p is not None:
        nucleus = _nucleus_floor(ascending, top_p)
        if top_k is not None and vocab > PARTIAL_SORT_MAX_K:
            # a row whose top-k bounds its nucleus computes it over its largest logits alone, exactly as
            # `apply_top_k_top_p_partial` does, so it keeps the same tokens whichever path its batch takes
            window = _nucleus_floor(ascending[:, -PARTIAL_SORT_MAX_K:], top_p)
            nucleus = torch.where((top_k <= PARTIAL_SORT_MAX_K).unsqueeze(1), window, nucleus)
        floor = nucleus if floor is None else torch.maximum(floor, nucleus)
    return logits if floor is None else logits.masked_fill_(logits < floor, float("-inf"))


def apply_top_k_top_p_partial(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """`apply_top_k_top_p` for batches whose top-p rows all have a top-k <= PARTIAL_SORT_MAX_K (and whose
    other rows' top-k is no larger): their nucleus lies among their k largest logits, so each row's
    PARTIAL_SORT_MAX_K largest (`torch.topk`, a partial sort) replace the sort of the vocabulary.

    The same tokens as the full sort, not merely the same rule: the nucleus is computed over the same
    PARTIAL_SORT_MAX_K values in the same order, which the full sort takes from the end of its sorted row
    for these rows (a fixed width, whatever the batch, so a row's tokens never depend on its batch)."""
    vocab = logits.shape[-1]
    largest = logits.topk(min(PARTIAL_SORT_MAX_K, vocab), dim=-1).values  # [B, C], descending
    floor = _top_k_floor(largest, top_k, vocab)
    ascending = largest.flip(-1)
    ascending.masked_fill_(ascending < floor, float("-inf"))
    floor = torch.maximum(floor, _nucleus_floor(ascending, top_p))
    return logits.masked_fill_(logits < floor, float("-inf"))


def apply_top_k_top_p_searched(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor,
    max_top_k: int,
    nucleus: NucleusKernel,
) -> torch.Tensor:
    """`apply_top_k_top_p` without sorting the vocabulary, where the nucleus kernel runs
    (`gapless.sampling.triton_nucleus`; vocabularies past PARTIAL_SORT_MAX_K). With `top_k` (None: no row
    filters by it), each row's k-th largest logit comes from a partial sort of the batch's `max_top_k`
    largest (at least PARTIAL_SORT_MAX_K), and a row whose top-k is at most PARTIAL_SORT_MAX_K takes its
    nucleus from those largest logits as `apply_top_k_top_p_partial` does, so it keeps the same tokens
    whichever path its batch takes. Every other row's nucleus comes from the kernel, over the tokens its
    top-k kept: the sort's rule, rounded as the kernel rounds (so, on a device with the kernel, always
    the same way for that row too). ``logits`` is modified in place."""
    if top_k is None:
        return logits.masked_fill_(logits < nucleus(logits, top_p), float("-inf"))
    vocab = logits.shape[-1]
    largest = logits.topk(min(max(max_top_k, PARTIAL_SORT_MAX_K), vocab), dim=-1).values  # descending
    floor = _top_k_floor(largest, top_k, vocab)
    window = largest[:, :PARTIAL_SORT_MAX_K].flip(-1)
    window.masked_fill_(window < floor, float("-inf"))
    logits.masked_fill_(logits < floor, float("-inf"))  # the kernel sums the kept tokens' mass alone
    in_window = top_k <= PARTIAL_SORT_MAX_K
    searched = nucleus(logits, top_p.masked_fill(in_window, 1.0))  # (top-p 1: no search)
    floor = torch.maximum(floor, torch.where(in_window.unsqueeze(1), _nucleus_floor(window, top_p), searched))
    return logits.masked_fill_(logits < floor, float("-inf"))


def _top_k_floor(
    sorted_logits: torch.Tensor, top_k: torch.Tensor, vocab: int, ascending: bool = False
) -> torch.Tensor:
    """[B, 1]: each row's k-th largest logit, from its largest logits in descending order (at least its
    k of them), or with `ascending` from the whole row sorted ascending; -inf where top-k is off (k >=
    vocab)."""
    k = top_k.clamp(1, vocab)
    index = vocab - k if ascending else k.clamp(max=sorted_logits.shape[1]) - 1
    kth = sorted_logits.gather(1, index.unsqueeze(1))
    return kth.masked_fill_((k >= vocab).unsqueeze(1), float("-inf"))


def _nucleus_floor(ascending: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[B, 1]: the smallest logit of each row's top-p nucleus (-inf where p >= 1), from logits sorted
    ascending (a whole row, or its largest ones when they hold the nucleus): tokens are dropped while the
    ascending cumulative probability is <= 1 - p; the largest is always kept."""
    cumulative = ascending.softmax(dim=-1).cumsum_(dim=-1)
    drop = cumulative <= (1.0 - top_p).unsqueeze(1)
    drop[:, -1] = False
    # the first kept position holds the smallest kept logit (argmax: the first 1 of a uint8 view, no new
    # float [B, V] tensor; the first even if rounding made the dropped positions no prefix)
    first = drop.logical_not_().view(torch.uint8).argmax(dim=-1, keepdim=True)
    floor = ascending.gather(1, first)
    return floor.masked_fill_((top_p >= 1.0).unsqueeze(1), float("-inf"))


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, max_k: int) -> torch.Tensor:
    """`apply_top_k_top_p` without top-p, with a partial sort: each row's k-th largest logit is found
    among the batch's `max_k` largest (`torch.topk`), not by sorting the vocabulary. The same threshold
    value, so the same tokens are masked (every token tied with the k-th largest is kept); rows with top-k
    off (k >= vocab) keep everything. ``logits`` is modified in place."""
    largest = logits.topk(min(max_k, logits.shape[-1]), dim=-1).values  # [B, max_k], descending
    return logits.masked_fill_(logits < _top_k_floor(largest, top_k, logits.shape[-1]), float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below ``min_p`` times the row's top probability (in place).

    Decided in log space, ``p / p_max = exp(logit - max_logit)``: a token is kept when ``logit >= max_logit
    + log(min_p)``, which needs a bool [B, V] mask and no float one (the softmax made one). It can differ
    from the rule on probabilities only where rounding puts a token at the threshold. Rows with min_p 0
    (log: -inf) keep everything; so does a row of -inf logits (-inf + -inf is -inf: no NaN)."""
    floor = logits.amax(dim=-1, keepdim=True).add_(min_p.log().unsqueeze(1))
    return logits.masked_fill_(logits < floor, float("-inf"))
