"""x rounded to e4m3 per row and group of columns: the one arithmetic of the FP8 GEMMs' activations
(`gapless.model.quant.fp8_kernel`, the fused experts' `gapless.model.moe_triton`), of the rounding launch
before the tiles, and of the fused RMSNorm and gated activation that round x for the FP8 layer after them
(`gapless.model.fused.triton_kernels`); and `fp8_grid`, a value rounded onto an fp8 grid by hand."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gapless import env, pdl

# under Triton's interpreter its own fp32 -> e4m3 conversion loses a carry into the next binade (31.4
# becomes 16, not 32) and flushes subnormals (triton 3.9): there `round_rows` rounds on the grid by hand
_BY_HAND = tl.constexpr(env.TRITON_INTERPRET.get())


@triton.jit
def fp8_grid(x, scale, E5M2: tl.constexpr):
    """fp32 `x / scale` saturated to the fp8 type's range (e4m3: +-448; E5M2: e5m2's +-57344) and rounded to
    nearest even on its grid, as fp32, so its cast to the type is exact: what torch's
    `(x / scale).clamp(-max, max).to(float8)` stores (`gapless.memory.kv_pool.quantize_fp8`), on every
    target. The grid's step is 2^(e - m) for a value of exponent e (m mantissa bits: e4m3's 3, e5m2's 2;
    subnormals from e = -6, -14), and adding then subtracting 2^(e + 23 - m), whose fp32 ulp is that step,
    rounds to it (to nearest even, as fp32 addition does)."""
    if E5M2:
        top, e_min, mantissa = 57344.0, -14, 2
    else:
        top, e_min, mantissa = 448.0, -6, 3
    y = tl.minimum(tl.maximum(tl.div_rn(x, scale), -top), top)  # IEEE division, as torch
    bits = y.to(tl.int32, bitcast=True)
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, e_min)
    big = ((e + (150 - mantissa)) << 23).to(tl.float32, bitcast=True)  # 2^(e + 23 - m)
    r = (tl.abs(y) + big) - big
    return (r.to(tl.int32, bitcast=True) | ((bits >> 31) << 31)).to(tl.float32, bitcast=True)  # y's sign


@triton.jit
def round_rows(x):
    """x (float32, [rows, BK]: one group of columns a row) as e4m3 and each row's scale (the group's
    largest |x| / 448): the one rounding of x every path takes (also the fused norm's and activation's,
    `gapless.model.fused.triton_kernels`, that round x for the layer after them)."""
    scale = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-12) / 448.0
    if _BY_HAND:  # (the interpreter: `_BY_HAND`)
        q = fp8_grid(x, scale[:, None], False).to(tl.float8e4nv)
    else:
        q = (x / scale[:, None]).to(tl.float8e4nv)
    return q, scale


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
