"""Drafting under a grammar (n-gram speculation): a constrained request's verify positions are masked with
the grammar's state after each of its drafts, so the target accepts drafts up to the first one the
grammar refuses, and the tokens are those of decoding under the grammar.

The drafts are computed on the device, from the row's tokens, when the verify's forward runs; the masks
are made on the host. Under overlap a grammar request's mask is made when every batch before it has been
processed (`gapless.engine.scheduler.masks`: at launch, or in the deferred sampling job), so the host then
holds exactly the tokens the device drafts from (the prompt and every processed output token) and repeats
the same lookup on them (`ngram_drafts`, on the CPU): its drafts are the device's. The matcher takes
each draft in turn, giving the mask of the next position, and is rolled back afterwards: it advances only
with processed tokens. A position after a draft the grammar refuses (or after one that ends it) allows
every token: the target cannot pick that draft under the mask before it, so no later position is
accepted.

Only n-gram drafts are repeated on the host; under a draft model a grammar request drafts nothing (the
host would have to wait for the drafts of a step still running). Nor does a request draft while its
grammar waits for `grammar_after` text, or below its `min_tokens` (the mask's stop-token part depends on
the exact step).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from gapless.engine.spec.ngram import ngram_drafts

if TYPE_CHECKING:
    from gapless.engine.request import Req
    from gapless.engine.scheduler.masks import MaskedRow


def can_draft(req: Req) -> bool:
    """Whether `req`'s grammar lets it draft (n-gram): no `grammar_after` pending, not ended, and no
    `min_tokens` to keep."""
    g = req.grammar
    return g is not None and g.after is None and not g.ended and req.params.min_tokens == 0


def host_drafts(req: Req, k: int) -> list[int]:
    """The `k` n-gram drafts the device takes for `req` now: looked up in its prompt and processed output,
    as `SpecState` does on the device, with the (ngram_min, ngram_max) its verify set on its grammar."""
    assert req.grammar is not None and req.grammar.ngram is not None
    ngram = req.grammar.ngram
    history = torch.tensor([[*req.prompt_ids, *req.output_ids]], dtype=torch.int64)
    lens = torch.tensor([history.shape[1]], dtype=torch.int64)
    return ngram_drafts(history, lens, k, *ngram)[0].tolist()


def fill_grammars(bits: torch.Tensor, masked: Sequence[MaskedRow]) -> None:
    """Fill the grammar rows of a batch's mask `bits` (int32 [rows, words], all allowed): a request's one
    sampled position gets its grammar's next tokens; the consecutive positions of a verify with drafts
    get the grammar's state after each draft (see the module). `masked`: the batch's masked positions, in
    order (each request's contiguous)."""
    runs: dict[int, tuple[Req, list[int]]] = {}
    for i, req, _ in masked:
        if req.grammar is not None and not req.finished:
            runs.setdefault(id(req), (req, []))[1].append(i)
    for req, rows in runs.values():
        assert req.grammar is not None
        drafts = host_drafts(req, len(rows) - 1) if len(rows) > 1 else []
        req.grammar.fill_run(bits, rows[0], drafts)
