"""Each row's top-p nucleus floor without sorting the vocabulary, as one Triton kernel.

The torch path (`gapless.sampling.sampler.apply_top_k_top_p`) sorts every row of the step's float32
[batch, vocab] logits (a sorted copy and an int64 index tensor of that size), takes their softmax (another
copy) and its cumulative sum, to find the smallest logit of the nucleus. Peers measured that sort at
2.3 ms for 128 rows of 131,072 logits on an H100 and 6.2 ms for 512 (vLLM pull request 40376): a large
part of a decode step, paid every step by requests with top-p and no top-k (Llama 3 Instruct's and
SmolLM2's generation defaults).

The nucleus is a value rule, so it needs no order. Sorted ascending, a token is dropped while the
cumulative probability up to and including it is <= 1 - p; equivalently a token with logit v stays when
the probability of the tokens with logits above v is < p. (Tokens tied with v: the sort keeps the last
of them exactly when that holds, and the floor keeps every token tied with it.) So the floor is the
smallest logit v with mass(> v) < p: `nucleus_floor` finds it by a search over the logits' values, one
program per row. Pass 1 finds the row's largest logit and the range of its values; then each pass sums the
row's probability mass above PROBES thresholds spread over the remaining range (as int32 keys whose order
is the floats' order) and keeps the sub-range where the rule turns true: 32 bits of keys in about eight
passes of 17-fold narrowing. Nothing [batch, vocab] is written; the row is read about nine times.

The rule is the sort's; the rounding is not. The sort path sums the softmax in ascending order after
dividing by the total, the kernel sums exp(x - max) above each threshold in block order and compares
with p times the total, so where a boundary token's mass lies within float32 rounding of p the two may
keep one token more or less. `gapless.sampling.fused` checks the kernel at start-up against the sort path
on rows whose boundaries are clear of rounding. The launcher reads sizes from host ints and never syncs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gapless.attention.triton_kernels import INTERPRET

BLOCK_V = 512
PROBES = 16  # thresholds a pass tests: each pass narrows the range of keys about 17-fold
# (constexpr: a jitted function may read no other globals on the GPU)
_KEY_MAX = tl.constexpr(2147483647)
_KEY_MIN = tl.constexpr(-2147483647)  # below every float's key (-inf's is -2139095041)


@triton.jit
def _key(x):
    """float32 -> int32 whose signed order is the floats' order (-0.0 counted as +0.0)."""
    bits = (x + 0.0).to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _nucleus_floor_kernel(
    Logits,
    stride_l,
    TopP,
    Floor,
    vocab,
    BLOCK: tl.constexpr,
    PROBES: tl.constexpr,
):
    """Program b writes row b's nucleus floor: its smallest logit v whose mass above (exp(x - max) summed
    over the logits x > v) is under top_p times the row's total; -inf where top_p >= 1 or the row has no
    finite logit."""
    row = tl.program_id(0)
    base = Logits + row.to(tl.int64) * stride_l
    p = tl.load(TopP + row)
    cols = tl.arange(0, BLOCK)
    largest = tl.full([BLOCK], float("-inf"), tl.float32)
    lowest_key = tl.full([BLOCK], _KEY_MAX, tl.int32)
    highest_key = tl.full([BLOCK], _KEY_MIN, tl.int32)
    for start in range(0, vocab, BLOCK):
        offs = start + cols
        x = tl.load(base + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
        finite = x > float("-inf")
        key = _key(x)
        largest = tl.maximum(largest, x)
        lowest_key = tl.minimum(lowest_key, tl.where(finite, key, _KEY_MAX))
        highest_key = tl.maximum(highest_key, tl.where(finite, key, _KEY_MIN))
    m = tl.max(largest, 0)
    lo = tl.min(lowest_key, 0)
    hi = tl.max(highest_key, 0)
    hi = tl.where(p < 1.0, hi, lo)  # top-p off: no search
    # the smallest key k in [lo, hi] with mass(> k) < p * total; mass(> hi) is 0, so hi qualifies
    probe = tl.arange(0, PROBES)
    while lo < hi:
        span = hi.to(tl.int64) - lo.to(tl.int64)
        thresholds = (lo.to(tl.int64) + span * (probe + 1).to(tl.int64) // (PROBES + 1)).to(tl.int32)
        above = tl.zeros([PROBES], tl.float32)
        total = 0.0
        for start in range(0, vocab, BLOCK):
            offs = start + cols
            x = tl.load(base + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
            e = tl.where(x > float("-inf"), tl.exp(x - m), 0.0)
            over = _key(x)[:, None] > thresholds[None, :]
            above += tl.sum(tl.where(over, e[:, None], 0.0), axis=0)
            total += tl.sum(e, axis=0)
        # false for the low thresholds, true from the first one that qualifies (the sums are monotone)
        failing = tl.sum(tl.where(above < p * total, 0, 1), axis=0)
        last_failing = tl.sum(tl.where(probe == failing - 1, thresholds, 0), axis=0)
        first_passing = tl.sum(tl.where(probe == failing, thresholds, 0), axis=0)
        lo, hi = (
            tl.where(failing == 0, lo, last_failing + 1),
            tl.where(failing == PROBES, hi, first_passing),
        )
    bits = lo ^ ((lo >> 31) & 0x7FFFFFFF)
    floor = bits.to(tl.float32, bitcast=True)
    floor = tl.where((p < 1.0) & (m > float("-inf")), floor, float("-inf"))
    tl.store(Floor + row, floor)


def nucleus_floor(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[B, 1] float32: each row's top-p nucleus floor, the smallest logit it keeps (-inf where top_p >= 1),
    as `gapless.sampling.sampler._nucleus_floor` finds it from the sorted row. `logits` [B, V] (masked
    tokens -inf: they hold no mass), `top_p` [B] float32."""
    batch, vocab = logits.shape
    out = torch.empty(batch, 1, dtype=torch.float32, device=logits.device)
    if batch == 0:
        return out
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    block = BLOCK_V if not INTERPRET else min(BLOCK_V, triton.next_power_of_2(vocab))
    _nucleus_floor_kernel[(batch,)](
        logits,
        logits.stride(0),
        top_p.to(torch.float32).contiguous(),
        out,
        vocab,
        BLOCK=block,
        PROBES=PROBES,
        num_warps=8,
    )
    return out
