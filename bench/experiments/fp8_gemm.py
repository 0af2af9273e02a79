"""The FP8 W8A8 GEMM against bf16 and against torch._scaled_mm, on the linear shapes of Qwen3-0.6B and
Qwen3-8B: microseconds a call (CUDA graphs: launch cost excluded) and the weight bytes read per second.

    python bench/experiments/fp8_gemm.py [--rows 1 16 128 2048]        # on a GPU of sm_89 or newer
    python bench/experiments/fp8_gemm.py --sweep [--rows 1 128]        # tiles x K splits x x's rounding
    python bench/experiments/fp8_gemm.py --gemv-stages                 # the GEMV's loads 1-4 steps deep
    python bench/experiments/fp8_gemm.py --swapped                     # the swapped tiles (W x^T)

Rows are tokens (1: batch-1 decode). Columns: bf16 `torch.mm`; gapless's Triton kernel
(`gapless.model.quant.fp8_kernel`) with per-channel and with [128, 128] block scales, x rounded in the
GEMM's loop; per-channel with x rounded before the loop by a launch before the GEMM (`DECODE_X =
"launch"`, the tiles' default up to `DECODE_ROWS`), by each program for its share of K ("program": no
launch), and not rounded ("fp16", W8A16: no launch), each at any row count (`DECODE_ROWS` raised to it);
the GEMV on the CUDA cores (`GEMV_ROWS`, whatever the weight's size, x by a launch; up to 16 rows); the
tiles' columns with the GEMV off;
`torch._scaled_mm` with rowwise scales (bf16 out; its activation quantization, a separate torch step,
timed with it); `torch.nn.functional.scaled_mm` with DeepSeek's block recipes (x per 1x128, w per
128x128; where this torch has it, else the cell says why). Whichever is faster at 1 row is the decode
path to keep.

`--sweep` times per-channel FP8 on Qwen3-8B's layers at each decode tile (16-row tiles run an fp16 dot on
the weights widened in registers; 64-row tiles, fp8's own wgmma, compiled for sm_90 here: QGMMA, no
widening, except for x in fp16), each `DECODE_X`, and past 16 rows the larger tiles with K split and
not, x rounded in the loop or by a launch first; at one row also the default tile's K split and stages,
and the GEMV (`GEMV_ROWS`) at each (BN, warps, steps a loop iteration, stages), x by a launch or in its
registers (and in fp16).

`--gemv-stages` times, at one row on both models' layers, the default path (`fp8_gemm` as it chooses)
against the GEMV whatever the weight's size, its loads 1 to 4 loop iterations deep (`GEMV_TILES`' stages:
asynchronous copies from 2), x in its registers, K split to 512 programs: whether the stages make the
GEMV faster, and whether they make it faster than the 16-row tiles on the 8B's gate/up and down (whose
default row here includes x's rounding launch, which the engine's fused norm and activation save it).
"""

from __future__ import annotations

import argparse
import functools
from unittest import mock

import torch
import triton.testing

from gapless.model.quant import fp8_kernel
from gapless.model.quant.fp8 import quantize_blocks, quantize_groups, quantize_rows
from gapless.model.quant.fp8_kernel import fp8_gemm

# (name, N, K) of each model's linear layers (fused q/k/v and gate/up as the engine runs them)
SHAPES = {
    "qwen3-0.6b": [("qkv", 4096, 1024), ("o", 1024, 2048), ("gate_up", 6144, 1024), ("down", 1024, 3072)],
    "qwen3-8b": [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 24576, 4096), ("down", 4096, 12288)],
}


def _us(fn) -> float:
    try:
        return triton.testing.do_bench_cudagraph(fn, rep=50) * 1e3
    except Exception as e:  # noqa: BLE001 - a path this torch lacks is a cell, not a crash
        print(f"  ({type(e).__name__}: {str(e).splitlines()[0][:120]})")
        return float("nan")


