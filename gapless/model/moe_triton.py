"""The fused mixture-of-experts path: tokens sorted by expert, then one grouped-GEMM Triton kernel, run
twice (gate/up with SiLU·mul fused, then down with the routing weight fused).

Each token picks `top_k` experts, so the batch makes `T * top_k` (token, expert) entries. `align` sorts the
entries by expert and pads each expert's run to a multiple of `BLOCK_M`, so every block of `BLOCK_M`
sorted entries belongs to one expert; the kernel's program for a block multiplies its entries' rows by
that expert's weight matrix alone. All of it is sized from host ints (the padded length is bounded by
`T * top_k + min(E, T * top_k) * (BLOCK_M - 1)`; blocks past the real padded length return at once), so
nothing reads device memory on the host and a CUDA graph can capture it. At decode sizes (up to
`ALIGN_KERNEL_ENTRIES` entries) the sorting is one small kernel (`_align_kernel`) rather than some 25 torch
ops, each a launch at every MoE layer of a step (48 layers on Qwen3-30B-A3B: ~1,200 launches a token).

The plain per-expert loop in `gapless.model.moe.reference_experts` is the yardstick: tests run this under
Triton's interpreter (`TRITON_INTERPRET=1`, fp32) against it. As in `gapless.attention.triton_kernels`,
fp32 dots use `input_precision="ieee"` (tf32 would cost three decimal digits), and the kernel uses
builtins only (`tl.full`, `tl.exp`), so the interpreter never calls a helper built in GPU mode.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from gapless import env
from gapless.model.moe import WeightQuant
from gapless.model.quant.fp8 import activation_group
from gapless.model.quant.fp8_rounding import round_rows
from gapless.model.quant.int4_values import unsigned_to_float

# the interpreter multiplies the raw bits of bf16 `tl.dot` operands (triton-lang/triton#11584): there the
# operands go in as fp32 (same values), as `gapless.attention.triton_kernels` does it
INTERPRET = env.TRITON_INTERPRET.get()


@triton.jit
def _int_tile(
    W,
    Scales,
    Zeros,
    Levels,
    rows,
    row_mask,
    k0,
    stride_wk,
    stride_sg,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CODEBOOK: tl.constexpr,
):
    """One expert's packed weight `W` (`_grouped_gemm_kernel`'s BITS layout; `Scales`, `Zeros` its own) at
    inputs k0 .. k0 + BLOCK_K and `rows`, dequantized in fp32 as [BLOCK_K, BLOCK_N]; the K step stays in
    one group (BLOCK_K divides GROUP). Strides: W's per word row, the scales' and zeros' per group.
    CODEBOOK: each value `Levels[q] * scale`, no zero read (`int4_values.level`)."""
    offs_p = k0 // (32 // BITS) + tl.arange(0, BLOCK_K // (32 // BITS))
    words = tl.load(W + offs_p[:, None] * stride_wk + rows[None, :], mask=row_mask[None, :], other=0)
    shifts = tl.arange(0, 32 // BITS) * BITS
    q = (words[:, None, :] >> shifts[None, :, None]) & ((1 << BITS) - 1)  # value k = P * word row + j
    q = tl.reshape(q, (BLOCK_K, BLOCK_N))
    at = (k0 // GROUP) * stride_sg + rows
    s = tl.load(Scales + at, mask=row_mask, other=0.0).to(tl.float32)
    if CODEBOOK:
        return tl.load(Levels + q) * s[None, :]
    z = tl.load(Zeros + at, mask=row_mask, other=0.0).to(tl.float32)
    return (unsigned_to_float(q) - z[None, :]) * s[None, :]


@triton.jit
def _tile_product(
    a,
    a_scale,
    W,
    Scales,
    Zeros,
    Levels,
    rows,
    row_mask,
    offs_k,
    k_mask,
    k0,
    stride_wn,
    stride_sn,
    s_row,
    scale_cols,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
    SCALED: tl.constexpr,
    CODEBOOK: tl.constexpr,
):
    """`a` [BLOCK_M, BLOCK_K] times one expert's weight `W` at inputs `offs_k` (from `k0`) and `rows`
    [BLOCK_K, BLOCK_N], in fp32: W as stored (a float W, `stride_wn` apart per row) or unpacked and
    dequantized (BITS: `_int_tile`), widened to A's type. SCALED (W8A8): `a` in e4m3 with its rows' scales
    `a_scale`, W's e4m3 tile as it is, the fp8 product times both scales (W's: the rows' of this K step,
    `s_row`, one per `scale_cols` inputs)."""
    if BITS:
        w = _int_tile(
            W,
            Scales,
            Zeros,
            Levels,
            rows,
            row_mask,
            k0,
            stride_wn,
            stride_sn,
            BITS,
            GROUP,
            BLOCK_K,
            BLOCK_N,
            CODEBOOK,
        )
    else:
        w = tl.load(
            W + rows[None, :] * stride_wn + offs_k[:, None],
            mask=k_mask[:, None] & row_mask[None, :],
            other=0.0,
        )
    if SCALED:
        w_scale = tl.load(s_row + k0 // scale_cols, mask=row_mask, other=0.0)
        part = tl.dot(a, w) * a_scale[:, None] * w_scale[None, :]
    elif IEEE:
        part = tl.dot(a, w.to(a.dtype), input_precision="ieee")
    else:
        part = tl.dot(a, w.to(a.dtype))  # (int tiles widened; a float tile is A's type already)
    return part


@triton.jit(do_not_specialize=["num_entries"])  # (docs/gpu.md#no-compile-mid-run)
def _grouped_gemm_kernel(
    A,
    W,
    Out,
    SortedIds,
    BlockExpert,
    NumPadded,
    RouteWeights,
    Scales,
    Zeros,
    Levels,
    Order,
    num_entries,
    N,
    K,
    stride_am,
    stride_we,
    stride_wn,
    stride_om,
    stride_se,
    stride_sn,
    scale_cols,
    ROWS_PER_A: tl.constexpr,
    GATED: tl.constexpr,
    WEIGHTED: tl.constexpr,
    SCALED: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    CODEBOOK: tl.constexpr,
    ORDERED: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[entry, n] for one block of `BLOCK_M` sorted entries (one expert) and `BLOCK_N` outputs.

    A row of `A` is entry // ROWS_PER_A (the token, for the first GEMM; the entry itself for the second).
    GATED: `W[e]` holds gate rows [0, N) then up rows [N, 2N), and the result is silu(gate) * up.
    WEIGHTED: the result is multiplied by the entry's routing weight. SCALED (W8A8): `W` is e4m3 with
    float32 scales `Scales[e, row, k // scale_cols]` (one column block of all K: per row), and each K step
    of A (BLOCK_K columns: its activation group) is rounded to e4m3 per row as the FP8 GEMM rounds x
    (`round_rows`) for an e4m3 dot, the product scaled by both scales. BITS (4
    or 8; 0: not packed): `W[e]` is [K / P, rows] int32 words, P = 32 / BITS values each packed along K
    (value k at bits BITS * (k % P)), with `Scales`, `Zeros` [e, k // GROUP, row]: each tile is
    unpacked and dequantized, (q - zero) * scale in fp32 (CODEBOOK: `Levels[q] * scale`, GGUF's IQ4
    levels or NVFP4's e2m1 values, no zeros), then rounded once to A's type for the dot. ORDERED
    (act-order): W[e]'s column k reads A's column `Order[e, k]` (int32 [E, K]), so each K step gathers its
    columns of A."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(NumPadded):
        return
    expert = tl.load(BlockExpert + pid_m).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    entry = tl.load(SortedIds + offs_m)
    valid = entry < num_entries
    a_row = (entry // ROWS_PER_A).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    w_base = W + expert * stride_we
    s_gate = Scales + expert * stride_se + offs_n * stride_sn  # (SCALED only)
    s_up = s_gate + N * stride_sn
    s_base, z_base = Scales + expert * stride_se, Zeros + expert * stride_se  # (BITS only)
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    acc_up = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        if ORDERED:
            cols = tl.load(Order + expert * K + offs_k, mask=k_mask, other=0)
        else:
            cols = offs_k
        a = tl.load(
            A + a_row[:, None] * stride_am + cols[None, :], mask=valid[:, None] & k_mask[None, :], other=0.0
        )
        if SCALED:  # (padding rows: all zero, scale 1e-12 / 448, e4m3 zeros)
            a, a_scale = round_rows(a.to(tl.float32))
        else:
            a_scale = tl.full((BLOCK_M,), 1.0, tl.float32)  # (unread)
        acc += _tile_product(
            a,
            a_scale,
            w_base,
            s_base,
            z_base,
            Levels,
            offs_n,
            n_mask,
            offs_k,
            k_mask,
            k0,
            stride_wn,
            stride_sn,
            s_gate,
            scale_cols,
            BITS,
            GROUP,
            BLOCK_K,
            BLOCK_N,
            IEEE,
            SCALED,
            CODEBOOK,
        )
        if GATED:
            acc_up += _tile_product(
                a,
                a_scale,
                w_base,
                s_base,
                z_base,
                Levels,
                offs_n + N,
                n_mask,
                offs_k,
                k_mask,
                k0,
                stride_wn,
                stride_sn,
                s_up,
                scale_cols,
                BITS,
                GROUP,
                BLOCK_K,
                BLOCK_N,
                IEEE,
                SCALED,
                CODEBOOK,
            )
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up  # silu(gate) * up
    if WEIGHTED:
        acc = acc * tl.load(RouteWeights + entry, mask=valid, other=0.0).to(tl.float32)[:, None]
    tl.store(
        Out + entry.to(tl.int64)[:, None] * stride_om + offs_n[None, :],
        acc.to(Out.dtype.element_ty),
        mask=valid[:, None] & n_mask[None, :],
    )


def _rows(w: torch.Tensor, quant: WeightQuant | None) -> int:
    """The output rows of stacked expert weight `w`."""
    return w.shape[2] if quant is not None and quant.bits else w.shape[1]


# up to this many entries (T * top_k: a decode of 8 tokens at top-8) `align` is one launch
# (`_align_kernel`) instead of some 25 torch ops, each a kernel of its own at every MoE layer of a step
ALIGN_KERNEL_ENTRIES = 64


def _capacity(n: int, num_experts: int, block_m: int) -> int:
    """The length of `align`'s sorted entries: every entry, each expert's run padded, in whole blocks."""
    return -(-(n + min(num_experts, n) * (block_m - 1)) // block_m) * block_m


@triton.jit
def _align_kernel(
    Ids, SortedIds, BlockExpert, NumPadded, n, num_experts, capacity,
    BLOCK_M: tl.constexpr, NP: tl.constexpr, CAP: tl.constexpr, NB: tl.constexpr,
):  # fmt: skip
    """`align` in one program for n <= NP entries: each entry's rank among its expert's (the entries
    before it with its expert), its expert's count and padded run, the run's start (the padded runs of
    the experts below it); from them every output, by comparing entries pairwise ([NP, NP])."""
    i = tl.arange(0, NP)
    valid = i < n
    e = tl.load(Ids + i, mask=valid, other=0)
    same = (e[:, None] == e[None, :]) & valid[:, None] & valid[None, :]
    rank = tl.sum((same & (i[None, :] < i[:, None])).to(tl.int64), axis=1)
    padded = (tl.sum(same.to(tl.int64), axis=1) + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    first = valid & (rank == 0)  # (one entry an expert carries its run)
    start = tl.sum(tl.where((e[None, :] < e[:, None]) & first[None, :], padded[None, :], 0), axis=1)
    total = tl.sum(tl.where(first, padded, 0), axis=0)
    p = tl.arange(0, CAP)
    tl.store(SortedIds + p, n + 0 * p.to(tl.int64), mask=p < capacity)  # (the sentinel everywhere first)
    tl.debug_barrier()
    tl.store(SortedIds + start + rank, i.to(tl.int64), mask=valid)
    b = tl.arange(0, NB) * BLOCK_M  # each block's first entry: the expert whose run holds it
    holds = first[None, :] & (start[None, :] <= b[:, None]) & (b[:, None] < (start + padded)[None, :])
    expert = tl.sum(tl.where(holds, e[None, :], 0), axis=1)
    expert = tl.where(b < total, expert, num_experts - 1)  # (past the runs: the last, as searchsorted's)
    tl.store(BlockExpert + tl.arange(0, NB), expert, mask=b < capacity)
    tl.store(NumPadded + tl.arange(0, 1), total + tl.zeros((1,), tl.int64))


def align(
    ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Entries (flat indices into `ids` [T, top_k]) sorted by expert, stably, each expert's run padded to a
    multiple of `block_m` with the sentinel `ids.numel()`; the expert of each block; and the padded length
    (a one-element device tensor). Only device ops: the host never reads a count. Up to
    `ALIGN_KERNEL_ENTRIES` entries one launch (`_align_kernel`), else torch's ops."""
    flat = ids.reshape(-1)
    n = flat.numel()
    dev = flat.device
    capacity = _capacity(n, num_experts, block_m)
    if 0 < n <= ALIGN_KERNEL_ENTRIES:
        sorted_ids = torch.empty(capacity, dtype=torch.int64, device=dev)
        block_expert = torch.empty(capacity // block_m, dtype=torch.int64, device=dev)
        num_padded = torch.empty(1, dtype=torch.int64, device=dev)
        np2, blocks = triton.next_power_of_2(n), triton.next_power_of_2(capacity // block_m)
        _align_kernel[(1,)](
            flat.contiguous(), sorted_ids, block_expert, num_padded, n, num_experts, capacity,
            BLOCK_M=block_m, NP=np2, CAP=triton.next_power_of_2(capacity), NB=blocks,
        )  # fmt: skip
        return sorted_ids, block_expert, num_padded
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    sorted_expert = flat[order]
    rank = torch.arange(n, device=dev) - (counts.cumsum(0) - counts)[sorted_expert]
    sorted_ids = torch.full((capacity,), n, dtype=torch.int64, device=dev)
    sorted_ids[(ends - padded)[sorted_expert] + rank] = order
    block_start = torch.arange(0, capacity, block_m, device=dev)
    block_expert = torch.searchsorted(ends, block_start, right=True).clamp_(max=num_experts - 1)
    return sorted_ids, block_expert, ends[-1:]


def fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    lora: Any = None,
    scales: tuple[tuple[Any, ...], tuple[Any, ...]] | None = None,
) -> torch.Tensor:
    """sum over k of weights[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = ids[t, k].

    x: [T, H]; w13: [E, 2I, H] (gate rows, then up); w2: [E, H, I]; weights, ids: [T, top_k]. `lora`: the
    layer's resident adapters (`gapless.lora.table.ExpertLoRA`): then each GEMM's output is kept whole
    (gate/up before the activation, down before the routing weight) for its delta to be added. `scales`:
    w13's and w2's `WeightQuant` (or its fields as a tuple): e4m3 weights with float32 scales, or int4/int8
    ones packed, w13 [E, H / P, 2I] and w2 [E, I / P, H]."""
    if INTERPRET and x.dtype != torch.float32:
        w13, w2 = (w if scales is not None else w.float() for w in (w13, w2))
        return fused_experts(x.float(), w13, w2, weights, ids, lora, scales).to(x.dtype)
    s13, s2 = (WeightQuant(*s) for s in scales) if scales is not None else (None, None)
    tokens, hidden = x.shape
    top_k = ids.shape[1]
    n = tokens * top_k
    block_m = 16 if n <= 512 else 64
    aligned = (*align(ids, w13.shape[0], block_m), block_m)
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    weights = weights.reshape(-1).contiguous()
    if lora is None:
        h = torch.empty(n, _rows(w13, s13) // 2, dtype=x.dtype, device=x.device)
        y = torch.empty(n, hidden, dtype=torch.float32, device=x.device)
        _grouped_gemm(x, w13, s13, h, aligned, weights, top_k, gated=True, weighted=False)
        _grouped_gemm(h, w2, s2, y, aligned, weights, 1, gated=False, weighted=True)
    else:
        y = _entries_with_lora(x, (w13, s13), (w2, s2), aligned, weights, ids, lora)
    return y.view(tokens, top_k, hidden).sum(1).to(x.dtype)


def _grouped_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    quant: WeightQuant | None,
    out: torch.Tensor,
    aligned: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int],
    weights: torch.Tensor,
    rows_per_a: int,
    gated: bool,
    weighted: bool,
) -> None:
    """One launch of the grouped GEMM over the sorted entries `aligned` (`align`'s, and its block size):
    out[entry] = a[entry // rows_per_a] W[expert]^T (silu(gate) * up when `gated`, times the entry's
    routing weight when `weighted`); `quant`: W's quantization (`WeightQuant`), None for a float W."""
    sorted_ids, block_expert, num_padded, block_m = aligned
    n_out, k_in = out.shape[1], a.shape[1]
    q = quant if quant is not None else WeightQuant(weights, 1)  # (a float W: its fields unread)
    bits = q.bits
    block_n = min(64, max(16, triton.next_power_of_2(n_out)))
    block_k = min(64, max(16, triton.next_power_of_2(k_in)))
    if quant is not None and not bits:  # e4m3: a K step is A's activation group (within a scale block)
        block_k = q.act_group or activation_group(k_in, q.group if q.group < k_in else 0)
        if block_k < 16 or block_k & (block_k - 1) or (q.group < k_in and q.group % block_k):
            raise ValueError(f"fp8 experts: activation groups of {block_k} in scale blocks of {q.group}")
    if bits:  # and is whole words and groups: the largest power of two dividing both, at most 64
        block_k = min(64, q.group & -q.group, k_in & -k_in)
        if block_k < 16 or w.shape[1] * (32 // bits) != k_in:
            raise ValueError(f"int{bits} experts: packed {tuple(w.shape)} for {k_in} inputs, group {q.group}")
    order = q.order
    if order is not None and (order.shape != (w.shape[0], k_in) or order.dtype != torch.int32 or not bits):
        raise ValueError(
            f"experts' act-order {tuple(order.shape)} {order.dtype}: int32 [{w.shape[0]}, {k_in}]"
        )
    _grouped_gemm_kernel[(sorted_ids.numel() // block_m, triton.cdiv(n_out, block_n))](
        a,
        w,
        out,
        sorted_ids,
        block_expert,
        num_padded,
        weights,
        q.scales,
        q.zeros if q.zeros is not None else weights,
        q.levels if q.levels is not None else weights,
        order.contiguous() if order is not None else weights,
        weights.numel(),
        n_out,
        k_in,
        a.stride(0),
        w.stride(0),
        w.stride(1),
        out.stride(0),
        q.scales.stride(0) if quant is not None else 0,
        q.scales.stride(1) if quant is not None else 0,
        q.group,
        ROWS_PER_A=rows_per_a,
        GATED=gated,
        WEIGHTED=weighted,
        SCALED=quant is not None and not bits,
        BITS=bits,
        GROUP=q.group if bits else 1,
        CODEBOOK=q.levels is not None,
        ORDERED=order is not None,
        IEEE=a.dtype == torch.float32,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )


def _entries_with_lora(
    x: torch.Tensor,
    w13: tuple[torch.Tensor, WeightQuant | None],
    w2: tuple[torch.Tensor, WeightQuant | None],
    aligned: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int],
    weights: torch.Tensor,
    ids: torch.Tensor,
    lora: Any,
) -> torch.Tensor:
    """Each (token, expert) entry's output [T k, H] (fp32, routing-weighted) with its adapter's deltas
    (w13, w2: each weight and its quantization, or None):
    gate/up [T k, 2I] whole, its delta, the activation; down [T k, H] whole, its delta, the weight. The
    deltas read each entry's flat adapter index (slot * E + expert: `ExpertLoRA.entry_slots`) on the
    device."""
    top_k = ids.shape[1]
    n = weights.numel()
    slots = lora.entry_slots(ids)
    gate_up = torch.empty(n, _rows(*w13), dtype=x.dtype, device=x.device)
    _grouped_gemm(x, *w13, gate_up, aligned, weights, top_k, gated=False, weighted=False)
    if slots is not None:
        lora.add("gate_up_proj", gate_up, x.repeat_interleave(top_k, 0), slots)
    gate, up = gate_up.chunk(2, dim=-1)
    h = (torch.nn.functional.silu(gate) * up).contiguous()
    y = torch.empty(n, x.shape[1], dtype=x.dtype, device=x.device)
    _grouped_gemm(h, *w2, y, aligned, weights, 1, gated=False, weighted=False)
    if slots is not None:
        lora.add("down_proj", y, h, slots)
    return y.float() * weights[:, None].float()
