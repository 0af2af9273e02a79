"""How a packed int4/int8 weight's values become floats inside a Triton GEMM (`int4_triton`, and the
mixtures' grouped GEMM over int experts, `gapless.model.moe_triton`), by their bits rather than by a
conversion instruction, which Hopper runs on a slow pipe:

- `unsigned_to_float`, `value`: a value's bits ORed into the mantissa of 2^23, less 2^23 (and the zero),
  times the scale, in float32.
- `values_ptx` (`GemmConfig.ptx_values`; 4 bits, bf16 or fp16 activations, compiled): two values at a
  time by PTX, a nibble pair ORed into the mantissas of a power of two, the zero subtracted and the scale
  applied on half-precision pairs; the same bits as `value` rounded once to x's dtype (a CUDA test checks
  them equal).
- `factored_words` (`GemmConfig.factored`, the GEMV's): each word's values less the zero times x summed
  in float32, times the scale once a word; a value is one LOP3, one FADD and one FFMA.
- `level`: a codebook's value (NF4, FP4, IQ4, NVFP4's e2m1: 16 levels, not evenly spaced), looked up by
  its bits, times the scale.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def unsigned_to_float(q):
    """q (int32 in [0, 2^23): a packed weight's values) as float32, exactly, without a conversion
    instruction: its bits ORed into the mantissa of 2^23, minus 2^23. Hopper converts integers at a
    fraction of its float rate (`I2FP`, on the conversion pipe), and every dequantized value took one."""
    return (q | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def value(packed, j, z, s, BITS: tl.constexpr, BIASED: tl.constexpr = True):
    """Value j of every word of `packed`, dequantized in float32: its bits under the mantissa of 2^23 (as
    `unsigned_to_float`), less `z`, times the scales `s` (each broadcast over `packed`'s words: [1,
    BLOCK_N], or [BLOCK_N, 1] for the swapped dots' words; or each word row's own, where a K step spans
    groups). `BIASED`: `z` is the zeros plus 2^23 (`biased_zeros`: exact for integer zeros, one subtraction
    a value instead of two); else the zeros themselves (a GGUF file's are not integers, whose fraction
    2^23 + z would lose), subtracted after 2^23."""
    q = (packed >> (j * BITS)) & ((1 << BITS) - 1)
    f = (q | 0x4B000000).to(tl.float32, bitcast=True)
    if BIASED:
        return (f - z) * s
    return ((f - 8388608.0) - z) * s


@triton.jit
def level(packed, j, s, Levels, BITS: tl.constexpr):
    """Value j of every word of `packed` from a codebook, in float32: `Levels[q] * s` (`Levels`: its 2^BITS
    float32 levels, in memory the cache holds; one gather load a value, where `value` takes arithmetic).
    No zero: a codebook's levels are the values themselves."""
    q = (packed >> (j * BITS)) & ((1 << BITS) - 1)
    return tl.load(Levels + q) * s


@triton.jit
def biased_zeros(z, INTEGER_ZEROS: tl.constexpr):
    """The zeros as `value` takes them: plus 2^23 where they are integers (`BIASED`), else as they are."""
    if INTEGER_ZEROS:
        return z.to(tl.float32) + 8388608.0
    return z.to(tl.float32)


def _values_asm(pair: str, one: str, magic: str) -> str:
    """The PTX of `values_ptx` for one half-precision type (`pair`: bf16x2 or f16x2; its 1.0 and MAGIC
    as two 16-bit patterns): word $8 -> values $0..$7, two at a time: nibbles i and i + 4 (16 bits apart)
    ORed into the mantissas of MAGIC (2^7 in bf16, 2^10 in fp16: MAGIC + q exactly), less MAGIC + the
    zero ($10, negated: exact), times the scale ($9: one rounding, as the dots' weight tile has), -0 added
    (the sign of 0 * s kept)."""
    head = (
        ".reg .b32 v, t, s2, nz2, one2, nzero, magic, mask;\n"
        f"mov.b32 s2, {{$9, $9}};\nmov.b32 nz2, {{$10, $10}};\nmov.b32 one2, {one};\n"
        f"mov.b32 nzero, 0x80008000;\nmov.b32 magic, {magic};\nmov.b32 mask, 0x000F000F;\n"
    )
    pairs = "".join(
        f"shr.u32 t, $8, {4 * i};\nlop3.b32 v, t, mask, magic, 0xEA;\n"
        f"fma.rn.{pair} v, v, one2, nz2;\nfma.rn.{pair} v, v, s2, nzero;\nmov.b32 {{${i}, ${i + 4}}}, v;\n"
        for i in range(4)
    )
    return "{\n" + head + pairs + "}"


