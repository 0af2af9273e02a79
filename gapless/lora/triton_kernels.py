"""The gathered LoRA kernels (Punica's BGMV shape): each token reads its own adapter's A and B through its
slot, so rows of different adapters and of the base model (slot -1: nothing added) share one launch, and
the slot vector is read on the device (no host sync; a CUDA graph replays it as a static buffer).

`shrink`: v[t] = A[slot[t]] x[t] (fp32, [T, splits, R]: partial sums over `SPLIT_K` columns of x each);
`expand`: y[t] += B[slot[t]] v[t] (the partials added up), in y's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gapless import env


def interpreted() -> bool:
    """Whether Triton runs under its interpreter (CPU tensors welcome)."""
    return bool(env.TRITON_INTERPRET.get())


SPLIT_K = 256  # x's columns one shrink program reads: its partial sum of A x over them


@triton.jit
def _lora_shrink_kernel(
    X,
    A,
    Slots,
    V,
    K,
    R,
    stride_x,
    stride_as,
    stride_ar,
    stride_vt,
    stride_vs,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr,
):
    t = tl.program_id(0)
    split = tl.program_id(1)
    r = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    slot = tl.load(Slots + t)
    if slot >= 0:
        acc = tl.zeros([BLOCK_R], dtype=tl.float32)
        for i in tl.static_range(SPLIT // BLOCK_K):  # unrolled: every load issued at once
            k = split * SPLIT + i * BLOCK_K + tl.arange(0, BLOCK_K)
            x = tl.load(X + t * stride_x + k, mask=k < K, other=0.0).to(tl.float32)
            a_ptr = A + slot * stride_as + r[:, None] * stride_ar + k[None, :]
            a = tl.load(a_ptr, mask=(r[:, None] < R) & (k[None, :] < K), other=0.0).to(tl.float32)
            acc += tl.sum(a * x[None, :], axis=1)
        tl.store(V + t * stride_vt + split * stride_vs + r, acc, mask=r < R)


@triton.jit
def _lora_expand_kernel(
    V,
    B,
    Slots,
    Y,
    N,
    R,
    SPLITS,
    stride_vt,
    stride_vs,
    stride_bs,
    stride_bn,
    stride_y,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    t = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    slot = tl.load(Slots + t)
    if slot >= 0:
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for r0 in range(0, R, BLOCK_R):
            r = r0 + tl.arange(0, BLOCK_R)
            v = tl.zeros([BLOCK_R], dtype=tl.float32)
            for s in range(0, SPLITS):  # the shrink's partial sums, in a fixed order
                v += tl.load(V + t * stride_vt + s * stride_vs + r, mask=r < R, other=0.0)
            b_ptr = B + slot * stride_bs + n[:, None] * stride_bn + r[None, :]
            b = tl.load(b_ptr, mask=(n[:, None] < N) & (r[None, :] < R), other=0.0).to(tl.float32)
            acc += tl.sum(b * v[None, :], axis=1)
        y = tl.load(Y + t * stride_y + n, mask=n < N, other=0.0).to(tl.float32)
        tl.store(Y + t * stride_y + n, (y + acc).to(Y.dtype.element_ty), mask=n < N)


def add_lora(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """y [T, N] += B[slots] (A[slots] x) per token, in place; a [S, R, K], b [S, N, R], slots [T] int64.
    The shrink is split over x's columns (`SPLIT_K` each: T x K / SPLIT_K programs, not T running the
    whole of K one after another) into fp32 partial sums, which the expand adds up."""
    t, k = x.shape
    r, n = a.shape[1], b.shape[1]
    if t == 0:
        return y
    x, y_ = x.contiguous(), y if y.is_contiguous() else y.contiguous()
    splits = triton.cdiv(k, SPLIT_K)
    v = torch.empty(t, splits, r, dtype=torch.float32, device=x.device)
    block_r = min(64, triton.next_power_of_2(r))
    block_k = min(64, SPLIT_K)
    _lora_shrink_kernel[(t, splits, triton.cdiv(r, block_r))](
        x,
        a,
        slots,
        v,
        k,
        r,
        x.stride(0),
        a.stride(0),
        a.stride(1),
        v.stride(0),
        v.stride(1),
        BLOCK_R=block_r,
        BLOCK_K=block_k,
        SPLIT=SPLIT_K,
    )
    block_n = 64
    _lora_expand_kernel[(t, triton.cdiv(n, block_n))](
        v,
        b,
        slots,
        y_,
        n,
        r,
        splits,
        v.stride(0),
        v.stride(1),
        b.stride(0),
        b.stride(1),
        y_.stride(0),
        BLOCK_N=block_n,
        BLOCK_R=block_r,
    )
    if y_ is not y:
        y.copy_(y_)
    return y
