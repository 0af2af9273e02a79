"""Token masks made on the host, applied on the device before sampling.

A grammar (structured output) or an unmet `min_tokens` forbids tokens per row and per step. The host
fills one bit per vocabulary column (xgrammar's layout: int32 words, bit j of word w is token 32 * w + j,
1 = allowed) for just the rows that need it; the device sets the forbidden logits to -inf in place with
xgrammar's kernel (C++ on the CPU, Triton/CUDA on a GPU: 2.5-6x faster here than unpacking the bits with
torch ops over a 150k vocabulary), so greedy, seeded and filtered sampling all pick among the allowed
tokens and a seeded row still draws the same noise whatever else is in its batch. No host sync: the mask
is an input of the job like any other (its row positions travel as a list too, as the kernel takes them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BITS = 32  # tokens per mask word


def mask_words(vocab_size: int) -> int:
    """Words per row of a mask over `vocab_size` tokens."""
    return -(-vocab_size // BITS)


@dataclass
class TokenMask:
    """The allowed tokens of some of a batch's sampled rows."""

    rows: list[int]  # the masked positions among the batch's sampled rows
    bits: torch.Tensor  # [sampled rows, mask_words(vocab)] int32, bit set = allowed (all, in other rows)


def apply_token_mask(logits: torch.Tensor, mask: TokenMask) -> torch.Tensor:
    """`logits` [S, V] (float32 and contiguous, else a converted copy) with each masked row's forbidden
    tokens at -inf, in place."""
    import xgrammar as xgr

    logits = logits.float().contiguous()
    xgr.apply_token_bitmask_inplace(logits, mask.bits, vocab_size=logits.shape[1], indices=mask.rows)
    return logits