_BF16_VALUES_ASM = tl.constexpr(_values_asm("bf16x2", "0x3F803F80", "0x43004300"))
_FP16_VALUES_ASM = tl.constexpr(_values_asm("f16x2", "0x3C003C00", "0x64006400"))


@triton.jit
def values_ptx(packed, s, z, BF16: tl.constexpr):
    """The 8 values of every 4-bit word of `packed` ([R, C] int32), each dequantized in x's dtype (bf16
    with BF16, else fp16) as `value` and one rounding to that dtype give it, the same bits, by PTX: per
    word 4 `lop3`, 3 shifts and 8 `fma` on value pairs (`_values_asm`), where `value` takes a shift, a
    bitfield extract, an OR, a subtraction and a product a value, and the rounding a conversion a pair.
    `s` and `z`, the scales and zeros in x's dtype, broadcast over the words as `value` takes them. The
    interpreter cannot run PTX: a CPU test runs that PTX instruction by instruction as PTX defines them
    against `value`'s bits, the harness compiles it for sm_90, and the CUDA tests check its bits on the
    GPU."""
    magic = 128.0 if BF16 else 1024.0
    nz = (-(z.to(tl.float32) + magic)).to(s.dtype)  # (exact: small integers)
    s2 = tl.broadcast_to(s, packed.shape)
    nz2 = tl.broadcast_to(nz, packed.shape)
    if BF16:
        values = tl.inline_asm_elementwise(
            _BF16_VALUES_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r,h,h", [packed, s2, nz2],
            dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1,
        )  # fmt: skip
    else:
        values = tl.inline_asm_elementwise(
            _FP16_VALUES_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r,h,h", [packed, s2, nz2],
            dtype=(tl.float16,) * 8, is_pure=True, pack=1,
        )  # fmt: skip
    return values


@triton.jit
def factored_words(acc, packed, x_row, offs_w, s, z, magic, BITS: tl.constexpr):
    """`acc` ([BLOCK_K / P, BLOCK_N] float32) plus the GEMV's products over `packed`'s words: each word's
    sum over its P values of (q - zero) times x, times the scale once a word, not once a value. A value's
    q - zero from its bits alone, in float32: the word's low half, or its high half shifted down once,
    ANDed to value j's bits at 4j (8j with 8 bits) and ORed into the mantissa of 2^(23 - 4j), whose last
    bit is worth 1 there, less (2^(23 - 4j) + zero): exact; one LOP3 and one FADD a value, then its FFMA.
    `magic`: 2^23's bits (0x4B000000) as a kernel argument, so a register: with two immediates (the mask
    and the power of two) ptxas splits the AND and the OR into two LOP3s. `x_row`: x's row, read without
    masks (every step is a whole BLOCK_K); `s`, `z`: the scales and zeros over the words ([1, BLOCK_N]:
    one group's; or each word row's). No weight is rounded (as `value`'s)."""
    P: tl.constexpr = 32 // BITS
    HALF: tl.constexpr = P // 2
    high = packed >> 16  # (arithmetic: the sign's copies above bit 15 are masked off with the rest)
    z = z.to(tl.float32)
    sums = tl.zeros(packed.shape, tl.float32)
    for j in tl.static_range(P):
        x = tl.load(x_row + offs_w * P + j).to(tl.float32)  # x's columns for value j: every P-th from j
        shift = BITS * (j % HALF)  # (constant: j is)
        if j < HALF:
            bits = packed & (((1 << BITS) - 1) << shift)
        else:
            bits = high & (((1 << BITS) - 1) << shift)
        power = 1.0 * (1 << (23 - shift))
        q = (bits | (magic - (shift << 23))).to(tl.float32, bitcast=True) - (z + power)
        sums += q * x[:, None]
    return acc + sums * s.to(tl.float32)
