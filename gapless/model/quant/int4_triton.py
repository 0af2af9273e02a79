"""The weight-only int4/int8 GEMM (w4a16, w8a16) on CUDA: `y = x W^T`, W dequantized inside the loop.

The weight is held in one layout whatever checkpoint it came from (`gapless.model.quant.int4`):

- `qweight` int32 [K / P, N], P = 32 / bits values per int32 packed along K: value k of column n is
  `(qweight[k // P, n] >> (bits * (k % P))) & (2^bits - 1)`, unsigned;
- `scales`, `zeros` [K / G, N] in the activations' dtype: `W[n, k] = (q - zeros[g, n]) * scales[g, n]`,
  g = k // G (G the group size; G = K is one group per output channel).

Each program computes a [BLOCK_M, BLOCK_N] tile over one share of K (split-K): it loads its [BLOCK_K / P,
BLOCK_N] tile of int32 words (each word read once) and their scales and zeros: one row where the K block is in
one group (BLOCK_K divides G), else each word row's group's (BLOCK_K a multiple of G: groups of 32 or 64, a
GGUF file's 32, read 128 at a step, not a step of 4 words a group); values go to float32 by their bits
(`int4_values`), not by a conversion instruction. Then, where the tiles allow (`nibble_dots`, 16-row tiles
with BLOCK_K / P >= 16, an option), for each j < P it shifts value j out of every word, subtracts the zero,
scales, and adds the dot of that [BLOCK_K / P, BLOCK_N] tile with x's columns k0 + P * r + j; otherwise it
lays the P values of each word out as one [BLOCK_K, BLOCK_N] tile for one dot. The first keeps each value
where it was unpacked: compiled for sm_90 at one row (bf16, 4 bits), 56 registers and 10 KB of shared memory a
program against the second's 128 and 34 KB, which spends 64 shared-memory stores a step on the reshape.

With `GemmConfig.ptx_values` (chosen at one row; 4 bits, bf16 or fp16 activations, compiled) the
dots' values come from PTX instead (`int4_values.values_ptx`): the same bits as Triton's path, in a loop
body of 338 instructions at one row (bf16, sm_90) against 530; the GEMV's too (415 against 503).

`BLOCK_M = 1` (the GEMV, chosen at one row: `choose_config`) multiplies on the CUDA cores instead, value
by value as the dots per value do, with no 16-row dot tile of which 15 rows are padding: each value times
x's column for it, loaded as a vector, into a float32 accumulator of the words' shape summed over K once
at the end; its weights stay in float32 (not rounded to x's dtype as the dots' are, unless by PTX,
above). In the sm_90 binary (bf16, 4 bits) its loop body is 503 instructions for 16 x 64 words, where it
was 1,916 (448 shuffles a step: x as a [1, K] tile, the weights moved into its layout and summed each
step).

`GemmConfig.factored` (an option, never timed) takes the GEMV's scales and zeros out of its values
(`int4_values.factored_words`): 335 instructions a loop body at one row (bf16, sm_90) against the PTX
values' 420. Its weights are not rounded to x's dtype either.

`GemmConfig.swapped` (an option, `GAPLESS_INT4_SWAPPED`; never timed) computes each tile transposed,
W x^T, with W the dots' first operand: Hopper's wgmma reads that operand from registers, so the
dequantized weights reach the tensor cores without the trip through shared memory a value at a time that
the second operand takes, and x (padded to 16 rows: at one row 15 are padding, which a bandwidth-bound
GEMM does not feel) takes that trip instead. With one K tile a step (`int4_tiles.k_tile`, values by PTX)
its sm_90 loop body is 253 instructions for 16 x 64 words at one row and 16 alike, against the GEMV's
420 and the 16-row tiles' 627, its wgmma reading W from registers; the values still pass through shared
memory once, 16 bytes a store, to reach the register layout the tensor cores read.

A codebook's weight (bitsandbytes' NF4 and FP4, GGUF's IQ4, NVFP4's e2m1: 16 levels, not evenly spaced,
`int4_layouts.Unpacked.levels`) is held in the same layout with `W[n, k] = levels[q] * scales[g, n]` and
no zeros (`levels`): each value is a gather load from the 64-byte table (`int4_values.level`), on the GEMV
and the Triton-valued tiles; never timed on a GPU (its sm_90 binary: bench/results/sm90_codebook_cpu).

Decode (M <= 16) has few output tiles (N / BLOCK_N), fewer than the GPU's SMs on an 8B-shape layer, so K
is split among programs, and the last of a tile's programs to finish adds their partial sums up in split
order (`split_k.finish`: one launch, deterministic; a sum and a cast by torch after it were two more
kernels a layer). Every size comes from host ints (the shapes), so nothing here syncs with the device and
a CUDA graph captures it.

As in `gapless.model.moe_triton`, fp32 dots use `input_precision="ieee"`, and under the interpreter the
dot's operands go in as fp32 (the interpreter multiplies bf16 operands' raw bits, triton-lang/triton#11584).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from gapless import env
from gapless.model.quant.int4_tiles import accumulate, swapped_step
from gapless.model.quant.int4_values import (
    biased_zeros,
    factored_words,
    level,
    unsigned_to_float,
    value,
    values_ptx,
)
from gapless.model.quant.split_k import counters, finish, partial_sums

INTERPRET = env.TRITON_INTERPRET.get()
_TARGET_PROGRAMS = (
    264  # about two programs per SM of an H100/H200 (132 SMs): what the tiles' split-K aims for
)
_MAX_SPLIT = 16
# the GEMV's programs an SM holds at once (its sm_90 binary: 72 registers, 4 warps: 7 of them), what its K
# split aims for: each program keeps one 4 KB step of words in flight (plain loads), so the bytes in flight
# are the programs' (`choose_config`)
GEMV_PROGRAMS_PER_SM = 7
SMS = 132  # (an H100's or H200's SMs: what `choose_config` assumes where it is given no device's)


@triton.jit
def _group_rows(Scales, Zeros, k0, offs_w, offs_n, n_mask, N, GROUP: tl.constexpr, BLOCK_K: tl.constexpr,
                BITS: tl.constexpr, SWAPPED: tl.constexpr, ZEROS: tl.constexpr = True):  # fmt: skip
    """(scales, zeros) over a K step's [BLOCK_K / P, BLOCK_N] words (`SWAPPED`: [BLOCK_N, BLOCK_K / P]):
    its group's row, broadcast over the words, where the step is in one group (BLOCK_K <= GROUP); else
    each word row's group's (a word's P values are in one group: GROUP >= P). Without `ZEROS` (a
    codebook's weight) no zero is read: the scales stand in for them, unused."""
    if BLOCK_K <= GROUP:
        s = tl.load(Scales + (k0 // GROUP) * N + offs_n, mask=n_mask, other=0.0)
        z = s
        if ZEROS:
            z = tl.load(Zeros + (k0 // GROUP) * N + offs_n, mask=n_mask, other=0.0)
        if SWAPPED:
            s, z = s[:, None], z[:, None]
        else:
            s, z = s[None, :], z[None, :]
    else:
        groups = offs_w // (GROUP // (32 // BITS))  # (each word row's group)
        if SWAPPED:
            at, ok = groups[None, :] * N + offs_n[:, None], n_mask[:, None]
        else:
            at, ok = groups[:, None] * N + offs_n[None, :], n_mask[None, :]
        s = tl.load(Scales + at, mask=ok, other=0.0)
        z = s
        if ZEROS:
            z = tl.load(Zeros + at, mask=ok, other=0.0)
    return s, z


@triton.jit(do_not_specialize=["M"])  # (docs/gpu.md#no-compile-mid-run)
def _w4a16_kernel(
    X,
    Qw,
    Scales,
    Zeros,
    Levels,
    Out,
    Partial,
    Counters,
    M,
    N,
    K,
    stride_xm,
    k_per_split,
    magic,
    GROUP: tl.constexpr,
    BITS: tl.constexpr,
    IEEE: tl.constexpr,
    AS_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NIBBLE_DOTS: tl.constexpr,
    PTX_VALUES: tl.constexpr,
    FACTORED: tl.constexpr,
    SWAPPED: tl.constexpr,
    INTEGER_ZEROS: tl.constexpr,
    CODEBOOK: tl.constexpr,
    LOOP_STAGES: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """Out[m, n] = sum over K of X[m, k] * W[n, k] (see the module); with K split (SPLIT) this
    program's share of it, added to the others' by `split_k.finish`."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    k_start = pid_k * k_per_split
    k_stop = tl.minimum(k_start + k_per_split, K)
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # (SWAPPED's: the output transposed)
    acc_gemv = tl.zeros((BLOCK_K // (32 // BITS), BLOCK_N), dtype=tl.float32)  # (BLOCK_M = 1's)
    # (LOOP_STAGES: the GEMV's and swapped tiles' loads pipelined as `GemmConfig.num_stages` says; None:
    # the loads feeding dots alone)
    for k0 in tl.range(k_start, k_stop, BLOCK_K, num_stages=LOOP_STAGES):
        # each int32 read once: [BLOCK_K / P, BLOCK_N] words (row r holds k = k0 + P * r + j at bits BITS * j)
        offs_w = k0 // (32 // BITS) + tl.arange(0, BLOCK_K // (32 // BITS))
        # the scales and zeros over the words: one row of them ([1, BLOCK_N]) where the step is in one
        # group, else each word row's group's ([BLOCK_K / P, BLOCK_N]); transposed for SWAPPED's words
        s, z = _group_rows(
            Scales, Zeros, k0, offs_w, offs_n, n_mask, N, GROUP, BLOCK_K, BITS, SWAPPED, not CODEBOOK
        )
        packed = offs_w  # (SWAPPED loads its words transposed)
        if not SWAPPED:
            packed = tl.load(
                Qw + offs_w[:, None].to(tl.int64) * N + offs_n[None, :],
                mask=(offs_w < k_stop // (32 // BITS))[:, None] & n_mask[None, :],
                other=0,
            )
        if SWAPPED:
            acc_t = swapped_step(
                acc_t, Qw, X, k0, offs_w, offs_n, offs_m, n_mask, m_mask, k_stop, N, stride_xm, s, z,
                BITS, BLOCK_N, BLOCK_K, NIBBLE_DOTS, PTX_VALUES, IEEE, AS_FP32, INTEGER_ZEROS,
            )  # fmt: skip
        elif FACTORED:  # (the GEMV's)
            acc_gemv = factored_words(acc_gemv, packed, X + pid_m * stride_xm, offs_w, s, z, magic, BITS)
        elif BLOCK_M == 1 or NIBBLE_DOTS:  # value j of every word at once: a [BLOCK_K / P, BLOCK_N] tile
            values = packed  # (no values before the loop but by PTX)
            if PTX_VALUES:  # every value of the words at once, in x's dtype
                values = values_ptx(packed, s, z, PTX_VALUES == 1)
            s = s.to(tl.float32)
            z = biased_zeros(z, INTEGER_ZEROS)
            for j in tl.static_range(32 // BITS):
                if PTX_VALUES:
                    w = values[j]
                elif CODEBOOK:
                    w = level(packed, j, s, Levels, BITS)
                else:
                    w = value(packed, j, z, s, BITS, INTEGER_ZEROS)
                offs_k = offs_w * (32 // BITS) + j  # x's columns for value j: every P-th from j
                if BLOCK_M == 1:  # one row on the CUDA cores, times x's columns broadcast over the words'
                    # (x as a vector: a [1, K] tile would take a layout of its own, into which the compiler
                    # moves the weights through shared memory)
                    x = tl.load(X + pid_m * stride_xm + offs_k, mask=offs_k < k_stop, other=0.0)
                    acc_gemv += w.to(tl.float32) * x.to(tl.float32)[:, None]
                else:  # its own dot
                    x = tl.load(
                        X + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
                        mask=m_mask[:, None] & (offs_k < k_stop)[None, :],
                        other=0.0,
                    )
                    acc = accumulate(acc, x, w, IEEE, AS_FP32)
        else:  # the P values of each word laid out as the [BLOCK_K, BLOCK_N] tile, one dot
            offs_k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(
                X + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
                mask=m_mask[:, None] & (offs_k < k_stop)[None, :],
                other=0.0,
            )
            shifts = tl.arange(0, 32 // BITS) * BITS
            q = (packed[:, None, :] >> shifts[None, :, None]) & ((1 << BITS) - 1)
            q = tl.reshape(q, (BLOCK_K, BLOCK_N))
            if BLOCK_K > GROUP:  # (each K row's group's: the word rows' spread over their P values)
                s = tl.reshape(
                    tl.broadcast_to(s[:, None, :], (BLOCK_K // (32 // BITS), 32 // BITS, BLOCK_N)),
                    (BLOCK_K, BLOCK_N),
                )
                z = tl.reshape(
                    tl.broadcast_to(z[:, None, :], (BLOCK_K // (32 // BITS), 32 // BITS, BLOCK_N)),
                    (BLOCK_K, BLOCK_N),
                )
            # in fp32, then one rounding to the activations' dtype (as the reference path's weight)
            if CODEBOOK:
                w = tl.load(Levels + q) * s.to(tl.float32)
            else:
                w = (unsigned_to_float(q) - z.to(tl.float32)) * s.to(tl.float32)
            acc = accumulate(acc, x, w, IEEE, AS_FP32)
    if BLOCK_M == 1:
        acc = tl.sum(acc_gemv, axis=0)[None, :]
    if SWAPPED:
        acc = tl.trans(acc_t)
    finish(acc, Out, Partial, Counters, Out, offs_m, offs_n, M, N, N, False, SPLIT)


class GemmConfig(NamedTuple):
    """One launch's tile sizes and K split (`choose_config`). `num_stages`: the loads feeding the dots
    that many loop iterations deep; the GEMV's (BLOCK_M 1, no dot) likewise, every load of its loop through
    asynchronous copies from 2 (1: plain loads; in the sm_90 binary at 4, 4 LDGSTS a step and 14 KB of
    shared memory, 90 registers against 71)."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int
    nibble_dots: bool = True  # a dot per value of the words where the tiles allow (the module's docstring)
    ptx_values: bool = False  # those values by PTX, where they run (`ptx_values`)
    factored: bool = False  # the GEMV's scales and zeros once a word (`factored_words`; BLOCK_M 1 only)
    swapped: bool = False  # W the dots' first operand, x (padded to 16 rows) the second (`swapped`)


def _block_k(group: int, k: int, most: int) -> int:
    """The largest power of two <= `most` that divides K and either divides the group (a K block in one
    group) or is a multiple of it (a block of whole groups, each word row's scales and zeros its own)."""
    bk = most
    while bk > 16 and (k % bk or (group % bk and bk % group)):
        bk //= 2
    return bk


def nibble_dots(cfg: GemmConfig, bits: int) -> bool:
    """Whether a launch with `cfg` takes a dot per value of the words: asked for, and its tiles allow it
    (16 rows or more, BLOCK_K / P >= 16: each dot's K at least the tensor cores' 16)."""
    return cfg.nibble_dots and cfg.block_m >= 16 and cfg.block_k // (32 // bits) >= 16


def factored(cfg: GemmConfig) -> bool:
    """Whether a launch with `cfg` is the factored GEMV (`factored_words`): asked for, at BLOCK_M 1."""
    return cfg.factored and cfg.block_m == 1


def swapped(cfg: GemmConfig) -> bool:
    """Whether a launch with `cfg` computes its tiles transposed, W x^T (`int4_tiles.swapped_step`): asked
    for, at BLOCK_M >= 16 (x's rows are the dots' second dimension, 16 at least)."""
    return cfg.swapped and cfg.block_m >= 16


def ptx_values(cfg: GemmConfig, bits: int, dtype: torch.dtype) -> bool:
    """Whether a launch with `cfg` dequantizes by PTX (`values_ptx`): asked for, a dot per value of the
    words (`nibble_dots`), the swapped tiles or the GEMV unfactored, 4 bits, half-precision activations,
    and compiled (not the interpreter)."""
    half = dtype in (torch.bfloat16, torch.float16)
    by_value = nibble_dots(cfg, bits) or swapped(cfg) or (cfg.block_m == 1 and not factored(cfg))
    return cfg.ptx_values and by_value and bits == 4 and half and not INTERPRET


def choose_config(m: int, n: int, k: int, group: int, sms: int = SMS) -> GemmConfig:
    """Tiles by the row count: one row takes the GEMV (BLOCK_M 1), its values by PTX where they can be
    (`ptx_values`), K split until its programs fill the `sms` SMs as its registers allow
    (`GEMV_PROGRAMS_PER_SM`), each share two K steps at least; up to 16 rows, 16-row tiles, K split until
    about `_TARGET_PROGRAMS` programs run; larger M takes larger tiles and fewer splits.

    The GEMV's split is not yet timed (the kit's `int4_gemv_stages` table). On an H200 at one row, split
    for ~2 programs an SM, its time followed its programs' count, each keeping one 4 KB step in flight:
    ~0.9 us a step after ~6 us fixed (Llama-3-8B's qkv 20.2 us for 192 programs of 16 steps, o 13.0 for 256
    of 8, down 30.7 for 256 of 28, gate/up 42.6 for 448 of 32, 1.4 TB/s at the most: 0.8-1.8 MB in flight
    where ~4 TB/s wants ~4 MB; tinygemm 9.7, 6.9, 18.8 and 33.1; the 16-row tiles' dots per value 25.9,
    16.6, 42.9 and 62.9: bench/results/h200-2026-11-27-gemv/int4_gemm.log). So it now runs ~7 an SM (768,
    704, 896 and 896 programs there). The dots per value stay asked for at one row, for 16-row tiles forced
    there (`--block-m 16`): on an H100 they took 0.83-0.96x the reshaped tile's time at one row, 1.25-1.45x
    at 16, where each dot loads 16 rows of x strided (bench/results/h100-2026-11-26/quant/run2/int4_gemm.log).
    `GAPLESS_INT4_SWAPPED`: up to 64 rows, the swapped tiles (`swapped`) instead, one row padded to 16."""
    swap = m <= 64 and env.INT4_SWAPPED.get()
    if m <= 16:
        bm, bn, bk, warps = 1 if m == 1 and not swap else 16, 64, _block_k(group, k, 128), 4
    elif m <= 64:
        bm, bn, bk, warps = 32 if m <= 32 else 64, 64, _block_k(group, k, 128 if swap else 64), 4
    else:
        bm, bn, bk, warps = 64, 128, _block_k(group, k, 64), 8
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    k_blocks = triton.cdiv(k, bk)
    split = 1
    if bm == 1:  # (the programs an SM holds; each share of K two steps at least)
        shares = min(_MAX_SPLIT, k_blocks // 2, GEMV_PROGRAMS_PER_SM * sms // tiles)
        split = triton.cdiv(k_blocks, triton.cdiv(k_blocks, shares)) if shares > 1 else 1
    else:
        while split * 2 <= _MAX_SPLIT and tiles * split * 2 <= _TARGET_PROGRAMS and k_blocks >= split * 8:
            split *= 2
    # (the GEMV's stages never timed: 1, its loads as timed; `python -m gapless.bench.int4_gemm --stages`.
    # The swapped tiles' neither: 4, for bytes in flight over instructions. In the sm_90 binary (Triton
    # 3.6, one row, Llama-3-8B's qkv) at 1 their loads are plain, one 4 KB K step a program in flight,
    # 253 instructions a step; at 4, three steps (the loop's wait leaves 8 copy groups), 380 instructions,
    # 38.6 KB of shared memory against 21.5, 96 registers either way; at 2 the wait leaves none in flight.
    # Roughly: at ~2 programs an SM plain loads would hold ~1.3 TB/s; 380 instructions a 4 KB step issue
    # at ~2.3 TB/s. The kit's table times 1 and 4.)
    stages = 1 if bm == 1 else 4 if swap else 3
    if swap:  # (one K tile a step, values by PTX)
        return GemmConfig(bm, bn, bk, split, warps, stages, nibble_dots=False, ptx_values=True, swapped=True)
    return GemmConfig(bm, bn, bk, split, warps, stages, nibble_dots=m == 1, ptx_values=m == 1)


@functools.lru_cache(maxsize=8)
def _sms(device: torch.device) -> int:
    """The GPU's SMs (`SMS` elsewhere: the interpreter's runs choose as an H100's would)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else SMS


def w4a16_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group: int,
    bits: int,
    config: GemmConfig | None = None,
    integer_zeros: bool = True,
    levels: torch.Tensor | None = None,
) -> torch.Tensor:
    """`x @ W^T` for x [M, K] (the activations' dtype, that of `scales`), W in the layout the module
    describes; the result [M, N] in x's dtype. `integer_zeros`: whether every zero is an integer, as a
    checkpoint's are (not a GGUF file's, `gguf_int4`, held in another float dtype: the values are then
    never made by PTX nor factored, whose arithmetic holds integer zeros alone, and each value's zero is
    subtracted apart from the 2^23 its bits are read under, `int4_values.value`). `levels`: a codebook's
    weight, `W[n, k] = levels[q] * scales[g, n]` (float32 [2^bits]; `zeros` unread), its values looked up
    (`int4_values.level`) on the GEMV and the Triton-valued tiles alone (not by PTX, factored or
    swapped)."""
    m, k = x.shape
    n = qweight.shape[1]
    if levels is not None:
        zeros = scales  # (unread)
        if levels.shape != (1 << bits,) or levels.dtype != torch.float32:
            raise ValueError(
                f"int{bits} GEMM: levels {tuple(levels.shape)} {levels.dtype}: float32 [{1 << bits}]"
            )
    if qweight.shape[0] * (32 // bits) != k or scales.shape != (k // group, n) or zeros.shape != scales.shape:
        raise ValueError(
            f"int{bits} GEMM: x {tuple(x.shape)}, qweight {tuple(qweight.shape)}, scales "
            f"{tuple(scales.shape)}, zeros {tuple(zeros.shape)} do not fit group {group}"
        )
    cfg = config or choose_config(m, n, k, group, _sms(x.device))
    if levels is not None:  # (looked up by Triton alone)
        cfg = cfg._replace(ptx_values=False, factored=False, swapped=False)
    bk = cfg.block_k
    if k % bk or bk & (bk - 1) or (group % bk and bk % group) or group < 32 // bits:
        raise ValueError(
            f"BLOCK_K {bk} must be a power of two dividing K {k} and dividing the group {group} or a "
            f"multiple of it (groups of at least {32 // bits})"
        )
    x = x.contiguous()
    k_blocks = triton.cdiv(k, cfg.block_k)
    k_per_split = triton.cdiv(k_blocks, cfg.split_k) * cfg.block_k
    split = triton.cdiv(k, k_per_split)
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    locks = counters(x.device, tiles) if split > 1 else None
    if locks is None:  # (unsplit, or a CUDA graph captured before the device has its counters)
        split, k_per_split = 1, k_blocks * cfg.block_k
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    partial = partial_sums(split, m, n, x.device) if split > 1 else out
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), split)
    _w4a16_kernel[grid](
        x,
        qweight,
        scales,
        zeros,
        levels if levels is not None else scales,
        out,
        partial,
        locks if locks is not None else out,
        m,
        n,
        k,
        x.stride(0),
        k_per_split,
        0x4B000000,  # (`factored_words`' magic)
        GROUP=group,
        BITS=bits,
        IEEE=x.dtype == torch.float32,
        AS_FP32=INTERPRET or x.dtype == torch.float32,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        NIBBLE_DOTS=nibble_dots(cfg, bits),
        PTX_VALUES=(1 if x.dtype == torch.bfloat16 else 2)
        if integer_zeros and ptx_values(cfg, bits, x.dtype)
        else 0,
        FACTORED=integer_zeros and factored(cfg),
        SWAPPED=swapped(cfg),
        INTEGER_ZEROS=integer_zeros,
        CODEBOOK=levels is not None,
        LOOP_STAGES=cfg.num_stages if cfg.block_m == 1 or swapped(cfg) else None,
        SPLIT=split > 1,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out
