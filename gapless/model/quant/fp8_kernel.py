"""The FP8 W8A8 GEMM on CUDA (sm_89+), in Triton: `y = x W^T (+ b)` with W in e4m3 and its scales, and x
quantized to e4m3 per token and per `BK` columns (its dynamic scale: the group's largest |x| / 448),
inside the GEMM (no host sync: CUDA graphs capture it as any other kernel).

Each program computes a [BM, BN] tile of y: for each BK-wide step along K it loads x's tile, takes each
row's scale, rounds x / scale to e4m3, loads W's e4m3 tile, and adds `dot(xq, wq) * x_scale * w_scale`
(the fp8 tensor-core product, accumulated in float32). At decode sizes every program rounds the same few
rows again, in its loop, where the rounding waits on x's loads; so up to `DECODE_ROWS` rows (a decode's
or a small batch's) x meets the weights as `DECODE_X` says: rounded before the loop, by one small launch
before the GEMM (`_fp8_quant_kernel`) or by each program for its own share of K, into the same buffer
(the programs of one share write the same bytes), with no launch; either way the same arithmetic
(`round_rows`: the same bits), and the loop loads the e4m3 rows and their scales. Or not rounded to e4m3
at all ("fp16", W8A16): x in float16 (clamped to its range) against the weights widened to float16, which
on sm_90 is what a 16-row tile's dot runs anyway (Triton widens both e4m3 operands for an fp16 HMMA;
64-row tiles take fp8's own wgmma); closer to the float model than e4m3's 3-bit x, but not the bits of
the rows past `DECODE_ROWS`. W's scale is looked up at (row // rows_per_scale, k // k_group): one per row
and whole K (per-channel, `stride_sk` 0), or one per [rows, k_group] block.

Up to `GEMV_ROWS` rows (one by default), for weights of at most `GEMV_MAX_WEIGHTS`, the product runs on
the CUDA cores instead (`_fp8_gemv_kernel`): each weight row's bytes loaded along K, widened to float32
and multiplied by x (rounded as above, the same bits), with no 16-row tile of which 15 rows are padding
(`fp8_gemv`, which can also make x from the input of the norm or gated activation before the layer).
Either kernel may split K at decode sizes (`_splits`), finishing a tile the same way (`split_k.finish`). Up to
`SWAPPED_ROWS` rows (an option, `GAPLESS_FP8_SWAPPED`) the tiles run transposed instead, y^T = W x^T, so
that W's tile is the first operand of fp8's wgmma and x, padded to 16 rows, the second (`_add_product`).

The Triton interpreter's own e4m3 conversion is wrong for some values (a carry into the next binade is
lost: 31.4 -> 16 instead of 32; triton 3.9), so under it `round_rows` rounds on the grid by hand, to
torch's bits; the CPU tests run the kernels on any activations against the torch reference
(`gapless.model.quant.fp8.reference_linear`), and the GPU test (and `bench/experiments/fp8_gemm.py`)
checks the hardware's rounding against it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gapless import env, pdl
from gapless.attention.triton_kernels import clamped_fp16
from gapless.model.quant.base import PendingNorm
from gapless.model.quant.fp8_gemv import _fp8_gemv_kernel
from gapless.model.quant.fp8_rounding import _fp8_quant_kernel, round_rows, rounding_buffers
from gapless.model.quant.split_k import counters, finish, partial_sums
from gapless.model.triton_math import ACTIVATIONS, NORM_KINDS

FP8_MAX = 448.0  # e4m3's largest finite value


@triton.jit(do_not_specialize=["M"])  # (docs/gpu.md#no-compile-mid-run)
def _fp8_gemm_kernel(
    x_ptr,
    xq_ptr,
    xs_ptr,
    w_ptr,
    s_ptr,
    b_ptr,
    y_ptr,
    p_ptr,
    lock_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_sk,
    stride_ym,
    rows_per_scale,
    k_group,
    split_k,
    HAS_BIAS: tl.constexpr,
    ROUND: tl.constexpr,
    SPLIT: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    SWAPPED: tl.constexpr,
    PDL: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    m_ok = offs_m < M
    n_ok = offs_n < N
    k_start = pid_s * split_k
    k_stop = tl.minimum(k_start + split_k, K)
    pdl.prefetch_weights(w_ptr + tl.where(n_ok, offs_n, 0) * stride_wn, k_start, k_stop, PDL)
    pdl.wait_for_previous(PDL)
    s_row = s_ptr + (offs_n // rows_per_scale) * stride_sn
    if SWAPPED:  # (the tile transposed: [BN, BM])
        acc = tl.zeros((BN, BM), dtype=tl.float32)
    else:
        acc = tl.zeros((BM, BN), dtype=tl.float32)
    if ROUND == 2:  # this program's share of x rounded first, into xq / xs (`_fp8_quant_kernel`'s layout)
        for k0 in range(k_start, k_stop, BK):
            ok = m_ok[:, None] & ((k0 + offs_k) < K)[None, :]
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + (k0 + offs_k)[None, :], mask=ok, other=0.0)
            q, scale = round_rows(x.to(tl.float32))
            tl.store(xq_ptr + offs_m[:, None] * K + (k0 + offs_k)[None, :], q, mask=ok)
            tl.store(xs_ptr + offs_m * tl.cdiv(K, BK) + k0 // BK, scale, mask=m_ok)
        tl.debug_barrier()  # (every thread's stores before any thread's loads below)
    for k0 in range(k_start, k_stop, BK):
        k_ok = (k0 + offs_k) < K
        if SWAPPED:  # W's [BN, BK] tile, each row's bytes along K (the dot's first operand)
            w = tl.load(
                w_ptr + offs_n[:, None] * stride_wn + (k0 + offs_k)[None, :],
                mask=n_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
        else:
            w = tl.load(
                w_ptr + offs_n[None, :] * stride_wn + (k0 + offs_k)[:, None],
                mask=n_ok[None, :] & k_ok[:, None],
                other=0.0,
            )
        w_scale = tl.load(s_row + (k0 // k_group) * stride_sk, mask=n_ok, other=0.0)
        if ROUND == 1 or ROUND == 2:  # x already e4m3 in xq [M, K], its scales [M, K / BK] in xs
            xq = tl.load(
                xq_ptr + offs_m[:, None] * K + (k0 + offs_k)[None, :],
                mask=m_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
            x_scale = tl.load(xs_ptr + offs_m * tl.cdiv(K, BK) + k0 // BK, mask=m_ok, other=0.0)
            acc = _add_product(acc, xq, w, x_scale, w_scale, SWAPPED)
        else:
            x_tile = x_ptr + offs_m[:, None] * stride_xm + (k0 + offs_k)[None, :]
            x = tl.load(x_tile, mask=m_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            if ROUND == 3:  # W8A16: x in fp16 (clamped to its range), the weights widened to fp16
                ones = tl.full((BM,), 1.0, tl.float32)
                acc = _add_product(acc, clamped_fp16(x), w.to(tl.float16), ones, w_scale, SWAPPED)
            else:
                xq, x_scale = round_rows(x)
                acc = _add_product(acc, xq, w, x_scale, w_scale, SWAPPED)
    if SWAPPED:
        acc = tl.trans(acc)
    finish(acc, y_ptr, p_ptr, lock_ptr, b_ptr, offs_m, offs_n, M, N, stride_ym, HAS_BIAS, SPLIT)


@triton.jit
def _add_product(acc, x, w, x_scale, w_scale, SWAPPED: tl.constexpr):
    """acc + x w ([BM, BK] times [BK, BN]) times x's scales a row and W's a column; SWAPPED: acc and the
    product transposed, [BN, BM], w [BN, BK] the dot's first operand (`SWAPPED_ROWS`)."""
    if SWAPPED:
        acc += tl.dot(w, tl.trans(x)) * w_scale[:, None] * x_scale[None, :]
    else:
        acc += tl.dot(x, w) * x_scale[:, None] * w_scale[None, :]
    return acc


