"""The int4/int8 GEMM's dot tiles (`int4_triton`): a dequantized tile's dot added to the accumulator
(`accumulate`), and the swapped tiles' K step (`swapped_step`: W the dots' first operand,
`GemmConfig.swapped`), its P value tiles laid out as one K tile (`k_tile`)."""

from __future__ import annotations

import triton
import triton.language as tl

from gapless.model.quant.int4_values import biased_zeros, value, values_ptx


@triton.jit
def accumulate(acc, x, w, IEEE: tl.constexpr, AS_FP32: tl.constexpr, SWAPPED: tl.constexpr = False):
    """acc + x @ w (SWAPPED: acc + w @ x, x transposed), w the dequantized tile: rounded once to x's dtype
    for the dot (fp32 operands with `AS_FP32`), fp32 dots in IEEE precision."""
    if AS_FP32:
        x = x.to(tl.float32)
    else:
        w = w.to(x.dtype)
    a, b = (w, x) if SWAPPED else (x, w)
    if IEEE:
        return acc + tl.dot(a, b, input_precision="ieee")
    return acc + tl.dot(a, b)


@triton.jit
def k_tile(v, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, P: tl.constexpr):
    """The P value tiles of a [BLOCK_N, BLOCK_K / P] word tile (tile j: value j of every word) as one
    [BLOCK_N, BLOCK_K] tile in K's order (column P * c + j: word c's value j), by joins: each thread keeps
    the values it unpacked, consecutive along K, which reach the tensor cores' register layout by
    16-byte stores to shared memory and matrix loads (in the sm_90 binary; a broadcast shift and reshape
    instead took 3.5x the instructions)."""
    if P == 8:
        t = tl.join(
            tl.join(tl.join(v[0], v[4]), tl.join(v[2], v[6])),
            tl.join(tl.join(v[1], v[5]), tl.join(v[3], v[7])),
        )
    else:  # (8 bits: 4 values a word)
        t = tl.join(tl.join(v[0], v[2]), tl.join(v[1], v[3]))
    # (each join's index is a new last dim: flattened, the innermost join's is j's top bit)
    return tl.reshape(t, (BLOCK_N, BLOCK_K))


@triton.jit
def swapped_step(
    acc_t, Qw, X, k0, offs_w, offs_n, offs_m, n_mask, m_mask, k_stop, N, stride_xm, s, z,
    BITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NIBBLE_DOTS: tl.constexpr,
    PTX_VALUES: tl.constexpr, IEEE: tl.constexpr, AS_FP32: tl.constexpr, INTEGER_ZEROS: tl.constexpr,
):  # fmt: skip
    """`acc_t` ([BLOCK_N, BLOCK_M] float32: the output transposed) plus W's tile times x's, W the dots'
    first operand (`GemmConfig.swapped`): its words loaded [BLOCK_N, BLOCK_K / P], dequantized (by PTX
    where PTX_VALUES, else `value`), then a dot per value of the words (NIBBLE_DOTS) or one K tile
    (`k_tile`)."""
    P: tl.constexpr = 32 // BITS
    packed = tl.load(
        Qw + offs_w[None, :].to(tl.int64) * N + offs_n[:, None],
        mask=n_mask[:, None] & (offs_w < k_stop // P)[None, :],
        other=0,
    )
    if PTX_VALUES:
        v = values_ptx(packed, s, z, PTX_VALUES == 1)
    else:
        zf, sf = biased_zeros(z, INTEGER_ZEROS), s.to(tl.float32)
        if P == 8:
            v = (
                value(packed, 0, zf, sf, BITS, INTEGER_ZEROS), value(packed, 1, zf, sf, BITS, INTEGER_ZEROS),
                value(packed, 2, zf, sf, BITS, INTEGER_ZEROS), value(packed, 3, zf, sf, BITS, INTEGER_ZEROS),
                value(packed, 4, zf, sf, BITS, INTEGER_ZEROS), value(packed, 5, zf, sf, BITS, INTEGER_ZEROS),
                value(packed, 6, zf, sf, BITS, INTEGER_ZEROS), value(packed, 7, zf, sf, BITS, INTEGER_ZEROS),
            )  # fmt: skip
        else:
            v = (
                value(packed, 0, zf, sf, BITS, INTEGER_ZEROS), value(packed, 1, zf, sf, BITS, INTEGER_ZEROS),
                value(packed, 2, zf, sf, BITS, INTEGER_ZEROS), value(packed, 3, zf, sf, BITS, INTEGER_ZEROS),
            )  # fmt: skip
    if NIBBLE_DOTS:
        for j in tl.static_range(P):
            offs_k = offs_w * P + j  # x's columns for value j: every P-th from j
            x = tl.load(
                X + offs_m[None, :].to(tl.int64) * stride_xm + offs_k[:, None],
                mask=m_mask[None, :] & (offs_k < k_stop)[:, None],
                other=0.0,
            )
            acc_t = accumulate(acc_t, x, v[j], IEEE, AS_FP32, True)
    else:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(
            X + offs_m[None, :].to(tl.int64) * stride_xm + offs_k[:, None],
            mask=m_mask[None, :] & (offs_k < k_stop)[:, None],
            other=0.0,
        )
        acc_t = accumulate(acc_t, x, k_tile(v, BLOCK_N, BLOCK_K, P), IEEE, AS_FP32, True)
    return acc_t
