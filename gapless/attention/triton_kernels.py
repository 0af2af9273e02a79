"""Paged attention in Triton: ragged extend (prefill) and split-KV decode.

Keys and values are never copied into a contiguous per-request buffer: every kernel reads them through
the request table (`req_table[rows[b], j]` is the KV slot of token j of request b), a block of slots at a
time, so the cache layout (page size, fragmentation, a prefix that ends mid-page) is only table content.

- `extend_attention`: one program per (query block, request, query head). Each loops over its request's
  keys up to the last position any of its queries may see, with an online softmax in fp32 (running max,
  running sum, rescaled accumulator). The causal mask is `key_pos <= prefix_len + query_offset`, or
  `key_pos <= q_limits[token]` where the batch gives bounds (`LIMITS`, compiled apart: an image's tokens
  that see their whole image, Gemma 3). The key
  blocks every query of the block sees whole (most of a long context) run first and without a mask; only
  the causal diagonal and a sliding window's edge are masked, as flash attention does.
- `decode_attention`: one query per request, one launch. A program per (request, kv head, split)
  handles all query heads that share the kv head (GQA/MQA, one `tl.dot` of [group, d] x [d, block])
  over its split of the context. A request whose context fits one split (always, with one split) gets
  its output written by that program; otherwise each split writes its normalised output and log-sum-exp
  to scratch and counts itself in an arrival counter, and the last split of the (request, kv head) to
  arrive merges them all, in the same launch (no second kernel, and nothing merged at a large batch).
  The number of splits is a host int chosen from `max_seq_len` and the batch's (request, kv head)
  programs against the SMs, so a long context is spread over many programs when the batch is small (a
  lone request's 4k context over 33 x 8 programs on 132 SMs), and a large batch (256 x 8 kv heads) runs
  one split a request, each KV page read once. `DecodeTuning` holds the knobs (keys per block, warps,
  stages, the split heuristic's targets) for `gapless.bench.kernels` to sweep.

An fp8 KV cache (`--kv-cache-dtype fp8`: e4m3, or `fp8_e5m2`) is read by the same kernels, compiled apart
(`KV_FP8`, a constexpr: the bf16 kernels are unchanged): keys and values are widened to q's dtype as they
are loaded, a half-precision q taken to float16 first (`clamped_fp16`: e4m3 widens to float16 exactly in
one instruction a pair, to bfloat16 only through float16 on sm_90; e5m2 is a float16's high byte), the
per-tensor k scale is folded into the score scale and the v scale applied to the output once, both read
from device tensors (so CUDA graphs replay them as they are set, and nothing syncs).

Launchers read grid sizes from host ints (`max_extend_len`, `max_seq_len`, shapes) and never sync the
device. Softmax runs in base 2 (`exp2`, with log2(e) folded into the scale). Head dims need not be powers
of two: the head dimension is padded to a power of two >= 16 and masked.

Two portability notes. fp32 inputs use `input_precision="ieee"` in `tl.dot`, since the default (tf32 on
NVIDIA) would cost about three decimal digits. Triton's interpreter (TRITON_INTERPRET=1, used for CPU
tests) multiplies the raw bits of bf16 `tl.dot` operands (triton-lang/triton#11584, "not supported yet"),
so under the interpreter bf16 operands are upcast to fp32 first; the values are unchanged, only the
product is exact rather than done by tensor cores.

The interpreter is picked when `@triton.jit` runs: for these kernels when this module is first imported
(`INTERPRET` records which mode they were built in), but for triton.language's own `@jit` helpers
(`tl.sum`, `tl.max`, `tl.zeros`, ...) when triton.language is first imported, which torch may do on its own
long before (in this repo, importing `gapless.testing` does). The interpreter cannot call helpers built in
GPU mode, so the kernels use builtins where there is one (`tl.full`, not `tl.zeros`) and call the two
reductions through `_max`/`_sum`: `tl.max`/`tl.sum` themselves on the GPU, interpreted copies of them under
the interpreter.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from gapless import env, pdl
from gapless.attention.base import AttentionMetadata
from gapless.memory.kv_pool import E5M2, FP8_DTYPES

INTERPRET = env.TRITON_INTERPRET.get()

_LOG2E = 1.4426950408889634
MAX_SPLITS = 64
MIN_SPLIT_LEN = 64  # keys: one default key block; a shorter split would only add a merge
_MERGE_TILE = 8192  # fp32 elements of split outputs the merging program reads at a time
_DECODE_BLOCK_N = 64
_NO_WINDOW = 2**30  # the window of a layer without one: past any context, so it masks nothing
KVScaleArgs = tuple[torch.Tensor | None, torch.Tensor | None]  # an fp8 cache's (k_scale, v_scale)


@dataclass(frozen=True)
class DecodeTuning:
    """The split-KV decode kernel's knobs, for `python -m gapless.bench.kernels` to sweep on a GPU and for
    `TritonBackend(decode_tuning=...)` to set. Any values compute the same attention (the CPU suite checks
    every kernel variant against the torch reference); they change only the speed. Under Triton's
    interpreter `num_warps` and `num_stages` do nothing: they shape the GPU code alone.

    - `block_n`: keys a program loads per step (a power of two >= 16; None: 64, 32 past head dim 128).
    - `num_warps`, `num_stages`: the launch's warps and software-pipelining depth (Triton's meanings).
      In the sm_90 binary (Triton 3.6 and 3.9, head dim 128, 64-key blocks) 2-4 stages keep one buffer
      of keys and values: a step waits for all its copies at its top (`DEPBAR.LE SB0, 0x0`), computes,
      then copies the next block, so a program's loads and its compute take turns; 5 keep two, and a
      step waits only for its own block (`0x4`: four copy groups, the next block's keys and values and
      the slots three blocks ahead in two layouts, stay in flight through its compute), for shared
      memory (73.7 KB over bf16 and 57.3 over fp8, against 39.9) and registers (Triton 3.6: 128 over
      bf16 and 148 over fp8, against 96 and 138). `GAPLESS_DECODE_STAGES` sets it for the engine's
      default tuning.
    - `programs_per_sm`: the split count aims at this many programs per SM (`decode_num_splits`).
    - `min_split_len`: no split shorter than this many keys (each split costs the merge a row).
    - `heads_first`: launch a request's kv heads next to each other (its programs run at the same time,
      and each token's K/V row of all heads, contiguous in the pool, is read at once) rather than each kv
      head's requests (the default; the GPU sweep says which reads faster).
    - `whole_blocks`: a split's whole key blocks in a loop without masks, its partial last block after
      (one mask for every block, the default). In the sm_90 binary, 64-key blocks at head dim 128: a
      loop body of 555 instructions instead of 611 over an fp8 cache, 359 instead of 457 over bf16, for
      more registers (148 against 143, 96 against 79): for the GPU sweep to weigh.
    - `values_in_pairs`: over an e4m3 cache on sm_89+, the values read as 16-bit pairs and widened by one
      PTX conversion a pair before P @ V's layout change (`_fp8_pairs_to_fp16`), instead of the e4m3
      tile Triton reads from shared memory a byte at a time (over an e5m2 cache, on any GPU, the pairs
      are widened by integer shifts). In the sm_90 binary: a loop body of 453
      instructions and 105 registers instead of 611 and 143 (397 and 124 with `whole_blocks`). Elsewhere
      (another cache, an older GPU) it changes nothing; under the interpreter the same pairs are widened
      by Triton's conversions. None (the default): on with blocks of 64 keys or more. On an H200 at batch
      256 and head dim 128, pairs took 64-key blocks over an fp8 cache from 254 to 210 us at 1k keys and
      965 to 807 at 4k, and 32-key blocks from 273 to 316 and 1,057 to 1,227; `whole_blocks` took bf16's
      64-key blocks from 279 to 289 and 1,085 to 1,132 (bench/results/h200-2026-11-27-gemv).
    - `prefetch`: each key block's keys and values loaded into registers one block ahead, while the block
      before is computed, and its slots two blocks ahead, with Triton's own pipelining off in that loop
      (`_prefetched_blocks`; `num_stages` then shapes nothing of it). In the sm_90 binary Triton's
      pipelining, at 2-4 stages, issues the next block's copies near a step's end and waits for all of
      them at the top of the next step (the slots' load ahead of the keys' keeps it from going deeper
      short of 5 stages: `num_stages`), so a program's loads and its compute take turns; prefetched,
      each load is in flight through a whole step's compute, for the tiles' registers (sm_90 binary,
      Triton 3.6, head dim 128, group 4, 64-key blocks: 241 registers over bf16 where the default takes
      96, 204 over fp8 where it takes 138, at 4 warps; 150 and 126 at 8), so fewer programs an SM. Not
      with `whole_blocks` (every block is masked, as the last one). For the GPU sweep to weigh.
    - `max_registers`: a cap on the registers a thread (Triton's `maxnreg`, ptxas's `.maxnreg`), so more
      programs fit an SM; None: the compiler's choice. Each program has about one block of keys and
      values in flight at a time, so the programs an SM holds bound its bytes in flight. In the sm_90
      binary (Triton 3.6, head dim 128, group 4, 64-key blocks, 4 warps) the fp8 kernel takes 138
      registers, 3 programs an SM by registers where bf16's 96 allow 5 (both 40 KB of shared memory, 5
      by it): capped at 96 it takes 96, no spills, 563 loop instructions against 542.
    """

    block_n: int | None = None
    num_warps: int = 4
    num_stages: int = 2
    programs_per_sm: int = 2
    min_split_len: int = MIN_SPLIT_LEN
    heads_first: bool = False
    whole_blocks: bool = False
    values_in_pairs: bool | None = None
    prefetch: bool = False
    max_registers: int | None = None

    def __post_init__(self) -> None:
        _check_tuning(
            self, "decode", ("block_n",), ("num_warps", "num_stages", "programs_per_sm", "min_split_len")
        )
        if self.max_registers is not None and not 24 <= self.max_registers <= 255:
            raise ValueError(f"decode max_registers={self.max_registers}: must be in [24, 255]")
        if self.prefetch and self.whole_blocks:
            raise ValueError("decode prefetch and whole_blocks: one or the other (prefetch masks each block)")

    def keys_per_block(self, head_dim: int) -> int:
        """`block_n`, or its default for `head_dim`."""
        if self.block_n is not None:
            return self.block_n
        return _DECODE_BLOCK_N if _block_d(head_dim) <= 128 else 32

    def pairs(self, head_dim: int) -> bool:
        """`values_in_pairs`, or its default for `head_dim`'s key blocks."""
        if self.values_in_pairs is not None:
            return self.values_in_pairs
        return self.keys_per_block(head_dim) >= 64