HEADER = (
    "| model | layer | N x K | rows | bf16 us | fp8 channel us | fp8 block us "
    "| fp8 channel x rounded first us | by each program us | x in fp16 us | GEMV us | _scaled_mm us "
    "| F.scaled_mm block us | bf16 GB/s | fp8 GB/s |"
)


def row(model: str, name: str, n: int, k: int, m: int) -> str:
    """One shape at `m` rows: each path's microseconds, and the weight bytes per second of bf16 and fp8."""
    dev = torch.device("cuda")
    w = torch.randn(n, k, device=dev) * 0.02
    wb = w.bfloat16()
    qc, sc = quantize_rows(w)
    qb, sb = quantize_blocks(w, (128, 128))
    sc_row = sc.t().contiguous()  # _scaled_mm's rowwise scale of b: [1, N]
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)

    def scaled_mm() -> torch.Tensor:
        xq, xs = quantize_groups(x, k)  # one scale per row
        return torch._scaled_mm(xq, qc.t(), scale_a=xs, scale_b=sc_row, out_dtype=torch.bfloat16)

    def block_scaled_mm() -> torch.Tensor:
        # torch >= 2.10's recipes (DeepSeek's layout): x per 1x128, w per 128x128; scales of x K-major
        f = torch.nn.functional
        xq, xs = quantize_groups(x, 128)
        xs = xs.t().contiguous().t()  # [M, K/128], column-major as cuBLAS wants it
        st = f.ScalingType
        return f.scaled_mm(xq, qb.t(), xs, st.BlockWise1x128, sb, st.BlockWise128x128)

    channel = functools.partial(fp8_gemm, x, qc, sc, 1, 0, 128, None)
    bf16 = _us(lambda: torch.mm(x, wb.t()))
    with mock.patch.multiple(fp8_kernel, DECODE_ROWS=0, GEMV_ROWS=0):
        block = _us(lambda: fp8_gemm(x, qb, sb, 128, 128, 128, None))
        chan = _us(channel)
    decode = {}
    for by in ("launch", "program", "fp16"):  # (at any row count: DECODE_ROWS raised to the rows)
        with mock.patch.multiple(fp8_kernel, DECODE_ROWS=max(m, 16), DECODE_X=by, GEMV_ROWS=0):
            decode[by] = _us(channel)
    gemv_at = {"GEMV_ROWS": m, "GEMV_MAX_WEIGHTS": n * k}
    with mock.patch.multiple(fp8_kernel, DECODE_ROWS=max(m, 16), DECODE_X="launch", **gemv_at):
        gemv = _us(channel) if m <= 16 else float("nan")
    smm = _us(scaled_mm)
    fsmm = _us(block_scaled_mm)
    best = min(chan, *decode.values(), gemv)
    cells = (bf16, chan, block, *decode.values(), gemv, smm, fsmm)
    return (
        f"| {model} | {name} | {n} x {k} | {m} | "
        + " | ".join(f"{us:.1f}" for us in cells)
        + f" | {2 * n * k / bf16 / 1e3:.0f} | {n * k / best / 1e3:.0f} |"
    )


