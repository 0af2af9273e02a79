"""The LoRA delta of a batch whose rows run different adapters: y += B[slot] A[slot] x per token, slot -1
adding nothing. On CUDA the gathered Triton kernels (`triton_kernels`); elsewhere torch, batched by
adapter: once per batch (`segments`, which reads the slots on the host, as a CPU does for free) the
adapter tokens are laid out sorted by slot on a grid of [adapters, longest run] (no copy when every
adapter has as many tokens, as in a decode of one row per adapter), and then every layer runs one
shrink and one expand as two batched GEMMs over the batch's adapters (`torch.bmm`, `baddbmm`), reading
each adapter's A and B once (a fused layer's B from its blocks stored apart, `Block`, while it is
block-diagonal: one expand per block, of its rows only); the base model's rows are skipped. A batch
whose runs are too uneven for the grid (a long prefill beside one-token decodes) runs one GEMM pair per
adapter on its run instead."""

from __future__ import annotations

from typing import NamedTuple

import torch

GRID_WASTE = 2  # the grid may hold up to this many times the adapter tokens (padding), else runs per adapter


class Segments(NamedTuple):
    """A batch's adapter tokens sorted by slot, and how each layer runs them.

    `order`: their indices in that order, None when they are already rows [start, start + n) of the
    batch in that order. `slots`: the adapters present, in order (a slice of the slot table when they
    are consecutive slots, so no adapter's weights are copied). `grid`: with `length` the longest run,
    the flat position of each sorted token in the [adapters, length] grid; None when every run has
    `length` tokens (the sorted tokens are the grid). `spans`: per adapter (slot, start, end) of its run,
    used in place of the grid when `uneven`."""

    order: torch.Tensor | None
    start: int
    n: int
    slots: slice | torch.Tensor
    length: int
    grid: torch.Tensor | None
    spans: list[tuple[int, int, int]]
    uneven: bool


def segments(slots: torch.Tensor) -> Segments | None:
    """The batch's tokens grouped by adapter slot, the base model's (-1) left out; None: no adapter."""
    present_t, counts_t = torch.unique(slots, return_counts=True)
    keep = present_t >= 0
    if not bool(keep.any()):
        return None
    present, counts = present_t[keep].tolist(), counts_t[keep].tolist()
    n, length = sum(counts), max(counts)
    sorted_ = torch.argsort(slots, stable=True)[slots.shape[0] - n :]  # (-1 sorts first)
    first = int(sorted_[0])
    # already in order (rows [first, first + n)): no gather, no scatter
    order, start = (None, first) if bool((sorted_ == torch.arange(first, first + n)).all()) else (sorted_, 0)
    spans, at = [], 0
    for s, c in zip(present, counts):
        spans.append((s, at, at + c))
        at += c
    lo = present[0]
    table: slice | torch.Tensor = (
        slice(lo, lo + len(present)) if present == list(range(lo, lo + len(present))) else present_t[keep]
    )
    grid = None
    if length * len(present) != n:  # uneven runs: each token's place in the padded grid
        starts = torch.tensor([sp[1] for sp in spans])
        seg = torch.repeat_interleave(torch.arange(len(present)), torch.tensor(counts))
        grid = seg * length + torch.arange(n) - starts[seg]
    uneven = length * len(present) > GRID_WASTE * n
    return Segments(order, start, n, table, length, grid, spans, uneven)


class Block(NamedTuple):
    """One rank block of a fused layer whose B is block-diagonal: its output rows [row, row + rows) and
    its own B [S, rows, r] (rank columns [j r, (j + 1) r) of the layer's for block j)."""

    row: int
    rows: int
    b: torch.Tensor


def add_lora_torch(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    seg: Segments,
    blocks: list[Block] | None = None,
) -> torch.Tensor:
    """y [T, N] += B[s] (A[s] x) for each adapter's tokens, in place; a [S, R, K], b [S, N, R].
    `blocks`: B is block-diagonal and each block's B is stored apart: each is expanded alone, reading
    only its rows (a fused q/k/v layer's third)."""
    xs = x.index_select(0, seg.order) if seg.order is not None else x[seg.start : seg.start + seg.n]
    if seg.uneven:
        delta = torch.empty(seg.n, b.shape[1], dtype=y.dtype, device=y.device)
        for s, lo, hi in seg.spans:
            torch.mm(xs[lo:hi] @ a[s].t(), b[s].t(), out=delta[lo:hi])
        return y.index_add_(0, seg.order, delta) if seg.order is not None else _add_rows(y, seg, delta)
    at = a[seg.slots]  # [P, R, K]: a view for consecutive slots
    p, k = at.shape[0], x.shape[1]
    if seg.grid is not None:
        xs = xs.new_zeros(p * seg.length, k).index_copy_(0, seg.grid, xs)
    v = torch.bmm(xs.view(p, seg.length, k), at.transpose(1, 2))  # [P, L, R]
    in_place = seg.order is None and seg.grid is None and y.is_contiguous()  # y's rows are the grid
    if blocks is None:
        if in_place:
            y[seg.start : seg.start + seg.n].view(p, seg.length, -1).baddbmm_(v, b[seg.slots].transpose(1, 2))
            return y
        delta = torch.bmm(v, b[seg.slots].transpose(1, 2)).view(p * seg.length, -1)
    else:
        delta = y[seg.start : seg.start + seg.n] if in_place else y.new_zeros(p * seg.length, y.shape[1])
        grid, r = delta.view(p, seg.length, -1), a.shape[1] // len(blocks)
        for j, blk in enumerate(blocks):
            part = torch.bmm(v[:, :, j * r : (j + 1) * r], blk.b[seg.slots].transpose(1, 2))
            grid[:, :, blk.row : blk.row + blk.rows] += part
        if in_place:
            return y
    if seg.grid is not None:
        delta = delta.index_select(0, seg.grid)
    return y.index_add_(0, seg.order, delta) if seg.order is not None else _add_rows(y, seg, delta)


def _add_rows(y: torch.Tensor, seg: Segments, delta: torch.Tensor) -> torch.Tensor:
    y[seg.start : seg.start + seg.n] += delta
    return y
