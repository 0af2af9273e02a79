"""N-gram (prompt-lookup) drafting on the device, in bulk: no host sync, no per-request Python.

A request's next tokens are guessed by finding its latest n tokens earlier in its own prompt and output
and proposing what followed them there (vLLM's and SGLang's "ngram" speculation). The longest n in
[n_min, n_max] that matches wins; among its matches, the latest. Copy-heavy prompts ("repeat this text",
code edits, quoting) make such guesses right most of the time.
"""

from __future__ import annotations

import torch


def ngram_drafts(tokens: torch.Tensor, lens: torch.Tensor, k: int, n_min: int, n_max: int) -> torch.Tensor:
    """Drafts [B, k] for B requests whose tokens are `tokens[b, :lens[b]]` ([B, W] int64, W >= every
    len; the columns past a request's length are ignored).

    Where no n-gram matches, a request drafts its last token repeated: a guess like any other (the
    verify rejects it), which keeps the batch's shape fixed without a sync."""
    b, w = tokens.shape
    cols = torch.arange(w, device=tokens.device)
    start = lens - 1  # where the continuation starts; no match: the last token
    for n in range(n_min, n_max + 1):
        if n >= w:
            break
        span = w - n  # candidate match starts j in [0, span): the match must end before the suffix starts
        suffix = tokens.gather(1, (lens[:, None] - n + cols[None, :n]).clamp(min=0))
        match = tokens[:, :span] == suffix[:, :1]
        for i in range(1, n):
            match &= tokens[:, i : span + i] == suffix[:, i : i + 1]
        # a match at j must end before the suffix itself starts: j + n <= lens - 1
        match &= cols[None, :span] < (lens - n)[:, None]
        latest = torch.where(match, cols[None, :span], -1).amax(dim=1)
        start = torch.where(latest >= 0, latest + n, start)
    index = torch.minimum(start[:, None] + cols[None, :k], (lens - 1)[:, None])
    return tokens.gather(1, index)
