"""The int4/int8 weight-only GEMM (`gapless.model.quant.int4_triton`) against torch's bf16 GEMM on the same
layer shapes, at decode's row counts.

    python -m gapless.bench.int4_gemm --device cuda [--m 1 16] [--shapes 4096:28672 14336:4096 ...]
        [--bits 4] [--group 128] [--block-m 0 1] [--block-n 0 32 128] [--split-k 0 1 4 8] [--block-k 0 64]
        [--warps 0 8] [--nibble-dots 1 0] [--ptx-values 0 1] [--factored 0 1] [--swapped 0 1]
        [--kernels triton tinygemm gemlite] [--json FILE]

For each layer shape IN:OUT (default: Llama-3-8B's fused q/k/v 4096:6144, o 4096:4096, fused gate/up
4096:28672, down 14336:4096) and each row count M: the median device time of `torch.mm` on a bf16 weight,
and of the quantized GEMM for each tile variant (every combination of `--block-m` (1: the
GEMV variant), `--block-n`, `--split-k`, `--block-k`, `--warps`; 0: the heuristic's choice; and
`--nibble-dots`: a dot per value of the words, or one reshaped tile, `int4_triton`'s docstring; and
`--ptx-values`: those values dequantized by PTX, where they can be; `--factored`: the GEMV's scales and
zeros applied once a word; `--swapped`: W x^T, W the dots' first operand, at 16 rows or more; any of the
four not given: the heuristic's; the dots column says which ran, `_values`), its
weight bytes read per microsecond (packed weight + scales + zeros), and the ratio to bf16. Device time is
`gapless.bench.timing.median_us`: `--iters` calls captured in a CUDA graph and replayed, each call reading
a weight from memory, not L2 (`cold_copies`). A row also carries the largest difference from the bf16
matmul of the dequantized weight, relative to that output's largest value (a check the kernel computed
the product it is timed on). `--kernels` adds the libraries' int4 GEMMs `GAPLESS_INT4_KERNEL` can name
(`gapless.model.quant.int4_kernels`: torch's tinygemm, gemlite), each a row of its own (tile columns "-"),
or a line saying why it cannot run (gemlite not installed, a shape it refuses). On a CPU the Triton column
runs only under the interpreter (for tests; the figures mean nothing there), the libraries not at all.
"""

from __future__ import annotations

import argparse
import itertools
import json
from functools import partial
from typing import Any

import torch

from gapless.bench import cli
from gapless.bench.timing import cold_copies, cycling, median_us
from gapless.model.quant.formats import QuantFormatError
from gapless.model.quant.int4 import Int4LinearMethod
from gapless.model.quant.int4_kernels import KERNELS, library_kernel
from gapless.model.quant.int4_layouts import Int4Spec, Unpacked
from gapless.model.quant.int4_triton import (
    INTERPRET,
    GemmConfig,
    choose_config,
    factored,
    nibble_dots,
    ptx_values,
    swapped,
    w4a16_matmul,
)
from gapless.testing.quant_checkpoints import quantize

LLAMA3_8B = ["4096:6144", "4096:4096", "4096:28672", "14336:4096"]
# a row's tile columns where no Triton tile applies (a library's row, or no kernel at all)
_NO_TILES = dict(block_m="-", block_n="-", split_k="-", block_k="-", warps="-", stages="-", dots="-")


def _shape(text: str) -> tuple[int, int]:
    try:
        k, n = (int(v) for v in text.split(":"))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"shape {text!r} is not IN:OUT (e.g. 4096:14336)") from e
    return k, n