@dataclass(frozen=True)
class ExtendTuning:
    """The extend kernel's knobs, as `DecodeTuning` is the decode kernel's
    (`TritonBackend(extend_tuning=...)`, swept by `python -m gapless.bench.kernels`): any values compute
    the same attention; they change only the speed.

    - `block_m`, `block_n`: queries a program takes and keys it loads per step (powers of two >= 16;
      None: 64 and 64 up to head dim 128, where fp32 keys go by 32; 32 and 32 past it).
    - `num_warps`, `num_stages`: the launch's warps and software-pipelining depth. As the decode
      kernel's (`DecodeTuning`), in the sm_90 binary 2-4 stages keep one buffer of keys and values, and
      5 two (Triton 3.6, head dim 128: 116.7 KB of shared memory over bf16 against 82.9, 246 registers
      against 220).
    """

    block_m: int | None = None
    block_n: int | None = None
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        _check_tuning(self, "extend", ("block_m", "block_n"), ("num_warps", "num_stages"))

    def blocks(self, head_dim: int, element_size: int) -> tuple[int, int]:
        """(block_m, block_n), their defaults for `head_dim` and the element size where unset."""
        block_d = _block_d(head_dim)
        if block_d <= 64:
            m, n = 64, 64
        elif block_d <= 128:
            m, n = 64, 64 if element_size <= 2 else 32
        else:
            m, n = 32, 32
        return self.block_m or m, self.block_n or n


