"""The FP8 GEMV at one row (or a few), on the CUDA cores: `_fp8_gemv_kernel`, which `fp8_kernel.fp8_gemm`
launches where it runs (`GEMV_ROWS`), and the input arithmetic it can take from the kernel before it: a
gated activation (`GATED`) or an RMSNorm with its residual add (`NORM`), each made as x is loaded with
the fused kernel's arithmetic (`gapless.model.triton_math`): the activation's bits, and the norm's but for
the order a GPU adds its row's squares in (each kernel's own warps)."""

from __future__ import annotations

import triton
import triton.language as tl

from gapless import pdl
from gapless.attention.triton_kernels import _sum, clamped_fp16
from gapless.model.quant.fp8_rounding import round_rows
from gapless.model.quant.split_k import finish
from gapless.model.triton_math import act_mul, norm_scale, rounded


@triton.jit(do_not_specialize=["M"])  # (docs/gpu.md#no-compile-mid-run)
def _fp8_gemv_kernel(
    x_ptr,
    xq_ptr,
    xs_ptr,
    w_ptr,
    s_ptr,
    b_ptr,
    y_ptr,
    p_ptr,
    lock_ptr,
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
    split_k,
    r_ptr,
    nw_ptr,
    ro_ptr,
    eps,
    HAS_BIAS: tl.constexpr,
    ROUND: tl.constexpr,
    SCALES: tl.constexpr,
    SPLIT: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    UNROLL: tl.constexpr,
    STAGES: tl.constexpr,
    GATED: tl.constexpr,
    NORM: tl.constexpr,
    RESIDUAL: tl.constexpr,
    ROW_BLOCK: tl.constexpr,
    PREFETCH: tl.constexpr,
    PDL: tl.constexpr,
):
    """Row `program_id(0)` of y, columns [pid_n * BN, +BN), over one share of K, on the CUDA cores: W's
    [BN, BK] tile read along K (each row's contiguous bytes, in the layout it loads in), widened to
    float32, times x's BK values (as ROUND says: 1, the e4m3 row and scales a launch wrote; 2, rounded
    here, in registers, by `round_rows`; 3, x in fp16), added into a [BN, BK] float32 accumulator (one
    FMA a weight) summed along K once, at the end. W's scales (SCALES): 0, one a row for all of K,
    applied at the end; 1, the tile's rows inside one block of scales, one a step, folded into x; 2, one
    a row a step. UNROLL steps a loop iteration (their loads issued together); STAGES > 1: the loop's loads
    through asynchronous copies that many iterations deep (Triton pipelines only a dot's loads unless the
    loop asks: in the sm_90 binary 4 LDGSTS a step, 18 KB of shared memory at 3, registers unchanged).
    GATED >= 0 (`triton_math.ACTIVATIONS`' value; ROUND 2 or 3): x's row is a gated activation's input,
    [gate, up] of 2K, and x = act(gate) * up as the fused kernel computes it (`act_mul`: the same bits),
    made as it is loaded, with no launch before the GEMV to write it. NORM >= 0 (`triton_math.NORM_KINDS`'
    value; ROUND 2 or 3): x is an RMSNorm's input, and the GEMV's x its norm by the weight at `nw_ptr`
    (with RESIDUAL, of x + the residual at `r_ptr` [M, K], that sum written to `ro_ptr` by the row's
    first program), as the fused kernel computes it (`_rms_norm_kernel`: the same arithmetic), its row's
    sum of squares taken by each program before its loop, with no launch before the GEMV. PREFETCH (with
    PDL, or NORM on a GPU): the first `pdl.PREFETCH_BYTES` of each of the program's weight rows fetched
    into L2 first (`pdl.prefetch_weights`), so the weights stream in while the program waits or norms."""
    row = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    n_ok = offs_n < N
    k_start = pid_s * split_k
    k_stop = tl.minimum(k_start + split_k, K)
    # the weights' first bytes into L2 before anything waits: on the kernel before (PDL) or on the norm's
    # row (PREFETCH): at 512 programs a program's whole share of K on Qwen3-0.6B
    pdl.prefetch_weights(w_ptr + tl.where(n_ok, offs_n, 0) * stride_wn, k_start, k_stop, PREFETCH)
    pdl.wait_for_previous(PDL)
    inv = 0.0
    if NORM >= 0:
        inv = _row_rms_inverse(
            x_ptr, r_ptr, ro_ptr, row, K, stride_xm, eps, pid_n + pid_s == 0, RESIDUAL, ROW_BLOCK
        )
    s_row = s_ptr + (offs_n // rows_per_scale) * stride_sn
    acc = tl.zeros((BN, BK), dtype=tl.float32)
    w_tile = w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :]
    for k0 in tl.range(k_start, k_stop, BK * UNROLL, num_stages=STAGES):
        # the weights of UNROLL steps loaded first, all in flight together (x's layout change for the
        # broadcast below passes through shared memory, a barrier no load is moved across)
        w0 = tl.load(w_tile + k0, mask=n_ok[:, None] & ((k0 + offs_k) < k_stop)[None, :], other=0.0)
        w1 = w0
        if UNROLL == 2:
            k1 = k0 + BK  # (past k_stop: the next split's share, or past K; masked)
            w1 = tl.load(w_tile + k1, mask=n_ok[:, None] & ((k1 + offs_k) < k_stop)[None, :], other=0.0)
        for u in tl.static_range(UNROLL):
            kk = k0 + u * BK
            on = kk < k_stop
            k_ok = (kk + offs_k) < k_stop
            # x as a [BK] vector, broadcast over W's rows (a [1, BK] tile would take a layout of its own,
            # into which the compiler moves W's tile through shared memory)
            if ROUND == 1:
                xq = tl.load(xq_ptr + row * K + kk + offs_k, mask=k_ok, other=0.0)
                x = xq.to(tl.float32) * tl.load(xs_ptr + row * tl.cdiv(K, BK) + kk // BK, mask=on, other=0.0)
            else:
                x = tl.load(x_ptr + row * stride_xm + kk + offs_k, mask=k_ok, other=0.0)
                if GATED >= 0:  # x's row [gate, up]: act(gate) * up, rounded to x's dtype (as stored)
                    up = tl.load(x_ptr + row * stride_xm + K + kk + offs_k, mask=k_ok, other=0.0)
                    x = act_mul(x, up, GATED)
                if NORM >= 0:  # x's norm (of x + residual), rounded to x's dtype (as the norm stores it)
                    x = _normed(
                        x, r_ptr + row * K + kk + offs_k, nw_ptr + kk + offs_k, k_ok, inv, NORM, RESIDUAL
                    )
                if ROUND == 3:  # W8A16: x in fp16 (clamped to its range), as the GEMM's dot takes it
                    x = clamped_fp16(x).to(tl.float32)
                else:
                    xq, x_scale = round_rows(x.to(tl.float32)[None, :])
                    x = tl.sum(xq.to(tl.float32) * x_scale[:, None], axis=0)  # (one row: its values)
            if SCALES == 1:  # one scale for the tile's rows this step (their block's): folded into x
                block = (pid_n * BN // rows_per_scale) * stride_sn + (kk // k_group) * stride_sk
                x *= tl.load(s_ptr + block, mask=on, other=0.0)
            w = (w0 if u == 0 else w1).to(tl.float32)
            if SCALES == 2:
                rows_on = n_ok & (kk + 0 * offs_n < k_stop)  # (a vector: the interpreter's masks)
                w *= tl.load(s_row + (kk // k_group) * stride_sk, mask=rows_on, other=0.0)[:, None]
            acc += w * x[None, :]
    y = tl.sum(acc, axis=1)
    if SCALES == 0:
        y *= tl.load(s_row, mask=n_ok, other=0.0)
    offs_m = row + tl.arange(0, 1)
    finish(y[None, :], y_ptr, p_ptr, lock_ptr, b_ptr, offs_m, offs_n, M, N, stride_ym, HAS_BIAS, SPLIT)


@triton.jit
def _row_rms_inverse(
    x_ptr, r_ptr, ro_ptr, row, K, stride_xm, eps, WRITES, RESIDUAL: tl.constexpr, ROW_BLOCK: tl.constexpr
):
    """1 / RMS(x's row) (+ eps under the root), of x + residual with RESIDUAL: that sum rounded to x's
    dtype and, where `WRITES`, stored to `ro_ptr`'s row; `_rms_norm_kernel`'s arithmetic over ROW_BLOCK
    (K's next power of 2) columns."""
    offs = tl.arange(0, ROW_BLOCK)
    ok = offs < K
    x32 = tl.load(x_ptr + row * stride_xm + offs, mask=ok, other=0.0).to(tl.float32)
    if RESIDUAL:
        r = tl.load(r_ptr + row * K + offs, mask=ok, other=0.0).to(tl.float32)
        x32 = rounded(x32 + r, x_ptr.dtype.element_ty)
        if WRITES:
            tl.store(ro_ptr + row * K + offs, x32.to(ro_ptr.dtype.element_ty), mask=ok)
    return tl.rsqrt(_sum(x32 * x32, 0) / K + eps)


@triton.jit
def _normed(x, r_ptrs, w_ptrs, ok, inv, NORM: tl.constexpr, RESIDUAL: tl.constexpr):
    """Loaded values `x` of an RMSNorm's input normed by `inv` (`_row_rms_inverse`) and the norm's weight at
    `w_ptrs`, after the residual's at `r_ptrs` is added (RESIDUAL), in float32, rounded to x's dtype."""
    x32 = x.to(tl.float32)
    if RESIDUAL:
        x32 = rounded(x32 + tl.load(r_ptrs, mask=ok, other=0.0).to(tl.float32), x.dtype)
    w = tl.load(w_ptrs, mask=ok, other=0.0)
    return rounded(norm_scale(x32 * inv, w, NORM), x.dtype)
