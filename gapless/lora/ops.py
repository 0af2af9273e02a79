"""The LoRA delta of a batch whose rows run different adapters: y += B[slot] A[slot] x per token, slot -1
adding nothing. On CUDA the gathered Triton kernels (`triton_kernels`); elsewhere torch, segmented by
adapter: the batch's tokens sorted by slot once per batch (`segments`, which reads the slots on the host,
as a CPU does for free), then in every layer one gather, a pair of GEMMs per adapter on its contiguous
segment, and one scatter-add back."""

from __future__ import annotations

from typing import NamedTuple

import torch


class Segments(NamedTuple):
    """A batch's adapter tokens sorted by slot: `order` (their indices, None when every token runs one
    adapter) and per adapter (slot, start, end) of its run in that order."""

    order: torch.Tensor | None
    spans: list[tuple[int, int, int]]


def segments(slots: torch.Tensor) -> Segments | None:
    """The batch's tokens grouped by adapter slot, the base model's (-1) left out; None: no adapter."""
    present, counts = torch.unique(slots, return_counts=True)
    keep = present >= 0
    if not bool(keep.any()):
        return None
    present, counts = present[keep].tolist(), counts[keep].tolist()
    if len(present) == 1 and counts[0] == slots.shape[0]:
        return Segments(None, [(present[0], 0, counts[0])])
    order = torch.argsort(slots, stable=True)[slots.shape[0] - sum(counts) :]  # (-1 sorts first)
    spans, start = [], 0
    for s, n in zip(present, counts):
        spans.append((s, start, start + n))
        start += n
    return Segments(order, spans)


def add_lora_torch(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, seg: Segments
) -> torch.Tensor:
    """y [T, N] += B[s] (A[s] x) for each adapter's tokens, in place; a [S, R, K], b [S, N, R]."""
    if seg.order is None:  # the whole batch runs one adapter: no gather, no scatter
        s = seg.spans[0][0]
        y += (x @ a[s].t()) @ b[s].t()
        return y
    xs = x.index_select(0, seg.order)
    delta = torch.empty(xs.shape[0], b.shape[1], dtype=y.dtype, device=y.device)
    for s, lo, hi in seg.spans:
        torch.mm(xs[lo:hi] @ a[s].t(), b[s].t(), out=delta[lo:hi])
    return y.index_add_(0, seg.order, delta)