# what `--sweep` times: at decode sizes (<= 16 rows, `fp8_kernel.DECODE_TILES`) each tile (BM, BN, warps,
# stages) with K split to about 512 programs and each way x meets the weights (`DECODE_X`); at one row the
# default tile also unsplit and split to 256 programs, over 3, 4 and 6 stages, x by a launch (gate/up and
# down, too big for the GEMV, run on it at 3.3 and 2.9 TB/s where bf16's cuBLAS reads 4.1 and 3.7:
# bench/results/h200-2026-11-27-default); at more rows (`fp8_kernel._tiles`'s others) with the K split off
# and on (on is the default to `SPLIT_ROWS`), x rounded in the loop ("loop": the default past
# `DECODE_ROWS`) or by a launch first; 0 programs: no split. 16 x 32, 16 x 128 and 64 x 32 tiles, and 1024
# programs, were slower on every layer on an H200 (bench/results/h200-2026-11-26/run3,
# h200-2026-11-27-default).
SWEEP_TILES = [(16, 64, 4, 4), (64, 64, 4, 4)]
SWEEP_ROUNDING = ["launch", "program", "fp16"]
SWEEP_ONE_ROW = [((16, 64, 4, s), p) for s in (3, 4, 6) for p in (0, 256, 512)]
SWEEP_TILES_MORE = [(128, 128, 8, 3), (64, 128, 4, 3), (64, 64, 4, 3)]
SWEEP_SPLITS_MORE = [0, 512]
SWEEP_ROUNDING_MORE = ["loop", "launch"]
# the GEMV on the CUDA cores (`fp8_kernel.GEMV_ROWS`, at one row): (BN, warps, steps a loop iteration,
# stages) x x's rounding, at 512 programs (W8A16 at the default tiles only: a choice of arithmetic more than
# of speed); 64 x 8 warps, 32 x 4 two steps a loop and 1024 programs were slower on every layer on an H200
SWEEP_GEMV = [(32, 4, 1, 1), (64, 4, 1, 1), (64, 4, 2, 1)]
GEMV_STAGES = [1, 2, 3, 4]  # `--gemv-stages`' (1: plain loads, as before stages)
# Qwen3-0.6B's layers at one row (all under the GEMV's bound, 5.1 us each on an H200 where 3.2 would meet
# the 0.6x target: bench/results/h200-2026-11-27-default): the default GEMV with K split to 0 (none), 128,
# 256 and 512 programs (K is 1,024-3,072 there: at 512 programs a program takes one 128-column step)
SWEEP_SMALL: list[tuple[tuple[int, ...], int, str, str]] = [
    (fp8_kernel.GEMV_TILES, p, "program", "gemv") for p in (0, 128, 256, 512)
]
# `--swapped`: the swapped tiles (W x^T: `fp8_kernel.SWAPPED_ROWS`, never timed; fp8's wgmma with both
# operands e4m3 from shared memory, 115 instructions a loop step for 64 x 128 weight bytes in the sm_90
# binary) at BN 64 (K split to 256 and 512 programs) and 128 (512), x by a launch, at 1 and 16 rows
SWEEP_SWAPPED = [((16, 64, 4, 4), 256), ((16, 64, 4, 4), 512), ((16, 128, 4, 4), 512)]

Config = tuple[
    tuple[int, ...], int, str, str
]  # (tiles, split programs, x's rounding, "tiles" | "gemv" | "swapped")
SWEEP_HEADER = (  # `--sweep`'s and `--gemv-stages`' tables
    "| layer | N x K | rows | tiles (BM, BN, warps, stages; GEMV: BN, warps, unroll, stages) "
    "| split programs | decode x | us | GB/s |\n|---|---|---:|---|---:|---|---:|---:|"
)


def _sweep_configs(m: int) -> list[Config]:
    """(tiles, split programs, x's rounding, GEMV) for `m` rows: the GEMV's at one row."""
    if m > 16:
        more = [(t, p, by) for t in SWEEP_TILES_MORE for p in SWEEP_SPLITS_MORE for by in SWEEP_ROUNDING_MORE]
        return [(t, p, by, "tiles") for t, p, by in more]
    configs: list[Config] = [(t, 512, by, "tiles") for t in SWEEP_TILES for by in SWEEP_ROUNDING]
    if m == 1:
        one_row: list[Config] = [(t, p, "launch", "tiles") for t, p in SWEEP_ONE_ROW]
        configs += [c for c in one_row if c not in configs]
        configs += [(t, 512, by, "gemv") for t in SWEEP_GEMV for by in ("launch", "program")]
        configs.append((fp8_kernel.GEMV_TILES, 512, "fp16", "gemv"))
    return configs


def sweep(rows: list[int]) -> None:
    """Per-channel FP8 at each tile, split target and rounding of x, on Qwen3-0.6B's layers at one row
    (`SWEEP_SMALL`) and Qwen3-8B's at `rows`: us a call, the weight's GB/s, the fastest marked."""
    print(SWEEP_HEADER)
    if 1 in rows:
        for name, n, k in SHAPES["qwen3-0.6b"]:
            _sweep_layer(name, n, k, 1, SWEEP_SMALL)
    for name, n, k in SHAPES["qwen3-8b"]:
        for m in rows:
            _sweep_layer(name, n, k, m, _sweep_configs(m))