def _tiles(m: int) -> tuple[int, int, int, int]:
    """(BM, BN, warps, stages) for M rows: at decode sizes a narrow N tile, so a weight's rows spread over
    more programs (the GEMM reads every weight once: bandwidth wants every SM busy; K is split too); 64-row
    tiles (fp8's wgmma) up to `MID_ROWS`, K split there too; 128 x 128 above, where the tensor cores'
    work is the cost."""
    if m <= 16:
        return DECODE_TILES
    if m <= MID_ROWS:
        return MID_TILES
    return 128, 128, 8, 3


# at most this many rows, x meets the weights as `DECODE_X` says (more: rounded in the loop). Rounded by a
# launch before the GEMM, on an H100 at one row it saved 11-21% of the GEMM's time on Qwen3-8B's layers
# (qkv 16.3 -> 12.9 us, gate/up 48.9 -> 40.5; bench/results/h100-2026-11-26/quant/fp8_gemm.log); on an
# H200 it took 44-56% of the time of rounding in the loop at 32 rows (64 x 64 tiles split: qkv 30.9 ->
# 14.8 us, o 23.6 -> 13.1, gate/up 98.4 -> 43.1, down 54.2 -> 24.3), 35-50% at 128 rows (qkv 69.9 ->
# 31.9, o 40.1 -> 19.9, gate/up 177.0 -> 61.4) (bench/results/h200-2026-11-27-gemv/fp8_sweep.log)
DECODE_ROWS = 128
# "launch", "program" (each program rounds its share of K before its loop: no launch), "fp16" (W8A16: no
# rounding, no launch) or "auto": the GEMV's x in its registers ("program"), the tiles' by a launch, the
# fastest of each on an H200 (the GEMV at one row: qkv 9.9 -> 8.4 us, o 8.2 -> 6.6, down 18.5 -> 17.9;
# the 16-row tiles: 10.6 against 16.3, 8.8 against 11.3); None: GAPLESS_FP8_DECODE's (default "auto")
DECODE_X: str | None = None
_ROUNDING = {"launch": 1, "program": 2, "fp16": 3}  # (the kernel's ROUND; 0: in the loop)
# (BM, BN, warps, stages) at decode sizes (`_tiles`): on an H200 at one row, the fastest on each of Qwen3-8B's
# layers of BN 32, 64, 128 and 512 or 1024 split programs (70.1 us the four against 78.6 at BN 32;
# bench/results/h200-2026-11-26/run3/fp8_sweep.log, `bench/experiments/fp8_gemm.py --sweep`)
DECODE_TILES = (16, 64, 4, 4)
# Up to this many rows (None: GAPLESS_FP8_GEMV_ROWS's, default 1) the GEMM of a weight of at most
# GEMV_MAX_WEIGHTS values runs as a GEMV on the CUDA cores (`_fp8_gemv_kernel`), a program row per row of
# x, BN x BK weight tiles (GEMV_TILES: BN, warps, steps a loop iteration whose loads go out together, and
# loop iterations whose loads are in flight at once through asynchronous copies: 1, none ahead), K
# split as at decode sizes; x as `DECODE_X` says (its rounding in the loop, past DECODE_ROWS, is the same
# rounding in the GEMV's registers). At one row the 16-row tiles do 16x the tensor-core work of the one
# row. In the sm_90 binary (bfloat16, per-channel, x by a launch) the GEMV's loop body is 213 instructions
# for 64 x 128 weight bytes (3.3 a byte), 127 registers, against the 16 x 64 tiles' 203 for as many bytes,
# fed by asynchronous copies 4 stages deep where the GEMV's loads are plain (its latency hidden by the
# programs an SM holds). On an H200 at one row (x in its registers, 512 programs; the tiles' x by a
# launch): qkv 8.4 us against 10.6, o 6.6 against 8.8, down 17.9 against 17.5, gate/up (100M values)
# 40.5 against 30.7, whence the bound; 64 x 4 warps was the fastest GEMV tile on the three, UNROLL 2 on
# gate/up alone (32.9) (bench/results/h200-2026-11-27-gemv/fp8_sweep.log). Stages were never timed: the kit
# times 1-4 on both models' layers (`bench/experiments/fp8_gemm.py --gemv-stages`).
GEMV_ROWS: int | None = None
GEMV_MAX_WEIGHTS = 1 << 25
GEMV_TILES = (64, 4, 1, 1)
# Up to this many rows (None: 16 where GAPLESS_FP8_SWAPPED is on, else 0) every weight's tiles run
# swapped (`_add_product`): y^T = W x^T, W's [BN, BK] e4m3 tile the dot's first operand and x (its rows
# padded to BM) the second, both e4m3 from shared memory into fp8's wgmma, the GEMV off. In the sm_90
# binary `QGMMA.64x16x32` with no widening, 115 instructions a loop step for 64 x 128 weight bytes, where
# the 16-row tiles widen both operands to fp16 for an mma.sync. Never timed: off; SWAPPED_TILES (BM, BN,
# warps, stages) as the 16-row tiles', K split the same way (`bench/experiments/fp8_gemm.py --swapped`).
SWAPPED_ROWS: int | None = None
SWAPPED_TILES = (16, 64, 4, 4)
SPLIT_PROGRAMS = 512  # at decode sizes, K is split until the GEMM runs about this many programs
# From 17 rows to MID_ROWS, MID_TILES with K split as at decode sizes (up to SPLIT_ROWS rows). On an H200
# at 32 rows with x rounded by a launch (DECODE_ROWS), 64 x 64 split was the fastest of 128 x 128, 64 x 128
# and 64 x 64, split or not, on qkv, o and down, and 64 x 64 unsplit on gate/up (32.4 us against 43.1);
# the four 95.3 us against 158.3 before (64 x 128 split, x rounded in the loop); at 128 rows, 64 x 64
# split: qkv 31.9 us, o 19.9, gate/up 61.4 (64 x 128 unsplit: 24.1, 23.5, 61.6; down not timed)
# (bench/results/h200-2026-11-27-gemv/fp8_sweep.log; bf16's cuBLAS at 128 rows: 16.8, 12.9, 58.4 in
# bench/results/h200-2026-11-27/quant/fp8_gemm.log).
MID_ROWS = 128
MID_TILES = (64, 64, 4, 3)
SPLIT_ROWS = 128


