"""The whole seeded draw without a sort, split across the vocabulary: temperature, top-k, top-p, min-p,
Gumbel noise and the argmax, in a few Triton launches that never read anything back to the host.

Every launch runs programs (row, chunk): each reads one chunk of CHUNK columns of one row, so a lone row
still spreads over the whole GPU (152k columns: 149 programs), and each writes small partial results for
its chunk. The program that finishes a row's chunks last (a per-row arrival counter, bumped atomically
after the chunk's partials are stored) combines them in chunk order and writes the row's result, then
resets the counter for the next launch. Nothing [batch, vocab] is written.

Each row's filters become one floor on its scaled logits ``y = x / t``, found by value, not by order:
- `_bounds_kernel`: the row's largest y (m) and its smallest and largest finite y, as int32 keys whose
  order is the floats' order (`_key`).
- `_search_kernel`, top-k (COUNT): the k-th largest y is the smallest key v with fewer than k tokens
  above it; top-p (mass over the tokens top-k kept): the smallest key v whose mass above
  (``exp(y - m)`` summed) is under p times the kept mass, the sort path's rule (the nucleus keeps tokens
  while the ascending cumulative probability is over 1 - p). Each launch tests PROBES keys spread over the
  row's remaining range [lo, hi] and keeps the sub-range where the rule turns true; SEARCH_PASSES
  launches narrow 2**32 keys to one. A row that needs no search (or is done) reads nothing.
- min-p: ``y >= m + log(min_p)``, from m alone.
- `_draw_kernel`: each row's first column of the largest ``y + gumbel(key, column)`` over the tokens
  at or above its floors (greedy rows, temperature 0: of ``x`` alone, no noise, no filter).

Seeded batch invariance: a row's chunks, their partial sums and the order they are combined in depend on
the vocabulary alone, never on the batch, and each probe's sum is monotone in the probe (IEEE addition
is monotone in each operand), so a row's floors and token are the same alone, in any batch, in any row.
The noise is `gapless.sampling.sampler.gumbel_noise`'s (the same lowbias32 bits of the row's key,
`_row_keys` of its seed and step, computed here per row, and of the column), so an unfiltered draw is the
torch path's but where Triton's ``log`` rounds differently from torch's. The floors are the sort path's
rule rounded differently (sums in chunk order), so a boundary token whose mass lies within float32
rounding of p may be kept by one and not the other.

A row with top-k of at most WINDOW (Qwen3's 20, Hugging Face's 50) over half-precision logits skips both
searches: its top-k floor is the k-th of its WINDOW largest logits (`torch.topk`, a partial sort; scaling
by the temperature keeps the order, so it is the search's key exactly), and its nucleus lies among the
tokens top-k kept: those in the window and the ties of the k-th beyond it, counted. A top-p row without
top-k whose window already holds p of its mass (the bounds launch sums it) takes its nucleus from the
window too. Both are `gapless.sampling.draw_floors`, the search's rule summed in another order. Which
rows take the window depends on their own settings, logits and dtype, never on the batch (fp32 logits
divided by a temperature can round two logits to one, which the count in logit space would miss: they
always search).

Cost (H200, 151,936 columns, `bench/results/h200-2026-11-26/kernels.log`, before the window): temperature
alone is one launch reading the logits once (6 us at 1 row, 150 us at 256); min-p adds one; a search
adds SEARCH_PASSES (8) launches, each reading the rows still searching (a 16-probe compare per element):
top-k 20 + top-p 0.95 took 274 us at 1 row and 14.4 ms at 256, which the window replaces with a partial
sort and a few [B, WINDOW] ops. The host launches a fixed count, so a step needs no sync and
can be captured in a CUDA graph. The arrival pattern (release increment after a barrier, L2 loads in the
combining program) is the classic "last block" reduction; `gapless.sampling.fused` checks the tokens
against the torch path at start-up on CUDA.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gapless.attention.triton_kernels import INTERPRET as INTERPRET
from gapless.attention.triton_kernels import _max
from gapless.sampling.draw_floors import HALF, WINDOW, Floors, kept, window_floors

__all__ = ["CHUNK", "SEARCH_PASSES", "WINDOW", "Floors", "draw", "draw_with", "floors", "kept"]

CHUNK = 1024  # columns a program reads (152k columns: 149 programs a row)
PROBES = 16  # keys a search launch tests: each narrows a row's range about 17-fold
_KEY_MAX = tl.constexpr(2147483647)
_KEY_MIN = tl.constexpr(-2147483647)  # below every float's key (-inf's is -2139095041)


def _search_passes(probes: int) -> int:
    """Launches that narrow any range of int32 keys to one key (the worst case of the update rule)."""
    span, passes = (1 << 32) - 1, 0
    while span > 0:
        span = span // (probes + 1)  # the widest sub-range between two probes, less its failing end
        passes += 1
    return passes


SEARCH_PASSES = _search_passes(PROBES)


@triton.jit
def _lowbias32(x):
    """lowbias32 on uint32 values (products wrap around mod 2**32, as the torch path's int32 ones do)."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _row_key(seed, step):
    """`gapless.sampling.sampler._row_keys` of one row's int64 seed and step, as uint32."""
    key = _lowbias32((seed >> 32).to(tl.uint32) ^ 0x9E3779B9)
    key = _lowbias32(key ^ seed.to(tl.uint32))
    return _lowbias32(key ^ step.to(tl.uint32))


@triton.jit
def _key(y):
    """float32 -> int32 whose signed order is the floats' order (-0.0 counted as +0.0)."""
    bits = (y + 0.0).to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _scaled(Logits, stride_l, Temperature, b, cols, vocab):
    """Row b's logits at `cols` divided by its temperature (as the torch path rounds: IEEE division);
    temperature 0 (greedy) leaves them as they are; columns past the vocabulary are -inf."""
    t = tl.load(Temperature + b)
    x = tl.load(Logits + b.to(tl.int64) * stride_l + cols, mask=cols < vocab, other=float("-inf"))
    x = x.to(tl.float32)
    return tl.where(t > 0.0, tl.math.div_rn(x, tl.where(t > 0.0, t, 1.0)), x)


@triton.jit
def _arrive(Counter, b, chunks):
    """True in the program that stores row b's last chunk partials (they are all visible to it), which
    also resets the row's counter for the next launch."""
    tl.debug_barrier()  # every thread's partial stores issued before the (release) increment
    last = tl.atomic_add(Counter + b, 1, sem="acq_rel", scope="gpu") == chunks - 1
    if last:
        tl.store(Counter + b, 0)
    return last


@triton.jit
def _bounds_kernel(
    Logits,
    stride_l,
    Temperature,
    TopK,
    TopP,
    Counter,
    PartF,
    PartK,
    RowF,
    RowK,
    RowS,
    vocab,
    CHUNK: tl.constexpr,
    CHUNKS_P2: tl.constexpr,
    MASS: tl.constexpr,
):
    """Row b's largest scaled logit (RowF[b]), the range each search starts from (RowK[b]: top-k's lo,
    hi, then top-p's; a search a row does not need starts done, lo == hi), and with MASS the row's mass
    (RowS[b]: ``exp(y - m)`` summed, each chunk's sum taken at its own largest and rescaled)."""
    b = tl.program_id(0)
    c = tl.program_id(1)
    chunks = tl.num_programs(1)
    cols = c * CHUNK + tl.arange(0, CHUNK)
    y = _scaled(Logits, stride_l, Temperature, b, cols, vocab)
    finite = y > float("-inf")
    key = _key(y)
    part = (b * chunks + c) * 2
    chunk_max = _max(y, 0)
    tl.store(PartF + b * chunks + c, chunk_max)
    if MASS:
        chunk_sums = PartF + tl.num_programs(0) * chunks
        shift = tl.where(chunk_max > float("-inf"), chunk_max, 0.0)  # (a masked chunk: no -inf - -inf)
        tl.store(chunk_sums + b * chunks + c, tl.sum(tl.where(finite, tl.exp(y - shift), 0.0), 0))
    tl.store(PartK + part, tl.min(tl.where(finite, key, _KEY_MAX), 0))
    tl.store(PartK + part + 1, tl.max(tl.where(finite, key, _KEY_MIN), 0))
    if _arrive(Counter, b, chunks):
        i = tl.arange(0, CHUNKS_P2)
        here = i < chunks
        maxes = tl.load(PartF + b * chunks + i, mask=here, other=float("-inf"), cache_modifier=".cg")
        m = _max(maxes, 0)
        if MASS:
            sums = tl.load(
                PartF + tl.num_programs(0) * chunks + b * chunks + i,
                mask=here,
                other=0.0,
                cache_modifier=".cg",
            )
            scale = tl.exp(maxes - tl.where(m > float("-inf"), m, 0.0))
            tl.store(RowS + b, tl.sum(tl.where(sums > 0.0, sums * scale, 0.0), 0))
        lo = tl.min(tl.load(PartK + (b * chunks + i) * 2, mask=here, other=_KEY_MAX, cache_modifier=".cg"), 0)
        hi = tl.max(
            tl.load(PartK + (b * chunks + i) * 2 + 1, mask=here, other=_KEY_MIN, cache_modifier=".cg"), 0
        )
        sampled = tl.load(Temperature + b) > 0.0
        top_k_on = sampled & (tl.load(TopK + b) < vocab)
        top_p_on = sampled & (tl.load(TopP + b) < 1.0)
        tl.store(RowF + b, m)
        tl.store(RowK + b * 4, lo)
        tl.store(RowK + b * 4 + 1, tl.where(top_k_on, hi, lo))
        tl.store(RowK + b * 4 + 2, lo)
        tl.store(RowK + b * 4 + 3, tl.where(top_p_on, hi, lo))


@triton.jit
def _search_kernel(
    Logits,
    stride_l,
    Temperature,
    TopK,
    TopP,
    Counter,
    PartF,
    PartC,
    RowF,
    RowK,
    vocab,
    CHUNK: tl.constexpr,
    CHUNKS_P2: tl.constexpr,
    PROBES: tl.constexpr,
    COUNT: tl.constexpr,
):
    """One narrowing of row b's top-k range (COUNT: the smallest key with fewer than k tokens above) or
    top-p range (the smallest key, at or above top-k's, whose mass above is under p times the mass at
    or above top-k's), by PROBES keys spread over it."""
    b = tl.program_id(0)
    c = tl.program_id(1)
    chunks = tl.num_programs(1)
    slot = 0 if COUNT else 2
    k_floor = tl.load(RowK + b * 4)  # top-k's result (its lo) once its search is done; else the lowest key
    lo = tl.load(RowK + b * 4 + slot)
    if not COUNT:
        lo = tl.maximum(lo, k_floor)
    hi = tl.load(RowK + b * 4 + slot + 1)
    span = hi.to(tl.int64) - lo.to(tl.int64)
    probe = tl.arange(0, PROBES)
    thresholds = (lo.to(tl.int64) + span * (probe + 1).to(tl.int64) // (PROBES + 1)).to(tl.int32)
    cols = c * CHUNK + tl.arange(0, CHUNK)
    if lo < hi:  # a row that is done (or needs no search) reads and sums nothing
        y = _scaled(Logits, stride_l, Temperature, b, cols, vocab)
        key = _key(y)
        over = key[:, None] > thresholds[None, :]
        part = (b * chunks + c) * PROBES + probe
        if COUNT:
            tl.store(PartC + part, tl.sum(over.to(tl.int32), axis=0))
        else:
            e = tl.where(key >= k_floor, tl.exp(y - tl.load(RowF + b)), 0.0)
            tl.store(PartF + part, tl.sum(tl.where(over, e[:, None], 0.0), axis=0))
            tl.store(PartF + chunks * PROBES * tl.num_programs(0) + b * chunks + c, tl.sum(e, axis=0))
    if _arrive(Counter, b, chunks):
        i = tl.arange(0, CHUNKS_P2)
        here = i < chunks
        tile = (b * chunks + i)[:, None] * PROBES + probe[None, :]
        if COUNT:
            counts = tl.sum(tl.load(PartC + tile, mask=here[:, None], other=0, cache_modifier=".cg"), axis=0)
            passing = counts < tl.load(TopK + b)
        else:
            above = tl.sum(tl.load(PartF + tile, mask=here[:, None], other=0.0, cache_modifier=".cg"), axis=0)
            totals = PartF + chunks * PROBES * tl.num_programs(0) + b * chunks + i
            total = tl.sum(tl.load(totals, mask=here, other=0.0, cache_modifier=".cg"), axis=0)
            passing = above < tl.load(TopP + b) * total
        # false for the low probes, true from the first that passes (each sum is monotone in the probe)
        failing = tl.sum(tl.where(passing, 0, 1), axis=0)
        last_failing = tl.sum(tl.where(probe == failing - 1, thresholds, 0), axis=0)
        first_passing = tl.sum(tl.where(probe == failing, thresholds, 0), axis=0)
        if lo < hi:
            tl.store(RowK + b * 4 + slot, tl.where(failing == 0, lo, last_failing + 1))
            tl.store(RowK + b * 4 + slot + 1, tl.where(failing == PROBES, hi, first_passing))


@triton.jit
def _draw_kernel(
    Logits,
    stride_l,
    Temperature,
    TopP,
    MinP,
    Seeds,
    Steps,
    Counter,
    PartF,
    PartI,
    RowF,
    RowK,
    Tokens,
    vocab,
    CHUNK: tl.constexpr,
    CHUNKS_P2: tl.constexpr,
    FILTER: tl.constexpr,
):
    """Row b's token: the first column of the largest ``y + gumbel`` over the tokens its floors keep
    (FILTER: the searches ran), or of ``x`` for a greedy row."""
    b = tl.program_id(0)
    c = tl.program_id(1)
    chunks = tl.num_programs(1)
    cols = c * CHUNK + tl.arange(0, CHUNK)
    y = _scaled(Logits, stride_l, Temperature, b, cols, vocab)
    noisy = tl.load(Temperature + b) > 0.0
    if FILTER:
        key = _key(y)
        # top-k's floor (the lowest finite key where it is off), top-p's where it is on, min-p's
        floor = tl.load(RowK + b * 4)
        floor = tl.maximum(floor, tl.where(tl.load(TopP + b) < 1.0, tl.load(RowK + b * 4 + 2), _KEY_MIN))
        min_p = tl.load(MinP + b)
        min_p_floor = tl.where(
            min_p > 0.0, tl.load(RowF + b) + tl.log(tl.maximum(min_p, 1e-30)), float("-inf")
        )
        keep = (key >= floor) & (y >= min_p_floor)
        y = tl.where(keep, y, float("-inf"))
    row_key = _row_key(tl.load(Seeds + b), tl.load(Steps + b))
    col_hash = _lowbias32(cols.to(tl.uint32) * 0x9E3779B9 + 1)
    n = (_lowbias32(row_key ^ col_hash) >> 9).to(tl.float32)  # 23 bits: exact in fp32
    g = -tl.log(-tl.log((n + 0.5) * 1.1920928955078125e-07))  # u = (n + 0.5) / 2**23 in (0, 1)
    s = tl.where(noisy, y + g, y)
    s = tl.where(cols < vocab, s, float("-inf"))
    best = _max(s, 0)
    # the first column holding the chunk's best (its first column if every score is -inf, as torch)
    first = tl.min(tl.where(s == best, cols, vocab), 0)
    first = tl.where(best > float("-inf"), first, c * CHUNK)
    tl.store(PartF + b * chunks + c, best)
    tl.store(PartI + b * chunks + c, first)
    if _arrive(Counter, b, chunks):
        i = tl.arange(0, CHUNKS_P2)
        here = i < chunks
        scores = tl.load(PartF + b * chunks + i, mask=here, other=float("-inf"), cache_modifier=".cg")
        index = tl.load(PartI + b * chunks + i, mask=here, other=vocab, cache_modifier=".cg")
        top = _max(scores, 0)
        tl.store(Tokens + b, tl.min(tl.where(scores == top, index, vocab), 0).to(tl.int64))


def _scratch(
    batch: int, chunks: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The per-row arrival counters (zero) and the per-(row, chunk) partials (float32, int32)."""
    return (
        torch.zeros(batch, dtype=torch.int32, device=device),
        torch.empty(batch * chunks * (PROBES + 1), dtype=torch.float32, device=device),
        torch.empty(batch * chunks * PROBES, dtype=torch.int32, device=device),
    )


def floors(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    need: tuple[bool, bool] = (True, True),
    chunk: int = CHUNK,
    largest_k: tuple[int, int] = (0, 0),
    window: int = WINDOW,
) -> Floors:
    """Each row's largest scaled logit and its top-k and top-p floors as int32 keys (`draw`'s arguments;
    `need`: whether any row has top-k, top-p: the other search is skipped; `largest_k`: the largest top-k
    of the rows with top-k, and of those with top-p (0: not known), so a search no row needs is skipped)."""
    batch, vocab = logits.shape
    device = logits.device
    chunks = triton.cdiv(vocab, chunk)
    half = logits.dtype in HALF
    out = Floors(
        torch.empty(batch, dtype=torch.float32, device=device),
        torch.empty(batch, 4, dtype=torch.int32, device=device),
        torch.empty(batch, dtype=torch.float32, device=device) if half and need[1] else None,
    )
    if batch == 0:
        return out
    counter, part_f, part_i = _scratch(batch, chunks, device)
    args = (logits, logits.stride(0), temperature, top_k, top_p, counter, part_f, part_i, out.row_max)
    # (the combining tile is at least 2 wide: a 1-wide one is a corner case of the compiler)
    common = dict(CHUNK=chunk, CHUNKS_P2=max(2, triton.next_power_of_2(chunks)), num_warps=4)
    row_mass = out.row_mass if out.row_mass is not None else out.row_max  # (no MASS: never written)
    _bounds_kernel[(batch, chunks)](*args, out.keys, row_mass, vocab, MASS=out.row_mass is not None, **common)
    w = min(window, vocab - 1)
    if half and any(need):
        window_floors(logits, temperature, top_k, top_p, out, w)
    # a search runs unless every row that needs it took the window (the others' searches read nothing)
    searched = [need[i] and not (half and 0 < largest_k[i] <= w) for i in (0, 1)]
    for count in [True] * (SEARCH_PASSES * searched[0]) + [False] * (SEARCH_PASSES * searched[1]):
        _search_kernel[(batch, chunks)](*args, out.keys, vocab, PROBES=PROBES, COUNT=count, **common)
    return out


def draw_with(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
    steps: torch.Tensor,
    found: Floors | None,
    chunk: int = CHUNK,
) -> torch.Tensor:
    """Each row's token (int64 [B]) over the tokens its `found` floors keep (None: no filter)."""
    batch, vocab = logits.shape
    device = logits.device
    tokens = torch.empty(batch, dtype=torch.int64, device=device)
    if batch == 0:
        return tokens
    chunks = triton.cdiv(vocab, chunk)
    counter, part_f, part_i = _scratch(batch, chunks, device)
    row_max, keys = (found.row_max, found.keys) if found is not None else (part_f, part_i)
    _draw_kernel[(batch, chunks)](
        logits,
        logits.stride(0),
        temperature,
        top_p,
        min_p,
        seeds,
        steps,
        counter,
        part_f,
        part_i,
        row_max,
        keys,
        tokens,
        vocab,
        CHUNK=chunk,
        CHUNKS_P2=max(2, triton.next_power_of_2(chunks)),
        FILTER=found is not None,
        num_warps=4,
    )
    return tokens


def draw(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
    steps: torch.Tensor,
    need: tuple[bool, bool, bool] = (True, True, True),
    chunk: int = CHUNK,
    largest_k: tuple[int, int] = (0, 0),
    window: int = WINDOW,
) -> torch.Tensor:
    """Each row's token (int64 [B]): the seeded draw from ``softmax(logits / temperature)`` after its
    top-k, top-p (over what top-k kept) and min-p; the argmax of `logits` where temperature is 0.
    `logits` [B, V] fp32/bf16/fp16; `temperature`, `top_p`, `min_p` [B] float32; `top_k` [B] int64
    (>= V: off); `seeds`, `steps` [B] int64. `need` (top-k, top-p, min-p): which filters any row uses (host
    flags: the launches of the others are skipped). `chunk`: columns a program reads (a power of two;
    tests use small ones to split small vocabularies); `largest_k` and `window`: `floors`'. Reads sizes
    from host ints; never syncs."""
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    temperature, top_p, min_p = temperature.contiguous(), top_p.contiguous(), min_p.contiguous()
    found = None
    if any(need):
        found = floors(logits, temperature, top_k.contiguous(), top_p, need[:2], chunk, largest_k, window)
    return draw_with(logits, temperature, top_p, min_p, seeds.contiguous(), steps.contiguous(), found, chunk)