def gemv_stages() -> None:
    """At one row, each layer of both models: the default path, then the GEMV at each of `GEMV_STAGES`."""
    print(SWEEP_HEADER)
    for model, layers in SHAPES.items():
        for name, n, k in layers:
            gemv = [((64, 4, 1, s), 512, "program", "gemv") for s in GEMV_STAGES]
            _sweep_layer(f"{model} {name}", n, k, 1, gemv, default=True)


def swapped() -> None:
    """At 1 and 16 rows, each layer of both models: the default path, then the swapped tiles at each of
    `SWEEP_SWAPPED`."""
    print(SWEEP_HEADER)
    for model, layers in SHAPES.items():
        for name, n, k in layers:
            for m in (1, 16):
                configs = [(t, p, "launch", "swapped") for t, p in SWEEP_SWAPPED]
                _sweep_layer(f"{model} {name}", n, k, m, configs, default=True)


def _sweep_layer(name: str, n: int, k: int, m: int, configs: list[Config], default: bool = False) -> None:
    """One layer's rows of the sweep table: `m` rows of x against an [n, k] weight at each config."""
    dev = torch.device("cuda")
    qc, sc = quantize_rows(torch.randn(n, k, device=dev) * 0.02)
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    call = functools.partial(fp8_gemm, x, qc, sc, 1, 0, 128, None)
    times = {}
    if default:  # (as the engine runs it: tiles or GEMV, split and rounding its own)
        times[(), 0, "default", "tiles"] = _us(call)
    for tiles, programs, by, kind in configs:
        with mock.patch.multiple(
            fp8_kernel,
            _tiles=functools.partial(lambda t, _m: t, tiles),
            GEMV_ROWS=m if kind == "gemv" else 0,
            GEMV_MAX_WEIGHTS=n * k,
            GEMV_TILES=tiles if kind == "gemv" else fp8_kernel.GEMV_TILES,
            SWAPPED_ROWS=m if kind == "swapped" else 0,
            SWAPPED_TILES=tiles if kind == "swapped" else fp8_kernel.SWAPPED_TILES,
            SPLIT_PROGRAMS=programs or fp8_kernel.SPLIT_PROGRAMS,
            SPLIT_ROWS=max(m, 16) if programs else 0,
            DECODE_ROWS=16 if by == "loop" else max(m, 16),
            DECODE_X="launch" if by == "loop" else by,
        ):
            times[tiles, programs, by, kind] = _us(call)
    best = min(times, key=lambda c: times[c])
    for (tiles, programs, by, kind), us in times.items():
        mark = " (best)" if (tiles, programs, by, kind) == best else ""
        gbs = n * k / us / 1e3
        shape = f"{kind} {tiles}" if kind != "tiles" else str(tiles) if tiles else "default"
        cells = (name, f"{n} x {k}", m, shape, programs, by, f"{us:.1f}{mark}", f"{gbs:.0f}")
        print("| " + " | ".join(str(c) for c in cells) + " |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 128, 2048])
    p.add_argument("--sweep", action="store_true", help="tiles x K splits x rounding (see `sweep`)")
    p.add_argument(
        "--gemv-stages", action="store_true", help="the GEMV's stages at one row (see `gemv_stages`)"
    )
    p.add_argument("--swapped", action="store_true", help="the swapped tiles at 1 and 16 rows (`swapped`)")
    args = p.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    if args.gemv_stages:
        gemv_stages()
        return
    if args.swapped:
        swapped()
        return
    if args.sweep:
        sweep(args.rows)
        return
    print(HEADER)
    print("|---|---|---|---:|" + "---:|" * 11)
    for model, layers in SHAPES.items():
        for name, n, k in layers:
            for m in args.rows:
                print(row(model, name, n, k, m), flush=True)


if __name__ == "__main__":
    main()