def _check_tuning(tuning: object, kernel: str, blocks: tuple[str, ...], counts: tuple[str, ...]) -> None:
    """Refuse knobs no launch can take, naming the kernel and the knob."""
    for name in blocks:
        value = getattr(tuning, name)
        if value is not None and (value < 16 or value & (value - 1)):
            raise ValueError(f"{kernel} {name}={value}: must be a power of two >= 16")
    for name in counts:
        if getattr(tuning, name) < 1:
            raise ValueError(f"{kernel} {name}={getattr(tuning, name)}: must be >= 1")


DEFAULT_DECODE = DecodeTuning()
DEFAULT_EXTEND = ExtendTuning()


def default_decode_tuning() -> DecodeTuning:
    """`DEFAULT_DECODE`, with its registers capped as `GAPLESS_DECODE_MAX_REGISTERS` says and its stages as
    `GAPLESS_DECODE_STAGES` says, each where it is set."""
    tuning, cap, stages = DEFAULT_DECODE, env.DECODE_MAX_REGISTERS.get(), env.DECODE_STAGES.get()
    if cap is not None:
        tuning = replace(tuning, max_registers=cap)
    if stages is not None:
        tuning = replace(tuning, num_stages=stages)
    return tuning


if INTERPRET:
    from triton.runtime.interpreter import InterpretedFunction

    def _interpreted(f):
        return f if isinstance(f, InterpretedFunction) else InterpretedFunction(f.fn)

    _max, _sum = _interpreted(tl.max), _interpreted(tl.sum)
else:
    _max, _sum = tl.max, tl.sum


@triton.jit
def clamped_fp16(x):
    """x in float16, for dots against e4m3 (an fp8 cache's keys and values, FP8 weights): e4m3 widens to
    float16 exactly, two in one instruction, where bfloat16 costs three more a pair (sm_90); a bfloat16 x
    is exact in float16 inside its range, to which it is clamped."""
    return tl.minimum(tl.maximum(x.to(tl.float32), -65504.0), 65504.0).to(tl.float16)


@triton.jit
def _fp8_pairs_to_fp16(w, HOW: tl.constexpr):
    """Each uint16 of `w` (two fp8 values, the first in its low byte) as its two values in float16,
    exactly: (first, second). HOW 2: e4m3 by one PTX conversion a pair (sm_89+), opaque to Triton, so the
    layout change P @ V needs happens on the float16 values (`ldmatrix` transposes 16-bit elements; fp8
    ones it would read a byte at a time); 3: e4m3 by Triton's own conversions (the interpreter's path); 4:
    e5m2, whose byte is a float16's high byte, by integer masks and shifts (every target)."""
    # (constexpr branches, no early return: Triton compiles what follows a return, e4m3 included, which
    # targets before sm_89 lack)
    if HOW == 4:
        first = ((w & 0xFF) << 8).to(tl.uint16).to(tl.float16, bitcast=True)
        second = (w & 0xFF00).to(tl.uint16).to(tl.float16, bitcast=True)
    elif HOW == 2:
        first, second = tl.inline_asm_elementwise(
            "{ .reg .b32 t; cvt.rn.f16x2.e4m3x2 t, $2; mov.b32 {$0, $1}, t; }", "=h,=h,h", [w],
            dtype=(tl.float16, tl.float16), is_pure=False, pack=1,
        )  # fmt: skip
    else:
        first = (w & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        second = (w >> 8).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
    return first, second


@triton.jit
def _load_keys(K, slots, kv_mask, kvh, offs_d, d_mask, stride_kt, stride_kh, MASK: tl.constexpr):
    """A block's keys at `slots`, [BLOCK_D, BLOCK_N], as the cache holds them. MASK False: every slot
    exists (`kv_mask` unused)."""
    if MASK:
        k_mask = kv_mask[None, :] & d_mask[:, None]
    else:
        k_mask = d_mask[:, None]
    return tl.load(K + slots[None, :] * stride_kt + kvh * stride_kh + offs_d[:, None], mask=k_mask, other=0.0)


@triton.jit
def _load_values(
    V, slots, kv_mask, kvh, offs_d, d_mask, stride_vt, stride_vh, MASK: tl.constexpr, KV_FP8: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):  # fmt: skip
    """A block's values at `slots`, [BLOCK_N, BLOCK_D], as the cache holds them; an fp8 cache's with
    KV_FP8 >= 2 as [BLOCK_N, BLOCK_D // 2] uint16 pairs along the head dimension (for `_add_values`)."""
    if KV_FP8 >= 2:
        pairs: tl.constexpr = offs_d.shape[0] // 2
        pair_mask = (tl.arange(0, pairs) < HEAD_DIM // 2)[None, :]  # (HEAD_DIM even)
        if MASK:
            pair_mask = kv_mask[:, None] & pair_mask
        first = (slots[:, None] * stride_vt + kvh * stride_vh) // 2  # (strides even: checked by the caller)
        v = tl.load(V.to(tl.pointer_type(tl.uint16), bitcast=True) + first + tl.arange(0, pairs)[None, :],
                    mask=pair_mask, other=0)  # fmt: skip
    else:  # (one return: Triton refuses returns of different types, even in a branch it leaves out)
        if MASK:
            v_mask = kv_mask[:, None] & d_mask[None, :]
        else:
            v_mask = d_mask[None, :]
        v = tl.load(
            V + slots[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :], mask=v_mask, other=0.0
        )
    return v


@triton.jit
def _scores(
    q, k, visible, scale_log2, cap_in, cap_out, m_i, l_i, SOFTCAP: tl.constexpr, IEEE: tl.constexpr,
    UPCAST: tl.constexpr, MASK: tl.constexpr, KV_FP8: tl.constexpr,
):  # fmt: skip
    """The online softmax's first half for a block of keys `k`: scores of `q` [M, BLOCK_D] where `visible`
    [M or 1, BLOCK_N] (others -inf), the new running max and sum, the block's weights p [M, BLOCK_N] and
    the factor `alpha` [M] the accumulator is rescaled by. SOFTCAP: scores s * scale become
    cap * tanh(s * scale / cap) (`cap_in` = scale / cap, `cap_out` = cap * log2(e)) before the mask, as
    Gemma 2 caps them. MASK False: every query sees every key of the block (`visible` unused). KV_FP8
    (nonzero): fp8 keys (e4m3 or e5m2), widened to q's dtype here (the k scale is folded into
    `scale_log2`/`cap_in` by the callers)."""
    if KV_FP8:
        k = k.to(q.dtype)
    # the dot's variants are spelt out, not a helper each: nested @jit calls are slow under the interpreter
    if UPCAST:
        k = k.to(tl.float32)
    if IEEE:
        s = tl.dot(q, k, input_precision="ieee")
    else:
        s = tl.dot(q, k)
    if SOFTCAP:  # tanh(x) = 1 - 2 / (exp(2x) + 1): no tanh builtin in every Triton, and exp2 saturates
        s = (1.0 - 2.0 / (tl.exp2(s * cap_in * (2.0 * 1.4426950408889634)) + 1.0)) * cap_out
    else:
        s = s * scale_log2
    if MASK:
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, _max(s, 1))
    # a row with nothing visible yet keeps m = -inf; subtracting 0 instead avoids (-inf) - (-inf)
    m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_sub)
    p = tl.exp2(s - m_sub[:, None])
    return m_new, l_i * alpha + _sum(p, 1), p, alpha


