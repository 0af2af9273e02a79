"""Triton arithmetic that two kernels must do alike to give the same bits: the fused kernels
(`gapless.model.fused.triton_kernels`) and the FP8 GEMV, which can compute a gated activation or an
RMSNorm as it loads its x (`gapless.model.quant.fp8_gemv`) instead of reading the fused kernel's output."""

from __future__ import annotations

import triton
import triton.language as tl

from gapless.attention.triton_kernels import INTERPRET

# the RMSNorm arithmetics (`gapless.model.layers.RMS_NORMS` keys) by the kernels' KIND constant
NORM_KINDS = {"llama": 0, "fp32": 1, "gemma": 2}
# the gated activations (`gapless.model.layers.GATED_ACTIVATIONS` keys) by the kernels' ACT constant
ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1}
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)  # (constexpr: a jitted function reads no other globals)
# Triton's interpreter casts fp32 to bf16 by truncation (round toward zero, also when storing to a bf16
# pointer); the GPU rounds to nearest even, as torch does. Under the interpreter `rounded` rounds by hand.
_ROUND_BY_HAND = tl.constexpr(INTERPRET)


@triton.jit
def rounded(x, dtype: tl.constexpr):
    """fp32 `x` rounded to `dtype` (to nearest, ties to even), returned as fp32: what torch's op in `dtype`
    would have produced, ready for the next op."""
    if _ROUND_BY_HAND and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(dtype).to(tl.float32)


@triton.jit
def act_mul(gate, up, ACT: tl.constexpr):
    """act(gate) * up in float32 (ACT: `ACTIVATIONS`' value), act's result rounded to the dtype before the
    product, as the two torch ops round; the product rounded to the dtype too."""
    g = gate.to(tl.float32)
    if ACT == 0:
        a = g / (1.0 + tl.exp(-g))
    else:  # tanh(y) = 2 sigmoid(2y) - 1; past |y| = 15 tanh is 1.0 in fp32 (and exp would overflow)
        y = _SQRT_2_OVER_PI * (g + 0.044715 * g * g * g)
        y = tl.minimum(tl.maximum(y, -15.0), 15.0)
        a = 0.5 * g * (1.0 + (2.0 / (1.0 + tl.exp(-2.0 * y)) - 1.0))
    return rounded(rounded(a, gate.dtype) * up.to(tl.float32), gate.dtype)


@triton.jit
def norm_scale(normed, w, KIND: tl.constexpr):
    """The weight applied to fp32 normed values, in fp32, rounded where the torch reference rounds:
    llama: weight * normed.to(dtype) (a product in the weight's dtype); fp32 (OLMo 2): weight * normed
    in fp32; gemma: (1 + weight) * normed in fp32. The caller casts the result to the output dtype."""
    if KIND == 0:
        return w.to(tl.float32) * rounded(normed, w.dtype)
    elif KIND == 1:
        return w.to(tl.float32) * normed
    else:
        return (1.0 + w.to(tl.float32)) * normed
