"""x rounded to e4m3 per row and group of columns: the one arithmetic of the FP8 GEMM's activations
(`gapless.model.quant.fp8_kernel`), of its rounding launch before the tiles, and of the fused RMSNorm and
gated activation that round x for the FP8 layer after them (`gapless.model.fused.triton_kernels`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gapless import pdl


@triton.jit
def round_rows(x):
    """x (float32, [rows, BK]: one group of columns a row) as e4m3 and each row's scale (the group's
    largest |x| / 448): the one rounding of x every path takes (also the fused norm's and activation's,
    `gapless.model.fused.triton_kernels`, that round x for the layer after them)."""
    scale = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-12) / 448.0
    return (x / scale[:, None]).to(tl.float8e4nv), scale


@triton.jit
def _fp8_quant_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, BK: tl.constexpr, PDL: tl.constexpr):
    """Row `program_id(0)`'s columns [g * BK, (g + 1) * BK) (g = `program_id(1)`) as e4m3 and their scale."""
    row = tl.program_id(0)
    g = tl.program_id(1)
    pdl.wait_for_previous(PDL)
    offs = g * BK + tl.arange(0, BK)
    ok = offs < K
    x = tl.load(x_ptr + row * stride_xm + offs[None, :], mask=ok[None, :], other=0.0).to(tl.float32)
    q, scale = round_rows(x)
    tl.store(q_ptr + row * K + offs[None, :], q, mask=ok[None, :])
    tl.store(s_ptr + row * tl.num_programs(1) + g + tl.arange(0, 1), scale)


def rounding_buffers(m: int, k: int, group: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty buffers for x [M, K] rounded per `group` columns: e4m3 [M, K] and float32 scales
    [M, ceil(K / group)], `_fp8_quant_kernel`'s layout (and the fused norm's and activation's)."""
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=device)
    return q, torch.empty(m, triton.cdiv(k, group), dtype=torch.float32, device=device)
