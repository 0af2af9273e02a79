"""The LoRA delta of a batch whose rows run different adapters: y += B[slot] A[slot] x per token, slot -1
adding nothing. On CUDA the gathered Triton kernels (`triton_kernels`); elsewhere torch, segmented by slot
(one pair of GEMMs per adapter in the batch; it reads the slots on the host, which a CPU does for free)."""

from __future__ import annotations

import torch


def add_lora_torch(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """y [T, N] += B[slots] (A[slots] x) per token, in place; a [S, R, K], b [S, N, R], slots [T] int64."""
    present = torch.unique(slots).tolist()
    for s in present:
        if s < 0:
            continue
        if len(present) == 1:  # the whole batch runs one adapter: no gather, no scatter
            y += (x @ a[s].t()) @ b[s].t()
            break
        idx = (slots == s).nonzero().squeeze(1)
        y.index_add_(0, idx, (x.index_select(0, idx) @ a[s].t()) @ b[s].t())
    return y


def add_lora(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor, kernel: bool
) -> torch.Tensor:
    """The delta through the Triton kernels (`kernel`) or torch."""
    if kernel:
        from gapless.lora import triton_kernels

        return triton_kernels.add_lora(y, x, a, b, slots)
    return add_lora_torch(y, x, a, b, slots)
