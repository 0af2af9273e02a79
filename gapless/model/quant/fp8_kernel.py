"""The FP8 W8A8 GEMM on CUDA (sm_89+), in Triton: `y = x W^T (+ b)` with W in e4m3 and its scales, and x
quantized to e4m3 inside the kernel, per token and per `BK` columns (its dynamic scale: the group's
largest |x| / 448), so one launch does the activation quantization and the GEMM (no host sync, no buffer
between them: CUDA graphs capture it as any other kernel).

Each program computes a [BM, BN] tile of y: for each BK-wide step along K it loads x's tile, takes each
row's scale, rounds x / scale to e4m3, loads W's e4m3 tile, and adds `dot(xq, wq) * x_scale * w_scale`
(the fp8 tensor-core product, accumulated in float32). W's scale is looked up at (row // rows_per_scale,
k // k_group): one per row and whole K (per-channel, `stride_sk` 0), or one per [rows, k_group] block.

The Triton interpreter rounds some values to e4m3 wrongly (a carry into the next binade is lost:
31.4 -> 16 instead of 32; triton 3.9), so the CPU tests feed it activations that are exact in e4m3 after
scaling; the GPU test (and `bench/experiments/fp8_gemm.py`) checks real rounding against the torch
reference (`gapless.model.quant.fp8.reference_linear`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_MAX = 448.0  # e4m3's largest finite value


@triton.jit
def _fp8_gemm_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_sk,
    stride_ym,
    rows_per_scale,
    k_group,
    HAS_BIAS: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    m_ok = offs_m < M
    n_ok = offs_n < N
    s_row = s_ptr + (offs_n // rows_per_scale) * stride_sn
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        k_ok = (k0 + offs_k) < K
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + (k0 + offs_k)[None, :],
            mask=m_ok[:, None] & k_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        x_scale = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-12) / 448.0
        xq = (x / x_scale[:, None]).to(tl.float8e4nv)
        w = tl.load(
            w_ptr + offs_n[None, :] * stride_wn + (k0 + offs_k)[:, None],
            mask=n_ok[None, :] & k_ok[:, None],
            other=0.0,
        )
        w_scale = tl.load(s_row + (k0 // k_group) * stride_sk, mask=n_ok, other=0.0)
        acc += tl.dot(xq, w) * x_scale[:, None] * w_scale[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(
        y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=m_ok[:, None] & n_ok[None, :],
    )


def _tiles(m: int) -> tuple[int, int, int, int]:
    """(BM, BN, warps, stages) for M rows: at decode sizes a narrow N tile, so a weight's rows spread over
    more programs (the GEMM reads every weight once: bandwidth wants every SM busy); larger tiles from 64
    rows up, where the tensor cores' work is the cost."""
    if m <= 16:
        return 16, 32, 4, 4
    if m <= 64:
        return 64, 64, 4, 3
    return 128, 128, 8, 3


def fp8_gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    scale: torch.Tensor,
    rows_per_scale: int,
    k_group: int,
    act_group: int,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """x [M, K] (float) times w [N, K] (e4m3)^T with w's float32 `scale` [N / rows_per_scale, K / k_group]
    (k_group 0: one scale per row for all of K), x quantized per row and `act_group` columns; [M, N] in
    x's dtype."""
    m, k = x.shape
    n = w.shape[0]
    x = x if x.stride(1) == 1 else x.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    bm, bn, warps, stages = _tiles(m)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    _fp8_gemm_kernel[grid](
        x,
        w,
        scale,
        bias if bias is not None else scale,
        y,
        m,
        n,
        k,
        x.stride(0),
        w.stride(0),
        scale.stride(0),
        0 if k_group == 0 else scale.stride(1),
        y.stride(0),
        rows_per_scale,
        k_group or k,
        HAS_BIAS=bias is not None,
        BM=bm,
        BN=bn,
        BK=act_group,
        num_warps=warps,
        num_stages=stages,
    )
    return y