def _splits(m: int, n_tiles: int, k_steps: int, device: torch.device) -> int:
    """How many parts K is cut into: 1 (each program runs the whole of K) unless the rows are a decode's
    (<= `SPLIT_ROWS`) and the tiles too few to keep every SM reading; then enough parts for
    `SPLIT_PROGRAMS` programs, each at least one BK step. 1 also while a CUDA graph is being captured
    before the device has its counters (`split_k.counters`)."""
    if m > SPLIT_ROWS:
        return 1
    splits = min(k_steps, -(-SPLIT_PROGRAMS // n_tiles))
    if splits <= 1 or counters(device, n_tiles) is None:
        return 1
    return splits


def _swapped(m: int) -> bool:
    """Whether x of M rows meets the weights in swapped tiles (`SWAPPED_ROWS`)."""
    return m <= (SWAPPED_ROWS if SWAPPED_ROWS is not None else 16 if env.FP8_SWAPPED.get() else 0)


def _plan(m: int, n: int, k: int) -> tuple[bool, int]:
    """(whether the GEMV runs, the kernel's ROUND) for x of M rows and a weight [N, K]."""
    gemv_rows = GEMV_ROWS if GEMV_ROWS is not None else env.FP8_GEMV_ROWS.get()
    gemv = m <= gemv_rows and n * k <= GEMV_MAX_WEIGHTS and not _swapped(m)
    by = DECODE_X or env.FP8_DECODE.get()
    if by == "auto":  # the GEMV's x in its registers and the swapped tiles' by each program (no launch
        # for o's; untimed), the tiles' by a launch
        by = "program" if gemv or _swapped(m) else "launch"
    return gemv, 0 if m > DECODE_ROWS else _ROUNDING[by]


def _buffered(gemv: bool, rounding: int) -> bool:
    """Whether x is rounded into a buffer before the loop: by a launch, or by the tiles' programs (the
    GEMV rounds x in its registers: no buffer)."""
    return rounding == 1 or rounding == 2 and not gemv


def rounds_before(m: int, n: int, k: int) -> bool:
    """Whether `fp8_gemm` rounds x of M rows into a buffer before its loop, for a weight [N, K] (by a
    launch, or by its tiles' programs): what the kernel before the layer may do instead, passing the result
    as `rounded` (unless `GAPLESS_FP8_UNFUSED_ROUNDING`; `gapless.model.quant.base.RoundedRows`)."""
    return not env.FP8_UNFUSED_ROUNDING.get() and _buffered(*_plan(m, n, k))


def _loads_x(m: int, n: int, k: int) -> bool:
    """Whether the GEMV runs for x of M rows and a weight [N, K] and loads x itself (rounding it in its
    registers, or taking it in fp16): where it can make x from the input of the kernel before it."""
    gemv, rounding = _plan(m, n, k)
    return gemv and rounding != 1


def takes_gated(m: int, n: int, k: int) -> bool:
    """Whether `fp8_gemm` takes x of M rows as a gated activation's input for a weight [N, K]: where the
    GEMV loads x (`_loads_x`), unless `GAPLESS_FP8_UNFUSED_ACTIVATION`."""
    return _loads_x(m, n, k) and not env.FP8_UNFUSED_ACTIVATION.get()


def takes_norm(m: int, n: int, k: int) -> bool:
    """Whether `fp8_gemm` takes x of M rows as an RMSNorm's input (`PendingNorm`) for a weight [N, K]:
    where the GEMV loads x (`_loads_x`), unless `GAPLESS_FP8_UNFUSED_NORM`."""
    return _loads_x(m, n, k) and not env.FP8_UNFUSED_NORM.get()


def fp8_gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    scale: torch.Tensor,
    rows_per_scale: int,
    k_group: int,
    act_group: int,
    bias: torch.Tensor | None,
    rounded: tuple[torch.Tensor, torch.Tensor] | None = None,
    gated: str | None = None,
    norm: PendingNorm | None = None,
) -> torch.Tensor:
    """x [M, K] (float) times w [N, K] (e4m3)^T with w's float32 `scale` [N / rows_per_scale, K / k_group]
    (k_group 0: one scale per row for all of K), x quantized per row and `act_group` columns (up to
    `DECODE_ROWS` rows as `DECODE_X` says); [M, N] in x's dtype. At decode sizes K may be split over
    several programs per tile (`_splits`). `rounded`: x already rounded so (e4m3 [M, K] and float32
    scales [M, ceil(K / act_group)], `_fp8_quant_kernel`'s layout), taken where x would be rounded before
    the loop (`rounds_before`) instead of rounding it again; ignored elsewhere. `gated` (a key of
    `triton_math.ACTIVATIONS`, where `takes_gated`): x is [M, 2K], [gate, up], and the product is of
    act(gate) * up, made by the GEMV as it loads x (the bits `act_and_mul` would write). `norm` (where
    `takes_norm`): x is `norm.x`, an RMSNorm's input, and the product is of its norm (of x + `norm.residual`,
    written to `norm.residual_out`), made by the GEMV as it loads x (`rms_norm`'s arithmetic). No rows:
    nothing launched."""
    m, k = x.shape[0], x.shape[1] // 2 if gated else x.shape[1]
    n = w.shape[0]
    if m == 0:  # (no rows: no launch, and no tiles to split K over)
        return torch.empty(0, n, dtype=x.dtype, device=x.device)
    if gated and not takes_gated(m, n, k):
        raise ValueError(f"the FP8 GEMM takes no gated input at {m} rows of a weight [{n}, {k}]")
    if norm is not None and (gated or not takes_norm(m, n, k)):
        raise ValueError(f"the FP8 GEMM takes no RMSNorm's input at {m} rows of a weight [{n}, {k}]")
    x = x if x.stride(1) == 1 else x.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    gemv, rounding = _plan(m, n, k)
    swapped = _swapped(m)
    bm, bn, warps, stages = (1, *GEMV_TILES[:2], 1) if gemv else SWAPPED_TILES if swapped else _tiles(m)
    tiles_m, tiles_n, k_steps = triton.cdiv(m, bm), triton.cdiv(n, bn), triton.cdiv(k, act_group)
    splits = _splits(m, tiles_m * tiles_n, k_steps, x.device)
    steps = triton.cdiv(k_steps, splits)
    splits = triton.cdiv(k_steps, steps)  # no split left without a step
    partial = partial_sums(splits, m, n, x.device) if splits > 1 else y
    xq, xs = y, y  # (unread unless x is rounded before the loop)
    if _buffered(gemv, rounding):
        if rounded is not None:
            if rounded[0].shape != (m, k) or rounded[1].shape != (m, k_steps):
                raise ValueError(
                    f"x rounded as {tuple(rounded[0].shape)} and {tuple(rounded[1].shape)} scales, "
                    f"expected ({m}, {k}) and ({m}, {k_steps})"
                )
            (xq, xs), rounding = rounded, 1
        else:
            xq, xs = rounding_buffers(m, k, act_group, x.device)
            if rounding == 1:
                _fp8_quant_kernel[(m, k_steps)](
                    x, xq, xs, k, x.stride(0), BK=act_group, **pdl.launch_args(x.device)
                )
    args = (
        x,
        xq,
        xs,
        w,
        scale,
        bias if bias is not None else scale,
        y,
        partial,
        counters(x.device, tiles_m * tiles_n) if splits > 1 else y,
        m,
        n,
        k,
        x.stride(0),
        w.stride(0),
        scale.stride(0),
        0 if k_group == 0 else scale.stride(1),
        y.stride(0),
        rows_per_scale,
        k_group or k,
        steps * act_group,
    )
    grid = (tiles_m, tiles_n, splits)
    if gemv:  # x's rounding in the loop is the GEMV's in its registers (2): the same bits
        _fp8_gemv_kernel[grid](
            *args,
            *_norm_args(norm, m, k, y),
            HAS_BIAS=bias is not None,
            ROUND=rounding or 2,
            SCALES=0 if k_group == 0 else 1 if rows_per_scale % bn == 0 else 2,
            SPLIT=splits > 1,
            BN=bn,
            BK=act_group,
            UNROLL=GEMV_TILES[2],
            STAGES=GEMV_TILES[3],
            GATED=ACTIVATIONS[gated] if gated else -1,
            NORM=NORM_KINDS[norm.kind] if norm is not None else -1,
            RESIDUAL=norm is not None and norm.residual is not None,
            ROW_BLOCK=triton.next_power_of_2(k) if norm is not None else 1,  # (one compile for any K)
            PREFETCH=_prefetches(norm, x.device),
            num_warps=warps,
            num_stages=stages,
            **pdl.launch_args(x.device),
        )
        return y
    _fp8_gemm_kernel[grid](
        *args,
        HAS_BIAS=bias is not None,
        ROUND=rounding,
        SPLIT=splits > 1,
        BM=bm,
        BN=bn,
        BK=act_group,
        SWAPPED=swapped,
        num_warps=warps,
        num_stages=stages,
        **pdl.launch_args(x.device),
    )
    return y


def _prefetches(norm: PendingNorm | None, device: torch.device) -> bool:
    """Whether the GEMV fetches its weights' first bytes into L2 before it waits or norms x: where PDL runs,
    or where it norms x, compiled (PTX's prefetch: not under the interpreter)."""
    compiled = device.type == "cuda" and not env.TRITON_INTERPRET.get()
    return pdl.active(device) or (norm is not None and compiled)


def _norm_args(
    norm: PendingNorm | None, m: int, k: int, unread: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """The GEMV's (residual, norm weight, residual out, eps) for `norm` ([M, K] rows, contiguous); `unread`
    where it has none."""
    if norm is None:
        return unread, unread, unread, 0.0
    if norm.residual is None:
        return unread, norm.weight, unread, norm.eps
    out = norm.residual_out
    if out is None or out.shape != norm.residual.shape or not out.is_contiguous():
        raise ValueError("an RMSNorm's residual add needs a contiguous residual_out of the residual's shape")
    return norm.residual.reshape(m, k).contiguous(), norm.weight, out, norm.eps
