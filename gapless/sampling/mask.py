"""Token masks made on the host, applied on the device before sampling.

A grammar (structured output) or an unmet `min_tokens` forbids tokens per row and per step. The host
fills one bit per vocabulary column (xgrammar's layout: int32 words, bit j of word w is token 32 * w + j,
1 = allowed) for just the rows that need it; the device unpacks them with bulk tensor ops and sets the
forbidden logits to -inf, so greedy, seeded and filtered sampling all pick among the allowed tokens and
a seeded row still draws the same noise whatever else is in its batch. No host sync: the mask is an
input of the job like any other.
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

    index: torch.Tensor  # [m] int64: positions in the batch's sampled rows
    bits: torch.Tensor  # [m, mask_words(vocab)] int32, bit set = allowed


def apply_token_mask(logits: torch.Tensor, mask: TokenMask) -> torch.Tensor:
    """`logits` [S, V] with each masked row's forbidden tokens at -inf (a new tensor; float32)."""
    vocab = logits.shape[-1]
    cols = torch.arange(vocab, device=logits.device)
    words = mask.bits.index_select(1, cols // BITS)  # [m, V]
    allowed = words.bitwise_right_shift(cols % BITS).bitwise_and_(1).bool()
    out = logits.float().clone()
    rows = out.index_select(0, mask.index).masked_fill_(~allowed, float("-inf"))
    return out.index_copy_(0, mask.index, rows)
