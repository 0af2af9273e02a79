"""What every attention backend sees of a batch.

A batch is ragged: request b contributes `extend_lens[b]` new tokens (1 in decode) that attend, causally,
to its `prefix_lens[b]` cached tokens and to each other. Keys and values are read through the request
table: token j of request b lives in KV slot `req_table[rows[b], j]`. With `q_limits`, a query may see
past itself, up to a bound of its own (an image's tokens in Gemma 3, which see their whole image).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass
class AttentionMetadata:
    rows: torch.Tensor  # [B] int64: request-table row of each request
    prefix_lens: torch.Tensor  # [B] int64: tokens already in the KV cache before this batch
    extend_lens: torch.Tensor  # [B] int64: new tokens of this batch
    q_start: torch.Tensor  # [B] int64: offset of each request's first new token in the flat batch
    req_table: torch.Tensor  # [rows, max_context] int32, on the device
    max_extend_len: int  # host-side maxima, so no kernel launch needs a device->host sync
    max_seq_len: int
    is_decode: bool
    # max_seq_len is a capacity (a CUDA graph's, fixed at capture), not the longest request's length
    static: bool = False
    # [T] int64 or None (causal): per flat token, the last position it attends to (>= its own, within its
    # request's new tokens): an image's tokens in a decoder that attends over images both ways see the
    # image's last token. An extend's alone; a sliding window still counts back from the token's own position
    q_limits: torch.Tensor | None = None

    @property
    def seq_lens(self) -> torch.Tensor:
        return self.prefix_lens + self.extend_lens

    @property
    def batch_size(self) -> int:
        return self.rows.shape[0]


class AttentionBackend(Protocol):
    def prepare(self, meta: AttentionMetadata) -> Any:
        """Per-batch work shared by all layers (index tensors, masks); the result is passed to `forward`."""

    def forward(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        state: Any,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q: [T, heads, d]; caches: [slots, kv_heads, d]; returns [T, heads, d]. The new tokens' K/V are
        already stored in the cache when this is called. An fp8 (e4m3) cache comes with `k_scale` and
        `v_scale` ([1] fp32 device tensors): key j is `k_cache[j] * k_scale`, and so for values.
        `window`: a query at position p attends only to keys at positions > p - window (a sliding-window
        layer); `softcap`: scores s become softcap * tanh(s / softcap) before the mask and softmax
        (Gemma 2). A backend that lacks either raises NotImplementedError naming it."""


def softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """Gemma 2's soft-capping of attention scores and logits, cap * tanh(x / cap), computed in the order
    transformers computes it; x itself when `cap` is None."""
    return x if cap is None else torch.tanh(x / cap) * cap
