"""Whether inductor's C++ code generation writes a faster one-row int4 GEMM than torch's own CPU kernel
(issue 35: at one request the default model's int4 gate/up GEMMs take 7.7 ms of a ~26 ms compiled step).

The weight is a Q4_1-like int4 matrix (groups of 32 along K, a scale and an offset per group). Three ways
of computing `x @ W^T` for one row, each timed on the default model's shapes with one thread:

- `int4pack`: `torch.ops.aten._weight_int4pack_mm_for_cpu`, what gapless runs (bfloat16 activations);
- `rows`: `torch.compile` of the dequantize-and-dot written over the GGUF layout ([N, K / 32, 16] bytes,
  low nibbles the block's first 16 weights): inductor reduces each group of 32 horizontally;
- `columns`: the same over a K-major layout ([K / 2, N] bytes, two K rows a byte), so that inductor
  vectorizes across N and accumulates vertically.

    PYTHONPATH=. python bench/experiments/inductor_gemv.py [--threads 1]

Prints per shape the microseconds per call and each compiled version's time over `int4pack`'s, and checks
every result against the float32 product of the dequantized weight.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

GROUP = 32
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}


def _time(f: Callable[[], torch.Tensor], calls: int = 200) -> float:
    for _ in range(5):
        f()
    start = time.perf_counter()
    for _ in range(calls):
        f()
    return (time.perf_counter() - start) / calls * 1e6


def _rows(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    g = packed.shape[1]
    lo, hi = (packed & 15).float(), (packed >> 4).float()  # [N, G, 16]: weights 0-15 and 16-31
    xg = x.view(x.shape[0], 1, g, 2, 16)
    dot = (lo * xg[..., 0, :] + hi * xg[..., 1, :]).sum(-1)  # [M, N, G]
    return (dot * scale).sum(-1) + x.view(x.shape[0], g, GROUP).sum(-1) @ offset.t()


def _columns(
    x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor
) -> torch.Tensor:
    g, n = scale.shape  # scale, offset: [G, N]; packed: [K / 2, N], K rows 2j and 2j + 1 in byte j
    lo, hi = (packed & 15).float().view(g, 16, n), (packed >> 4).float().view(g, 16, n)
    xe = x.view(x.shape[0], g, 16, 2)
    dot = (lo * xe[..., 0, None] + hi * xe[..., 1, None]).sum(2)  # [M, G, N]
    return (dot * scale).sum(1) + x.view(x.shape[0], g, GROUP).sum(-1) @ offset


def _shape(name: str, n: int, k: int, gen: torch.Generator) -> str:
    """One shape's line: microseconds per call of each way, and the compiled ones' over `int4pack`'s."""
    g = k // GROUP
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
    scale = torch.rand(n, g, generator=gen) * 0.01
    offset = -torch.rand(n, g, generator=gen) * 0.05
    w = (q.float().view(n, g, GROUP) * scale[..., None] + offset[..., None]).view(n, k)
    x = torch.randn(1, k, generator=gen)
    blocks, qt = q.view(n, g, GROUP), q.t().contiguous()
    by_rows = (blocks[..., :16] | (blocks[..., 16:] << 4)).contiguous()
    by_columns = (qt[0::2] | (qt[1::2] << 4)).contiguous()
    scale_t, offset_t = scale.t().contiguous(), offset.t().contiguous()
    packed4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
    zeros = torch.stack([scale.t(), (offset + 8 * scale).t()], -1).bfloat16().contiguous()
    rows, columns = torch.compile(_rows, dynamic=False), torch.compile(_columns, dynamic=False)
    runs: dict[str, Callable[[], torch.Tensor]] = {
        "int4pack": lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x.bfloat16(), packed4, GROUP, zeros),
        "rows": lambda: rows(x, by_rows, scale, offset),
        "columns": lambda: columns(x, by_columns, scale_t, offset_t),
    }
    ref, us = x @ w.t(), {}
    for label, f in runs.items():
        err = float((f().float() - ref).abs().max() / ref.abs().max())
        assert err < 1e-2, (name, label, err)
        us[label] = _time(f)
    times = ", ".join(f"{label} {t:.0f} us" for label, t in us.items())
    ratios = ", ".join(f"{label} {us[label] / us['int4pack']:.1f}x" for label in ("rows", "columns"))
    return f"{name:8} {n}x{k}: {times}; {ratios}"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python bench/experiments/inductor_gemv.py")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    print(f"torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}, {args.threads} thread(s)")
    for name, (n, k) in SHAPES.items():
        print(_shape(name, n, k, gen), flush=True)


if __name__ == "__main__":
    main()
