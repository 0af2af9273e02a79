"""The speculative-decoding fields of a `ForwardBatch` (host-built, moved to the device with the batch)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class VerifyInputs:
    """What a verify batch adds to its `ForwardBatch`. Request b runs `extend_lens[b]` = 1 + drafts
    tokens: its last accepted token (offset 0), then its drafts. Positions, KV slots, input ids and
    sampling steps are not here: the device reads them from what the previous step accepted
    (`SpecState.prepare`)."""

    batch_index: torch.Tensor  # [T] int64: which request of the batch each token belongs to
    offsets: torch.Tensor  # [T] int64: its offset among its request's tokens
    max_drafts: int  # the most drafts any request of the batch tries (columns of the draft grid)
    ngram_min: int
    ngram_max: int
    # [T] int64: the output step below which each token's mask is kept (its request's min_tokens, int64
    # max for a grammar's, 0 where none); the device lifts a mask where the true step reached it. None:
    # no masked token in the batch
    keep_mask_below: torch.Tensor | None = None


@dataclass
class HistoryWrites:
    """Tokens an extend batch enters into its rows' token history (the prompt, or the part of it this
    chunk computes; a request entering its row also brings its cached prefix), so drafts can be looked
    up in it."""

    rows: torch.Tensor  # [H] int64
    positions: torch.Tensor  # [H] int64
    tokens: torch.Tensor  # [H] int64
