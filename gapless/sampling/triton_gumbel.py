"""The seeded draw as one Triton kernel: temperature, Gumbel noise and the argmax over the vocabulary.

The torch path (`gapless.sampling.sampler.Sampler._draw`) divides the logits by the temperature into a
float32 [batch, vocab] copy, hashes the noise into a 4-byte [batch, vocab] buffer, adds them and takes the
argmax: about six passes over [batch, vocab]. `gumbel_argmax` reads the logits once, in their own dtype,
and makes the same numbers per element in registers: ``x / t`` in fp32 (IEEE-rounded division), the noise
of (row key, column) from the same lowbias32 hash (`gapless.sampling.sampler.gumbel_noise`: the same 32
bits, the same 23 of them turned into u in (0, 1), then ``-log(-log(u))``), their sum, and each program's
largest score and its first column. A [batch, programs] pair of small tensors then gives each row's token.
Greedy rows (temperature 0) take the argmax of the logits themselves, as the torch path does.

Bit for bit the torch path's scores, but for ``log``: the hash, the division and the sums are exact
IEEE operations on both, but the kernel's ``log`` is Triton's (numpy's under the interpreter, the GPU's
fast one on CUDA), not torch's, and may differ in the last bit, which can change a draw only where two
columns' scores are within an ulp of each other. `gapless.sampling.fused` checks the kernel against the
torch path at start-up on CUDA. Launchers read sizes from host ints and never sync the device.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from gapless.attention.triton_kernels import INTERPRET, _max

BLOCK_V = 1024
# enough programs a batch to cover the device about twice (each program scans a contiguous chunk)
PROGRAMS_PER_SM = 2
_CPU_SM_STANDIN = 4


@triton.jit
def _lowbias32(x):
    """lowbias32 on uint32 values (products wrap around mod 2**32, as the torch path's int32 ones do)."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _gumbel_argmax_kernel(
    Logits,
    stride_l,
    Temperature,
    Keys,
    BestScore,
    BestIndex,
    vocab,
    chunk,
    SCALE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program (b, c) scans columns [c * chunk, (c + 1) * chunk) of row b; writes its largest score and
    the first column holding it. SCALE: divide the logits by the row's temperature first (else they come
    scaled and filtered); temperature 0 (greedy) adds no noise."""
    b = tl.program_id(0)
    c = tl.program_id(1)
    t = tl.load(Temperature + b)
    key = tl.load(Keys + b).to(tl.uint32, bitcast=True)
    noisy = t > 0.0
    t_safe = tl.where(noisy, t, 1.0)
    # loop-carried scalars typed up front (fp32, int32), so the GPU compiler sees one type per variable
    best = tl.full([], float("-inf"), tl.float32)
    best_i = tl.full([], 0, tl.int32) + vocab  # past any column: marks "nothing seen yet"
    start = c * chunk
    end = tl.minimum(start + chunk, vocab)
    for v0 in range(start, end, BLOCK):
        cols = v0 + tl.arange(0, BLOCK)
        mask = cols < end
        x = tl.load(Logits + b.to(tl.int64) * stride_l + cols, mask=mask, other=float("-inf")).to(tl.float32)
        if SCALE:
            x = tl.where(noisy, tl.math.div_rn(x, t_safe), x)
        col_hash = _lowbias32(cols.to(tl.uint32) * 0x9E3779B9 + 1)
        n = (_lowbias32(key ^ col_hash) >> 9).to(tl.float32)  # 23 bits: exact in fp32
        u = (n + 0.5) * 1.1920928955078125e-07  # 2**-23
        g = -tl.log(-tl.log(u))
        s = tl.where(noisy, g + x, x)
        s = tl.where(mask, s, float("-inf"))
        top = _max(s, 0)
        top_i = -_max(tl.where(s == top, -cols, -vocab), 0)  # the first column holding the block's max
        better = (top > best) | (best_i == vocab)  # an all -inf row: its first column, as torch
        best_i = tl.where(better, top_i, best_i)
        best = tl.where(better, top, best)
    tl.store(BestScore + b * tl.num_programs(1) + c, best)
    tl.store(BestIndex + b * tl.num_programs(1) + c, best_i)


@functools.cache
def _num_sms(device: torch.device) -> int:
    """The device's SMs (asked once per device: a host query each step would cost microseconds)."""
    if device.type != "cuda":
        return _CPU_SM_STANDIN
    return torch.cuda.get_device_properties(device).multi_processor_count


def gumbel_argmax(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    keys: torch.Tensor,
    scale: bool,
    num_sms: int | None = None,
) -> torch.Tensor:
    """Each row's token: argmax of ``logits / temperature + gumbel(key, column)`` (`scale`), or of
    ``logits + gumbel`` for logits already scaled and filtered; rows of temperature 0: argmax of
    ``logits``. `logits` [B, V] fp32/bf16/fp16 with unit column stride; `temperature` [B] fp32; `keys`
    [B] int32, the bits of each row's `_row_keys`. Returns int64 [B]."""
    batch, vocab = logits.shape
    if batch == 0:
        return torch.empty(0, dtype=torch.int64, device=logits.device)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    if num_sms is None:
        num_sms = _num_sms(logits.device)
    programs = triton.cdiv(PROGRAMS_PER_SM * num_sms, batch)
    programs = max(1, min(programs, triton.cdiv(vocab, BLOCK_V)))
    chunk = triton.cdiv(triton.cdiv(vocab, programs), BLOCK_V) * BLOCK_V  # whole blocks a program
    programs = triton.cdiv(vocab, chunk)
    best = torch.empty(batch, programs, dtype=torch.float32, device=logits.device)
    best_i = torch.empty(batch, programs, dtype=torch.int32, device=logits.device)
    _gumbel_argmax_kernel[(batch, programs)](
        logits,
        logits.stride(0),
        temperature.contiguous(),
        keys.contiguous(),
        best,
        best_i,
        vocab,
        chunk,
        SCALE=scale,
        BLOCK=BLOCK_V if not INTERPRET else min(BLOCK_V, triton.next_power_of_2(vocab)),
        num_warps=4,
    )
    return best_i.gather(1, best.argmax(dim=1, keepdim=True)).squeeze(1).to(torch.int64)