@triton.jit
def _add_values(
    p, v, alpha, acc, q, IEEE: tl.constexpr, UPCAST: tl.constexpr, KV_FP8: tl.constexpr,
):  # fmt: skip
    """The online softmax's second half: `acc` rescaled by `alpha` plus P @ V, for `_load_values`'s `v`
    (an fp8 cache's widened to q's dtype here, with KV_FP8 2-4 from pairs, a pair at once:
    `_fp8_pairs_to_fp16`; its v scale is the callers')."""
    if KV_FP8 >= 2:
        lo, hi = _fp8_pairs_to_fp16(v, KV_FP8)
        p, v = p.to(q.dtype), tl.reshape(tl.join(lo, hi), (p.shape[1], q.shape[1])).to(q.dtype)
    elif KV_FP8:  # P @ V in q's dtype, the values widened to it
        p, v = p.to(q.dtype), v.to(q.dtype)
    else:
        p = p.to(v.dtype)  # P @ V in the input dtype, as flash attention does
    if UPCAST:
        p, v = p.to(tl.float32), v.to(tl.float32)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p, v)
    return acc


@triton.jit
def _attend_block(
    q, K, V, slots, visible, kv_mask, kvh, offs_d, d_mask, stride_kt, stride_kh, stride_vt, stride_vh,
    scale_log2, cap_in, cap_out, m_i, l_i, acc, SOFTCAP: tl.constexpr, IEEE: tl.constexpr,
    UPCAST: tl.constexpr, MASK: tl.constexpr, KV_FP8: tl.constexpr, HEAD_DIM: tl.constexpr,
):  # fmt: skip
    """One block of keys of the online softmax, for both kernels, its keys and values loaded here: the
    keys, the scores, then the values (so that Triton's pipelining, or else the order, keeps the values
    out of the registers the scores need). Returns the new `m_i`, `l_i`, `acc`. MASK False: every key of
    the block exists (`kv_mask` all true) and every query sees it (`visible` all true)."""
    k = _load_keys(K, slots, kv_mask, kvh, offs_d, d_mask, stride_kt, stride_kh, MASK)
    m_i, l_i, p, alpha = _scores(
        q, k, visible, scale_log2, cap_in, cap_out, m_i, l_i, SOFTCAP, IEEE, UPCAST, MASK, KV_FP8
    )
    v = _load_values(V, slots, kv_mask, kvh, offs_d, d_mask, stride_vt, stride_vh, MASK, KV_FP8, HEAD_DIM)
    return m_i, l_i, _add_values(p, v, alpha, acc, q, IEEE, UPCAST, KV_FP8)


