"""The LoRA delta of a batch whose rows run different adapters: y += B[slot] A[slot] x per token, slot -1
adding nothing. On CUDA the gathered Triton kernels (`triton_kernels`); elsewhere torch, segmented by slot:
the batch's tokens grouped by adapter once (`slot_groups`, which reads the slots on the host, as a CPU
does for free), then one pair of GEMMs per adapter in every layer."""

from __future__ import annotations

from typing import NamedTuple

import torch


class SlotGroup(NamedTuple):
    """The tokens of a batch that run one adapter: its slot, and their indices (None: every token)."""

    slot: int
    index: torch.Tensor | None


def slot_groups(slots: torch.Tensor) -> list[SlotGroup]:
    """The batch's tokens grouped by adapter slot, the base model's (-1) left out."""
    present = [s for s in torch.unique(slots).tolist() if s >= 0]
    if len(present) == 1 and bool((slots == present[0]).all()):
        return [SlotGroup(present[0], None)]
    return [SlotGroup(s, (slots == s).nonzero().squeeze(1)) for s in present]


def add_lora_torch(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, groups: list[SlotGroup]
) -> torch.Tensor:
    """y [T, N] += B[s] (A[s] x) for each group's tokens, in place; a [S, R, K], b [S, N, R]."""
    for s, idx in groups:
        if idx is None:  # the whole batch runs one adapter: no gather, no scatter
            y += (x @ a[s].t()) @ b[s].t()
        else:
            y.index_add_(0, idx, (x.index_select(0, idx) @ a[s].t()) @ b[s].t())
    return y
