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
    # [T] int64: each token's request's min_tokens where the batch masks stop tokens (0 elsewhere); the
    # device lifts the mask where the true output step reached it. None: no such request in the batch
    min_tokens: torch.Tensor | None = None


@dataclass
class HistoryWrites:
    """Tokens an extend batch enters into its rows' token history (the prompt, or the part of it this
    chunk computes; a request entering its row also brings its cached prefix), so drafts can be looked
    up in it."""

    rows: torch.Tensor  # [H] int64
    positions: torch.Tensor  # [H] int64
    tokens: torch.Tensor  # [H] int64