def _layer(k: int, n: int, args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> Any:
    gen = torch.Generator().manual_seed(0)
    w = quantize((torch.randn(n, k, generator=gen) * 0.02).to(device), args.bits, args.group, sym=False)
    spec = Int4Spec("gptq", args.bits, args.group, False)
    triton = Int4LinearMethod(w, spec, dtype, device, kernel="triton")  # (whatever `auto` would give it)
    return w, triton, w.dequantize().to(dtype).to(device)


def _library(
    kernel: str, w: Unpacked, x: torch.Tensor, ref: torch.Tensor, args: argparse.Namespace
) -> dict[str, Any]:
    """A library kernel's row (`--kernels`): as `_timed`'s, over copies of its own form of the weight; or
    the reason it cannot run."""
    device = torch.device(args.device)

    def make() -> Any:
        return library_kernel(kernel, w, args.bits, x.dtype, device, f"int{args.bits} g{args.group}")

    try:
        first = make()
    except (QuantFormatError, RuntimeError, NotImplementedError) as e:
        return dict(kernel=kernel, error=str(e).splitlines()[0], **_NO_TILES)
    q_bytes = sum(t.numel() * t.element_size() for t in first.tensors())
    copies = [first] + [make() for _ in range(cold_copies(q_bytes, device) - 1)]
    err = (first(x).float() - ref.float()).abs().max().item()
    us = median_us(cycling([partial(c, x) for c in copies]), device, args)
    rel = err / max(ref.abs().max().item(), 1e-30)
    return dict(kernel=kernel, us=us, gb_s=q_bytes / us / 1e3, rel_err=rel, **_NO_TILES)


def _configs(chosen: GemmConfig, args: argparse.Namespace, m: int) -> list[GemmConfig]:
    """Every combination of the tile options asked for (0, or None for the two flags: the heuristic's
    choice, `chosen`), each as it runs (dots per value and PTX values only where they can) and once; the
    GEMV (`--block-m 1`) at one row only (past it, it reads the weights once a row)."""
    configs = [
        chosen._replace(
            block_m=bm or chosen.block_m,
            block_n=bn or chosen.block_n,
            split_k=split or chosen.split_k,
            block_k=bk or chosen.block_k,
            num_warps=warps or chosen.num_warps,
            num_stages=stages or chosen.num_stages,
            nibble_dots=chosen.nibble_dots if nibble is None else bool(nibble),
            ptx_values=chosen.ptx_values if ptx is None else bool(ptx),
            factored=chosen.factored if fac is None else bool(fac),
            swapped=chosen.swapped if swap is None else bool(swap),
        )
        for bm, bn, split, bk, warps, stages, nibble, ptx, fac, swap in itertools.product(
            args.block_m,
            args.block_n,
            args.split_k,
            args.block_k,
            args.warps,
            args.stages,
            args.nibble_dots,
            args.ptx_values,
            args.factored,
            args.swapped,
        )
    ]
    dtype = getattr(torch, args.dtype)
    runs = (
        c._replace(
            nibble_dots=nibble_dots(c, args.bits),
            ptx_values=ptx_values(c, args.bits, dtype),
            factored=factored(c),
            swapped=swapped(c),
        )
        for c in configs
        if c.block_m != 1 or m == 1
    )
    return list(dict.fromkeys(runs))


def _timed(
    x: torch.Tensor,
    ref: torch.Tensor,
    method: Int4LinearMethod,
    q_set: list[list[torch.Tensor]],
    cfg: GemmConfig,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """One variant's row: its median time over the cold copies, bandwidth, and error against `ref`."""
    call = partial(w4a16_matmul, x, group=method.group, bits=method.bits, config=cfg)
    err = (call(*method.tensors()).float() - ref.float()).abs().max().item()
    us = median_us(cycling([partial(call, *ts) for ts in q_set]), torch.device(args.device), args)
    q_bytes = sum(t.numel() * t.element_size() for t in method.tensors())
    return dict(
        kernel="triton",
        block_m=cfg.block_m,
        block_n=cfg.block_n,
        split_k=cfg.split_k,
        block_k=cfg.block_k,
        warps=cfg.num_warps,
        stages=cfg.num_stages,
        dots=_values(cfg, method.bits, x.dtype),
        us=us,
        gb_s=q_bytes / us / 1e3,
        rel_err=err / max(ref.abs().max().item(), 1e-30),
    )


def rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    triton_runs = device.type == "cuda" or INTERPRET
    out = []
    for k, n in args.shapes:
        w, method, dense = _layer(k, n, args, device, dtype)
        q_bytes = sum(t.numel() * t.element_size() for t in method.tensors())
        dense_set = [dense] + [dense.clone() for _ in range(cold_copies(dense.numel() * 2, device) - 1)]
        q_set = [method.tensors()] + [
            [t.clone() for t in method.tensors()] for _ in range(cold_copies(q_bytes, device) - 1)
        ]
        for m in args.m:
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype).to(device)
            ref = x @ dense.t()
            row: dict[str, Any] = dict(shape=f"{k}:{n}", m=m)
            row["bf16_us"] = median_us(
                cycling([partial(torch.mm, x, d.t()) for d in dense_set]), device, args
            )
            chosen = choose_config(m, n, k, method.group)
            row["variants"] = [
                _timed(x, ref, method, q_set, cfg, args)
                for cfg in (_configs(chosen, args, m) if triton_runs and "triton" in args.kernels else [])
            ]
            if device.type == "cuda":
                row["variants"] += [_library(kn, w, x, ref, args) for kn in args.kernels if kn != "triton"]
            for v in row["variants"]:
                v["vs_bf16"] = v["us"] / row["bf16_us"] if "us" in v else float("nan")
            out.append(row)
    return out


def _values(cfg: GemmConfig, bits: int, dtype: torch.dtype) -> str:
    """How a Triton row takes its values, its dots column: fac (the factored GEMV), ptx (by PTX), P (a dot
    per value of the words), 1 (one reshaped tile); the swapped tiles (W x^T) T, then P or 1, then x where
    by PTX. A library's row: -."""
    if factored(cfg):
        return "fac"
    ptx, by_value = ptx_values(cfg, bits, dtype), "P" if nibble_dots(cfg, bits) else "1"
    if swapped(cfg):
        return f"T{by_value}{'x' if ptx else ''}"
    return "ptx" if ptx else by_value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m gapless.bench.int4_gemm", description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--m", type=cli.positive_int, nargs="+", default=[1, 16], help="rows (tokens) per call")
    p.add_argument("--shapes", type=_shape, nargs="+", default=[_shape(s) for s in LLAMA3_8B])
    p.add_argument("--bits", type=int, choices=[4, 8], default=4)
    p.add_argument("--group", type=cli.positive_int, default=128)
    p.add_argument("--block-m", type=int, nargs="+", default=[0], help="0: the heuristic's; 1: GEMV")
    p.add_argument("--block-n", type=int, nargs="+", default=[0], help="0: the heuristic's")
    p.add_argument("--split-k", type=int, nargs="+", default=[0], help="0: the heuristic's")
    p.add_argument("--block-k", type=int, nargs="+", default=[0], help="0: the heuristic's")
    p.add_argument("--warps", type=int, nargs="+", default=[0], help="0: the heuristic's")
    p.add_argument(
        "--stages",
        type=int,
        nargs="+",
        default=[0],
        help="loop iterations in flight (GemmConfig); 0: the heuristic's",
    )
    for flag, what in (
        ("nibble-dots", "1: a dot per value of the words where the tiles allow; 0: one reshaped tile"),
        ("ptx-values", "1: the values dequantized by PTX (4 bits, half precision, compiled); 0: by Triton"),
        ("factored", "1: the GEMV's scales and zeros once a word (BLOCK_M 1); 0: once a value"),
        ("swapped", "1: W x^T, W the dots' first operand (BLOCK_M >= 16); 0: x W^T"),
    ):
        p.add_argument(f"--{flag}", type=int, nargs="+", choices=(0, 1), default=[None], help=f"{what}")
    p.add_argument(
        "--kernels",
        nargs="+",
        choices=KERNELS,
        default=["triton"],
        help="the GEMMs timed (GAPLESS_INT4_KERNEL's)",
    )
    p.add_argument("--iters", type=cli.positive_int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--json", default=None, help="also write the rows to this file")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"int{args.bits} g{args.group} weight-only GEMM vs torch.mm {args.dtype} on {name}")
    cols = (
        "IN:OUT", "M", "bf16 us", "kernel", "BM", "BN", "split", "BK", "warps", "st", "dots", "int us",
        "GB/s", "x bf16",
    )  # fmt: skip
    widths = (12, 3, 9, 8, 3, 4, 5, 4, 5, 2, 4, 8, 7, 7)
    print(" ".join(f"{h:>{w}}" for h, w in zip(cols, widths, strict=True)))
    result = rows(args)
    for r in result:
        for v in r["variants"] or [dict(kernel="-", **_NO_TILES)]:
            line = (
                f"{r['shape']:>12} {r['m']:>3} {r['bf16_us']:>9.1f} {v['kernel']:>8} {v['block_m']:>3} "
                f"{v['block_n']:>4} {v['split_k']:>5} {v['block_k']:>4} {v['warps']:>5} {v['stages']:>2} "
                f"{v['dots']:>4} "
            )
            if "us" not in v:
                print(line + f"  cannot run: {v.get('error', 'no kernel here')}")
                continue
            print(
                line
                + f"{v['us']:>8.1f} {v['gb_s']:>7.0f} {v['vs_bf16']:>7.2f}"
                + (f"  (rel err {v['rel_err']:.1e})" if "rel_err" in v else "")
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=name, bits=args.bits, group=args.group, rows=result), f, indent=1)
    return result


if __name__ == "__main__":
    main()