@triton.jit
def _prefetched_blocks(
    q, K, V, table_row, start, end, kvh, offs_d, d_mask, stride_kt, stride_kh, stride_vt, stride_vh,
    scale_log2, cap_in, cap_out, m_i, l_i, acc, SOFTCAP: tl.constexpr, IEEE: tl.constexpr,
    UPCAST: tl.constexpr, KV_FP8: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """The online softmax over the keys [start, end) of a table row, a block at a time, each block's keys
    and values loaded into registers a block ahead (during the block before's compute) and its slots two
    blocks ahead (`DecodeTuning.prefetch`); returns the new `m_i`, `l_i`, `acc`. Triton's pipelining is
    off in this loop: in the sm_90 binary, at 2-4 stages, it issues a step's copies of the next block
    near the step's end and waits for all of them at the top of the next step, before any of its
    compute, so their latency is not hidden (at 5 it is, for shared memory: `DecodeTuning.num_stages`)."""
    offs_n = start + tl.arange(0, BLOCK_N)
    n_mask = offs_n < end
    slots = tl.load(table_row + offs_n, mask=n_mask, other=0).to(tl.int64)
    k = _load_keys(K, slots, n_mask, kvh, offs_d, d_mask, stride_kt, stride_kh, True)
    v = _load_values(V, slots, n_mask, kvh, offs_d, d_mask, stride_vt, stride_vh, True, KV_FP8, HEAD_DIM)
    next_mask = offs_n + BLOCK_N < end
    next_slots = tl.load(table_row + offs_n + BLOCK_N, mask=next_mask, other=0).to(tl.int64)
    for n0 in tl.range(start, end, BLOCK_N, num_stages=1):
        k_now, v_now, mask_now = k, v, n_mask
        # (past `end` every lane is masked: nothing is read)
        k = _load_keys(K, next_slots, next_mask, kvh, offs_d, d_mask, stride_kt, stride_kh, True)
        v = _load_values(
            V, next_slots, next_mask, kvh, offs_d, d_mask, stride_vt, stride_vh, True, KV_FP8, HEAD_DIM
        )
        n_mask = next_mask
        offs_n = n0 + 2 * BLOCK_N + tl.arange(0, BLOCK_N)
        next_mask = offs_n < end
        next_slots = tl.load(table_row + offs_n, mask=next_mask, other=0).to(tl.int64)
        m_i, l_i, p, alpha = _scores(
            q, k_now, mask_now[None, :], scale_log2, cap_in, cap_out, m_i, l_i, SOFTCAP, IEEE, UPCAST, True,
            KV_FP8,
        )  # fmt: skip
        acc = _add_values(p, v_now, alpha, acc, q, IEEE, UPCAST, KV_FP8)
    return m_i, l_i, acc


@triton.jit
def _extend_kernel(
    Q,
    K,
    V,
    Rows,
    PrefixLens,
    ExtendLens,
    QStart,
    Table,
    scale_log2,
    cap_in,
    cap_out,
    window,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_table,
    KScale,
    VScale,
    QLimits,
    Out,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SOFTCAP: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
    KV_FP8: tl.constexpr,
    LIMITS: tl.constexpr,
):
    pid_m = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    ext = tl.load(ExtendLens + b)
    m0 = pid_m * BLOCK_M
    if m0 >= ext:  # the grid is sized for the longest request
        return
    prefix = tl.load(PrefixLens + b)
    q_start = tl.load(QStart + b)
    row = tl.load(Rows + b).to(tl.int64)
    kvh = h // GROUP

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < ext
    d_mask = offs_d < HEAD_DIM
    q_rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(
        Q + q_rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
        mask=m_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    elif KV_FP8 and not IEEE:  # (a float32 q keeps float32 dots)
        q = clamped_fp16(q)
    if KV_FP8:  # scores of e4m3 keys times the k scale: folded into the score scale
        k_scale = tl.load(KScale)
        scale_log2, cap_in = scale_log2 * k_scale, cap_in * k_scale
    q_pos = prefix + offs_m
    # keys past the last query of this block are masked for every row: don't visit them
    kv_end = prefix + tl.minimum(m0 + BLOCK_M, ext)
    if LIMITS:  # each query sees up to its own bound (>= itself): visit keys up to the largest
        q_lim = tl.maximum(tl.load(QLimits + q_rows, mask=m_mask, other=0), q_pos)
        kv_end = tl.minimum(tl.maximum(kv_end, _max(tl.where(m_mask, q_lim, 0), 0) + 1), prefix + ext)
    else:
        q_lim = q_pos

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
    table_row = Table + row * stride_table
    # keys before the first query's window are masked for every row: start at its block
    kv_start = tl.maximum(prefix + m0 - window + 1, 0) // BLOCK_N * BLOCK_N
    # The blocks [free_lo, free_hi) every query of the block sees whole: past the last query's window
    # start, and up to the first query's own position. They run without a mask, the blocks before them
    # (a window's edge) and after them (the causal diagonal) with one.
    q_last = prefix + tl.minimum(m0 + BLOCK_M, ext) - 1
    free_lo = tl.minimum(
        tl.maximum((tl.maximum(q_last - window + 1, 0) + BLOCK_N - 1) // BLOCK_N * BLOCK_N, kv_start), kv_end
    )
    free_hi = tl.maximum((prefix + m0 + 1) // BLOCK_N * BLOCK_N, free_lo)
    for n0 in range(free_lo, free_hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        slots = tl.load(table_row + offs_n).to(tl.int64)
        m_i, l_i, acc = _attend_block(
            q, K, V, slots, None, None, kvh, offs_d, d_mask, stride_kt, stride_kh, stride_vt, stride_vh,
            scale_log2, cap_in, cap_out, m_i, l_i, acc, SOFTCAP, IEEE, UPCAST, False, KV_FP8, HEAD_DIM,
        )  # fmt: skip
    # the masked blocks: [kv_start, free_lo), then [free_hi, kv_end), in one loop
    before = (free_lo - kv_start + BLOCK_N - 1) // BLOCK_N
    masked = before + (kv_end - free_hi + BLOCK_N - 1) // BLOCK_N
    for i in range(0, masked):
        n0 = tl.where(i < before, kv_start + i * BLOCK_N, free_hi + (i - before) * BLOCK_N)
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < kv_end
        slots = tl.load(table_row + offs_n, mask=n_mask, other=0).to(tl.int64)
        # causal (or up to the query's bound), and within the last `window` positions
        causal = offs_n[None, :] <= q_lim[:, None]
        visible = n_mask[None, :] & causal & (offs_n[None, :] > q_pos[:, None] - window)
        m_i, l_i, acc = _attend_block(
            q, K, V, slots, visible, n_mask, kvh, offs_d, d_mask, stride_kt, stride_kh, stride_vt, stride_vh,
            scale_log2, cap_in, cap_out, m_i, l_i, acc, SOFTCAP, IEEE, UPCAST, True, KV_FP8, HEAD_DIM,
        )  # fmt: skip

    if KV_FP8:
        acc = acc * tl.load(VScale)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        Out + q_rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
        out.to(Out.dtype.element_ty),
        mask=m_mask[:, None] & d_mask[None, :],
    )


@triton.jit(do_not_specialize=["stride_ml_b", "stride_ml_h"])  # (docs/gpu.md#no-compile-mid-run)
def _decode_split_kernel(
    Q,
    K,
    V,
    Rows,
    PrefixLens,
    ExtendLens,
    QStart,
    Table,
    scale_log2,
    cap_in,
    cap_out,
    window,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_table,
    KScale,
    VScale,
    Out,
    stride_ot,
    stride_oh,
    MidO,
    MidLse,
    Arrivals,
    stride_mo_b,
    stride_mo_h,
    stride_mo_s,
    stride_ml_b,
    stride_ml_h,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SOFTCAP: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
    KV_FP8: tl.constexpr,
    HEADS_FIRST: tl.constexpr,
    WHOLE_BLOCKS: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_C: tl.constexpr,
    PREFETCH: tl.constexpr,
    PDL: tl.constexpr,
):
    if HEADS_FIRST:  # grid (kv heads, batch, splits): a request's heads launch side by side
        kvh = tl.program_id(0)
        b = tl.program_id(1)
        kv_heads = tl.num_programs(0)
    else:  # grid (batch, kv heads, splits)
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        kv_heads = tl.num_programs(1)
    split = tl.program_id(2)
    pdl.wait_for_previous(PDL)
    seq_len = tl.load(PrefixLens + b) + tl.load(ExtendLens + b)
    # (loaded with the lengths, not after the return below: at batch 1 the kernel is a chain of loads,
    # each waiting on the one before, and these need not wait)
    row = tl.load(Rows + b).to(tl.int64)
    q_row = tl.load(QStart + b).to(tl.int64)
    # the query at seq_len - 1 sees keys [first, seq_len): the splits share out those alone, whole key
    # blocks each (only a split's last block is partial), so `active` splits are not empty
    first = tl.maximum(seq_len - window, 0)
    span = seq_len - first
    if SPLIT:
        per_split = (span + tl.num_programs(2) - 1) // tl.num_programs(2)
        chunk = (per_split + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    else:
        chunk = span
    active = (span + chunk - 1) // chunk
    start = first + split * chunk
    if start >= seq_len:
        return
    end = tl.minimum(start + chunk, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_mask = offs_h < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_h
    q = tl.load(
        Q + q_row * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=h_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [BLOCK_H, BLOCK_D]
    if UPCAST:
        q = q.to(tl.float32)
    elif KV_FP8 and not IEEE:  # (a float32 q keeps float32 dots)
        q = clamped_fp16(q)
    if KV_FP8:  # scores of e4m3 keys times the k scale: folded into the score scale
        k_scale = tl.load(KScale)
        scale_log2, cap_in = scale_log2 * k_scale, cap_in * k_scale

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_H], 0.0, tl.float32)
    acc = tl.full([BLOCK_H, BLOCK_D], 0.0, tl.float32)
    table_row = Table + row * stride_table
    if PREFETCH:
        m_i, l_i, acc = _prefetched_blocks(
            q, K, V, table_row, start, end, kvh, offs_d, d_mask, stride_kt, stride_kh, stride_vt, stride_vh,
            scale_log2, cap_in, cap_out, m_i, l_i, acc, SOFTCAP, IEEE, UPCAST, KV_FP8, HEAD_DIM, BLOCK_N,
        )  # fmt: skip
    else:
        whole = start
        if WHOLE_BLOCKS:  # the whole blocks first, unmasked
            whole += (end - start) // BLOCK_N * BLOCK_N
            for n0 in range(start, whole, BLOCK_N):
                slots = tl.load(table_row + n0 + tl.arange(0, BLOCK_N)).to(tl.int64)
                m_i, l_i, acc = _attend_block(
                    q, K, V, slots, d_mask[None, :], d_mask, kvh, offs_d, d_mask, stride_kt, stride_kh,
                    stride_vt, stride_vh, scale_log2, cap_in, cap_out, m_i, l_i, acc, SOFTCAP, IEEE, UPCAST,
                    False, KV_FP8, HEAD_DIM,
                )  # fmt: skip
        for n0 in range(whole, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_mask = offs_n < end
            slots = tl.load(table_row + offs_n, mask=n_mask, other=0).to(tl.int64)
            m_i, l_i, acc = _attend_block(
                q, K, V, slots, n_mask[None, :], n_mask, kvh, offs_d, d_mask, stride_kt, stride_kh,
                stride_vt, stride_vh, scale_log2, cap_in, cap_out, m_i, l_i, acc, SOFTCAP, IEEE, UPCAST,
                True, KV_FP8, HEAD_DIM,
            )  # fmt: skip
    if KV_FP8:  # before the split's output is written or merged: merging is linear in it
        acc = acc * tl.load(VScale)

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    hd_mask = h_mask[:, None] & d_mask[None, :]
    if active == 1:  # the whole context in one program (always, without SPLIT): the answer itself
        out_ptrs = Out + q_row * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(out_ptrs, (acc / l_safe[:, None]).to(Out.dtype.element_ty), mask=hd_mask)
        return
    if SPLIT:
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))  # base 2
        mo = MidO + b * stride_mo_b + heads[:, None] * stride_mo_h + split * stride_mo_s + offs_d[None, :]
        tl.store(mo, acc / l_safe[:, None], mask=hd_mask)
        tl.store(MidLse + b * stride_ml_b + heads * stride_ml_h + split, lse, mask=h_mask)
        # Every thread's stores are issued before the count goes up (the barrier), and the count's
        # release/acquire orders them before the last arrival's loads, which skip L1 (.cg): the last of
        # the request's `active` splits for this kv head merges them, in this same launch.
        tl.debug_barrier()
        arrivals = Arrivals + b * kv_heads + kvh
        if tl.atomic_add(arrivals, 1, sem="acq_rel", scope="gpu") == active - 1:
            tl.store(arrivals, 0)  # for the next launch (the next layer), which starts after this one ends
            _merge_splits(
                MidO, MidLse, Out, b, kvh, q_row, active, stride_mo_b, stride_mo_h, stride_mo_s, stride_ml_b,
                stride_ml_h, stride_ot, stride_oh, GROUP, HEAD_DIM, BLOCK_G, BLOCK_D, BLOCK_S, BLOCK_C,
            )  # fmt: skip


@triton.jit
def _merge_splits(
    MidO,
    MidLse,
    Out,
    b,
    kvh,
    q_row,
    active,
    stride_mo_b,
    stride_mo_h,
    stride_mo_s,
    stride_ml_b,
    stride_ml_h,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """The output of kv head `kvh`'s query heads of request `b` from its `active` splits' normalised
    outputs and log-sum-exps: weights 2^(lse - max) over their sum. The splits are read BLOCK_C at a time
    (a [BLOCK_G, BLOCK_C, BLOCK_D] tile), bypassing L1 (other programs wrote them in this launch)."""
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_g
    lse_row = MidLse + b * stride_ml_b + heads[:, None] * stride_ml_h
    offs_s = tl.arange(0, BLOCK_S)
    lse = tl.load(
        lse_row + offs_s[None, :],
        mask=g_mask[:, None] & (offs_s[None, :] < active),
        other=float("-inf"),
        cache_modifier=".cg",
    )  # [BLOCK_G, BLOCK_S]
    m = _max(lse, 1)
    m = tl.where(m == float("-inf"), 0.0, m)
    total = _sum(tl.exp2(lse - m[:, None]), 1)
    acc = tl.full([BLOCK_G, BLOCK_D], 0.0, tl.float32)
    mo_row = MidO + b * stride_mo_b + heads[:, None, None] * stride_mo_h + offs_d[None, None, :]
    for c0 in range(0, active, BLOCK_C):
        offs_c = c0 + tl.arange(0, BLOCK_C)
        gc_mask = g_mask[:, None] & (offs_c[None, :] < active)
        w = tl.exp2(
            tl.load(lse_row + offs_c[None, :], mask=gc_mask, other=float("-inf"), cache_modifier=".cg")
            - m[:, None]
        )  # [BLOCK_G, BLOCK_C]
        o = tl.load(
            mo_row + offs_c[None, :, None] * stride_mo_s,
            mask=gc_mask[:, :, None] & d_mask[None, None, :],
            other=0.0,
            cache_modifier=".cg",
        )  # [BLOCK_G, BLOCK_C, BLOCK_D]
        acc += _sum(w[:, :, None] * o, 1)
    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    tl.store(
        Out + q_row * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
        out.to(Out.dtype.element_ty),
        mask=g_mask[:, None] & d_mask[None, :],
    )


def _block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def _dot_flags(dtype: torch.dtype, kv_dtype: torch.dtype) -> dict[str, int]:
    """The kernels' dtype constexprs for queries of `dtype` over a cache of `kv_dtype`."""
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"attention kernels take fp32, bf16 or fp16, not {dtype}")
    upcast = INTERPRET and dtype == torch.bfloat16
    return {"IEEE": dtype == torch.float32 or upcast, "UPCAST": upcast, "KV_FP8": int(kv_dtype in FP8_DTYPES)}


def _values_in_pairs(v_cache: torch.Tensor) -> int:
    """The decode kernel's KV_FP8 for `DecodeTuning.values_in_pairs` over this fp8 value cache: for e5m2, 4
    (integer shifts, every target); for e4m3, 2 (PTX's pairwise conversion) on sm_89+ or for the sm_90
    compile harness (CPU tensors, no interpreter), 3 (Triton's conversions) under the interpreter; 1 (as
    without it) where the PTX instruction is missing or the pairs would not be whole 16-bit words."""
    if v_cache.stride(0) % 2 or v_cache.stride(1) % 2 or v_cache.data_ptr() % 2:
        return 1
    if v_cache.dtype == E5M2:
        return 4
    if INTERPRET:
        return 3
    if v_cache.is_cuda and torch.cuda.get_device_capability(v_cache.device) < (8, 9):
        return 1
    return 2


def last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    """`x`, copied only if its last dimension is strided: the kernels index rows by stride, elements by 1."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scales: KVScaleArgs) -> None:
    if k_cache.dtype in FP8_DTYPES and v_cache.dtype == k_cache.dtype:
        k_scale, v_scale = scales
        if k_scale is None or v_scale is None:
            raise ValueError("an fp8 KV cache needs its k_scale and v_scale")
        if any(
            s.dtype != torch.float32 or s.numel() != 1 or s.device != q.device for s in (k_scale, v_scale)
        ):
            raise ValueError(f"k_scale and v_scale must be one fp32 element each on {q.device}")
    elif q.dtype != k_cache.dtype or q.dtype != v_cache.dtype:
        raise TypeError(
            f"q, k_cache and v_cache must share a dtype (or the caches both be fp8 e4m3 or e5m2), got "
            f"{q.dtype}/{k_cache.dtype}/{v_cache.dtype}"
        )
    if q.shape[2] != k_cache.shape[2] or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"shape mismatch: q {tuple(q.shape)}, k {tuple(k_cache.shape)}, v {tuple(v_cache.shape)}"
        )
    if q.shape[1] % k_cache.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k_cache.shape[1]} kv heads")


def _window_arg(window: int | None) -> int:
    return _NO_WINDOW if window is None else min(window, _NO_WINDOW)


def _paged_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None,
    softcap: float | None,
    scales: KVScaleArgs,
) -> tuple:
    """The arguments both attention kernels start with: q, the caches, the batch's metadata, the scale
    (base 2), the soft-cap factors and the window (`_NO_WINDOW` for none), the strides, and an fp8
    cache's k/v scales (device pointers: nothing read on the host; another cache passes q, never read).
    q and the caches are checked and made last-dim contiguous here; `meta`'s tensors must already be
    contiguous (`TritonBackend.prepare` makes them so, once per batch)."""
    if window is not None and window < 1:
        raise ValueError(f"sliding window {window} must be >= 1")
    _check(q, k_cache, v_cache, scales)
    q, k_cache, v_cache = map(last_dim_contiguous, (q, k_cache, v_cache))
    return (
        q,
        k_cache,
        v_cache,
        meta.rows,
        meta.prefix_lens,
        meta.extend_lens,
        meta.q_start,
        meta.req_table,
        scale * _LOG2E,
        scale / softcap if softcap else 0.0,
        softcap * _LOG2E if softcap else 0.0,
        _window_arg(window),
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        meta.req_table.stride(0),
        q if scales[0] is None else scales[0],
        q if scales[1] is None else scales[1],
    )


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    tuning: ExtendTuning = DEFAULT_EXTEND,
    kv_scales: KVScaleArgs = (None, None),
) -> torch.Tensor:
    """Causal attention of each request's new tokens to its cached prefix and to each other (a token
    with a bound in `meta.q_limits` sees up to it).

    q: [T, heads, d] (flat, request b's tokens at `meta.q_start[b]`); caches: [slots, kv_heads, d]; the
    new tokens' K/V must already be in the cache. `window`, `softcap`: as `AttentionBackend.forward`
    takes them; `kv_scales`: an fp8 cache's (k_scale, v_scale), [1] fp32 device tensors. Returns
    [T, heads, d] in q's dtype."""
    args = _paged_args(q, k_cache, v_cache, meta, scale, window, softcap, kv_scales)
    limits = meta.q_limits
    T, heads, d = q.shape
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if T == 0 or meta.batch_size == 0 or meta.max_extend_len == 0:
        return out
    block_d = _block_d(d)
    block_m, block_n = tuning.blocks(d, q.element_size())
    grid = (triton.cdiv(meta.max_extend_len, block_m), meta.batch_size, heads)
    _extend_kernel[grid](
        *args,
        q if limits is None else limits,  # (never read without LIMITS)
        out,
        out.stride(0),
        out.stride(1),
        GROUP=heads // k_cache.shape[1],
        HEAD_DIM=d,
        BLOCK_D=block_d,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        SOFTCAP=bool(softcap),
        LIMITS=limits is not None,
        num_warps=tuning.num_warps,
        num_stages=tuning.num_stages,
        **_dot_flags(q.dtype, k_cache.dtype),
    )
    return out


def decode_num_splits(
    batch: int, kv_heads: int, max_seq_len: int, num_sms: int, tuning: DecodeTuning = DEFAULT_DECODE
) -> int:
    """Splits per request for decode, from the batch's (request, kv head) programs against the SMs: enough
    splits for `tuning.programs_per_sm` programs per SM (a batch of 256 requests x 8 kv heads already
    has 2048 programs for an H100's 132 SMs: one split), no split shorter than `tuning.min_split_len`
    keys, at most MAX_SPLITS. Host arithmetic only."""
    by_len = triton.cdiv(max(max_seq_len, 1), tuning.min_split_len)
    by_occupancy = triton.cdiv(tuning.programs_per_sm * num_sms, max(batch * kv_heads, 1))
    return max(1, min(by_len, by_occupancy, MAX_SPLITS))


class DecodeScratch(NamedTuple):
    """What the decode kernel of a split count needs besides its inputs, made once per batch and shared
    by its layers (every layer of a batch has the same shapes): the splits' normalised outputs `mid_o`
    [B, heads, splits, d] and base-2 log-sum-exps `mid_lse` [B, heads, splits] (fp32), and `arrivals`
    [B * kv_heads] int32, zero between launches, counting the splits of each (request, kv head) done."""

    splits: int
    mid_o: torch.Tensor
    mid_lse: torch.Tensor
    arrivals: torch.Tensor

    @staticmethod
    def make(
        batch: int, heads: int, kv_heads: int, d: int, splits: int, device: torch.device
    ) -> DecodeScratch:
        splits = max(1, min(splits, MAX_SPLITS))
        if splits == 1:  # nothing is merged: the kernel writes the output itself and reads none of it
            batch = heads = kv_heads = d = 1  # (a real buffer still: a launch takes no null pointer)
        mid_o = torch.empty(batch, heads, splits, d, dtype=torch.float32, device=device)
        mid_lse = torch.empty(batch, heads, splits, dtype=torch.float32, device=device)
        arrivals = torch.zeros(batch * kv_heads, dtype=torch.int32, device=device)
        return DecodeScratch(splits, mid_o, mid_lse, arrivals)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    num_splits: int,
    scale: float,
    scratch: DecodeScratch | None = None,
    window: int | None = None,
    softcap: float | None = None,
    tuning: DecodeTuning = DEFAULT_DECODE,
    kv_scales: KVScaleArgs = (None, None),
) -> torch.Tensor:
    """One new token per request (`extend_lens` all 1) attending to all `prefix_lens[b] + 1` keys (the
    last `window` of them, with a window; `softcap` as `AttentionBackend.forward` takes it), launched
    as `tuning` says: one launch, the last split of each (request, kv head) merging them all.

    `scratch`: `DecodeScratch.make` for this batch and `num_splits` (its split count wins); pass one to
    reuse it across layers, else it is made here. `kv_scales`: as `extend_attention` takes them."""
    args = _paged_args(q, k_cache, v_cache, meta, scale, window, softcap, kv_scales)
    T, heads, d = q.shape
    kv_heads = k_cache.shape[1]
    batch = meta.batch_size
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if T == 0 or batch == 0:
        return out
    if scratch is None:
        scratch = DecodeScratch.make(batch, heads, kv_heads, d, num_splits, q.device)
    splits, mid_o, mid_lse, arrivals = scratch
    group = heads // kv_heads
    block_d = _block_d(d)
    block_g = max(2, triton.next_power_of_2(group))
    block_s = max(2, triton.next_power_of_2(splits))
    grid = (kv_heads, batch, splits) if tuning.heads_first else (batch, kv_heads, splits)
    flags = _dot_flags(q.dtype, k_cache.dtype)
    if flags["KV_FP8"] and tuning.pairs(d):
        flags["KV_FP8"] = _values_in_pairs(v_cache)
    _decode_split_kernel[grid](
        *args,
        out,
        out.stride(0),
        out.stride(1),
        mid_o,
        mid_lse,
        arrivals,
        *mid_o.stride()[:3],
        *mid_lse.stride()[:2],
        GROUP=group,
        HEAD_DIM=d,
        BLOCK_H=max(16, triton.next_power_of_2(group)),  # tl.dot needs >= 16 rows
        BLOCK_D=block_d,
        BLOCK_N=tuning.keys_per_block(d),
        SOFTCAP=bool(softcap),
        HEADS_FIRST=tuning.heads_first,
        WHOLE_BLOCKS=tuning.whole_blocks,
        PREFETCH=tuning.prefetch,
        SPLIT=splits > 1,
        BLOCK_G=block_g,
        BLOCK_S=block_s,
        BLOCK_C=max(1, min(block_s, _MERGE_TILE // (block_g * block_d))),
        num_warps=tuning.num_warps,
        num_stages=tuning.num_stages,
        **({"maxnreg": tuning.max_registers} if tuning.max_registers else {}),
        **flags,
        **pdl.launch_args(q.device),
    )
    return out
